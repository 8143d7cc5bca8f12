"""Zero-bubble schedules: split backward (B / W), schedule structure, training equals the
single-process reference, the fast (fused) path, and the refusals."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
from torch import nn

from tests.factories import skipnet
from trainwright.cli.main import main
from trainwright.config import Config
from trainwright.dist.testing import run_workers
from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.model.graph import layers_from_export
from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.stage import LayerSlot, Stage, StageOptions, StepMode
from trainwright.pipeline.store import ActivationStore
from trainwright.plan.simulate import Links, StageCost, simulate
from trainwright.run.launch import create_run_dir
from trainwright.schedule.actions import (
    COMPUTE,
    build_schedule,
    format_grid,
    max_in_flight,
)
from trainwright.schedule.dryrun import check_schedule

ZB = ("zb-h1", "zb-h2")


def _gpt_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt_layers(GPTConfig(vocab=64, context=8, d_model=16, n_heads=2, n_blocks=2))


@functools.cache
def _exported() -> list[nn.Module]:
    torch.manual_seed(0)
    model, args = skipnet()
    return list(layers_from_export(model, args))


def _skip_layers() -> list[nn.Module]:
    return copy.deepcopy(_exported())


def _grads(layers, inputs, targets, loss, policy: str, split: bool, fast: bool = False,
           first: bool = False, measured: int | None = None, defer: bool = False):
    # first=False: integer inputs need no gradient either way, and a first stage would defer
    # its whole backward to W (tested on its own below), never splitting it
    store = ActivationStore()
    slots = [LayerSlot(i, f"l{i}", m) for i, m in enumerate(layers)]
    options = StageOptions(split_backward=defer, mode=StepMode(fast=fast, measured_mb=measured))
    stage = Stage(slots, store, LayerProfiler(), is_first=first, loss_fn=loss,
                  loss_scale=1 / len(inputs), options=options)
    store.set_policies({i: policy for i in range(len(layers))})
    for mb, (x, y) in enumerate(zip(inputs, targets, strict=True)):
        stage.forward(mb, (x,), y)
    held = len(store.held())
    for mb in range(len(inputs)):
        stage.backward(mb, split=split)
        if split:
            assert store.held(), "B must leave the segments held until W"
    for mb in range(len(inputs)):
        stage.backward_weight(mb)
    assert store.held() == [] and store.bytes == 0
    stage.profiler.end_step()
    measured_layers = sorted(c.layer for c in stage.profiler.table() if c.forward_s > 0)
    assert measured_layers == ([] if fast and measured is None else list(range(len(layers))))
    return [p.grad.clone() for p in stage.parameters()], held


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["keep", "swap", "recompute"])
def test_split_backward_equals_unsplit_for_every_layer_kind(policy):
    torch.manual_seed(1)
    ce = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    mse = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    cases = [  # GPT: embedding (integer input: all W), blocks, head; exported skip net
        (_gpt_layers, [torch.randint(0, 64, (2, 8)) for _ in range(3)],
         [torch.randint(0, 64, (2, 8)) for _ in range(3)], ce),
        (_skip_layers, [torch.randn(4, 16) for _ in range(3)],
         [torch.randn(4, 4) for _ in range(3)], mse),
    ]
    for build, xs, ys, loss in cases:
        plain, _ = _grads(build(), xs, ys, loss, policy, split=False)
        # through autograd alone, and with linear layers deferred (their weight side stashed
        # by B, or returned at once by an unsplit backward)
        for split, defer in [(True, False), (True, True), (False, True)]:
            got, _ = _grads(build(), xs, ys, loss, policy, split=split, defer=defer)
            for a, b in zip(plain, got, strict=True):
                torch.testing.assert_close(a, b)


@pytest.mark.timeout(180)
def test_fast_step_fuses_keep_layers_with_equal_gradients():
    xs = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    ys = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    ce = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    base, held = _grads(_gpt_layers(), xs, ys, ce, "keep", split=False)
    for split in (False, True):
        fused, fused_held = _grads(_gpt_layers(), xs, ys, ce, "keep", split=split, fast=True,
                                   defer=split)
        for a, b in zip(base, fused, strict=True):
            torch.testing.assert_close(a, b)
        assert (held, fused_held) == (4 * 2, 1 * 2)  # 4 layers, one segment per micro-batch
        # a profile step: micro-batch 1 runs layer by layer, measured; micro-batch 0 fused
        sampled, sampled_held = _grads(_gpt_layers(), xs, ys, ce, "keep", split=split,
                                       fast=True, measured=1, defer=split)
        for a, b in zip(base, sampled, strict=True):
            torch.testing.assert_close(a, b)
        assert sampled_held == 1 + 4
    # a swap layer in the middle splits the fused run in two
    store = ActivationStore()
    stage = Stage([LayerSlot(i, f"l{i}", m) for i, m in enumerate(_gpt_layers())], store,
                  LayerProfiler(), is_first=True)
    store.set_policies({1: "swap"})
    stage.options.mode = StepMode(fast=True)
    assert stage._runs() == [[0], [1], [2, 3]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("steps", "profiled"), [(7, [3, 6]), (2, [2])])
def test_profile_steps_are_every_nth_and_the_last_only_of_a_short_run(tiny, steps, profiled):
    """Every ``run.profile_every``-th step runs its first micro-batch unfused and writes a
    ``layers`` row; the last step does too only when the run had no such step after its
    first. Every other step after the first fuses every micro-batch."""
    from trainwright.dist.topology import Topology
    from trainwright.run.trainer import Trainer, TrainerOptions
    cfg = tiny(**{"parallel.pp": 1, "train.steps": steps, "run.profile_every": 3})
    trainer = Trainer(cfg, create_run_dir(cfg),
                      options=TrainerOptions(mesh=Topology(pp=1, dp=1, rank=0)))
    seen: list[tuple] = []
    trainer.fit(lambda step, _: seen.append((step, trainer.stage.fast,
                                             trainer.stage.measured_mb)))
    rows = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "layers"] == profiled
    assert seen == [(k, k > 1, 0 if k in profiled else None) for k in range(1, steps + 1)]


@pytest.mark.parametrize("fast", [False, True])
def test_first_stage_defers_its_backward_to_w(fast):
    """Nobody waits for the first stage's input gradients: its B does nothing and its W runs
    one unsplit backward, with the gradients of the unsplit reference."""
    xs = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    ys = [torch.randint(0, 64, (2, 8)) for _ in range(2)]
    ce = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    base, _ = _grads(_gpt_layers(), xs, ys, ce, "keep", split=False)
    store = ActivationStore()
    stage = Stage([LayerSlot(i, f"l{i}", m) for i, m in enumerate(_gpt_layers())], store,
                  LayerProfiler(), is_first=True, loss_fn=ce, loss_scale=1 / len(xs),
                  options=StageOptions(mode=StepMode(fast=fast)))
    for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
        stage.forward(mb, (x,), y)
    held = store.held()
    for mb in range(len(xs)):
        assert stage.backward(mb, split=True) == (None,)
    assert store.held() == held  # B touched nothing
    assert all(p.grad is None for p in stage.parameters())
    for mb in range(len(xs)):
        stage.backward_weight(mb)
    assert store.held() == [] and store.bytes == 0
    for a, b in zip(base, stage.parameters(), strict=True):
        torch.testing.assert_close(a, b.grad)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ZB)
def test_zero_bubble_schedules_are_deadlock_free_and_complete(name):
    for p in range(2, 7):
        for m in (p, 2 * p, 4 * p):
            sched = build_schedule(name, p, m)
            check_schedule(sched)
            format_grid(sched)  # raises on a deadlock of the compute order
            for acts in sched:
                order = [(a.kind, a.mb) for a in acts if a.kind in COMPUTE]
                assert sorted(order) == sorted((k, i) for k in "FBW" for i in range(m))
                for i in range(m):
                    f, b, w = (order.index((k, i)) for k in "FBW")
                    assert f < b < w
            flights = [max_in_flight(a) for a in sched]
            one_f = [max_in_flight(a) for a in build_schedule("1f1b", p, m)]
            if name == "zb-h1":  # the busiest stage holds what 1F1B's does
                assert max(flights) == max(one_f), (p, m, flights, one_f)


@pytest.mark.timeout(180)
def test_simulated_zero_bubble_has_less_bubble_than_1f1b():
    for p, m in ((2, 8), (4, 8), (4, 16)):
        costs = [StageCost(1.0, 2.0, weight_s=1.0) for _ in range(p)]
        links = Links(list(range(p)), [[1e12] * p] * p)
        step = {n: simulate(build_schedule(n, p, m), costs, links).step_s
                for n in ("1f1b", *ZB)}
        assert step["zb-h2"] <= step["zb-h1"] < step["1f1b"], (p, m, step)
        assert step["1f1b"] == pytest.approx(3 * m + 3 * (p - 1))


def _zb_matrix(tiny, world: int) -> list[Config]:
    two = {"train.steps": 3, "train.micro_batches": 4}  # step 2 is a fast (fused) step
    cfgs = [tiny(**two, **{"parallel.pp": world, "train.schedule": f'"{s}"'}) for s in ZB]
    if world == 4:
        cfgs += [tiny(**two, **{"parallel.pp": 2, "parallel.dp": 2,
                                "train.schedule": f'"{s}"'}) for s in ZB]
    else:
        cfgs += [tiny(**two, **{"parallel.pp": 2, "train.schedule": f'"{s}"',
                                "memory.policies": pol})
                 for s in ZB for pol in ('["swap", "recompute", "keep", "recompute"]',
                                         '["recompute", "swap", "swap", "keep"]')]
    return cfgs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero_bubble_trains_equal_to_single_process(tiny, world):
    from tests.helpers import check_against_reference, step_rows, train_jobs
    cfgs = _zb_matrix(tiny, world)
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(train_jobs, world, list(zip(cfgs, map(str, dirs), strict=True)), timeout_s=380)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        label = (f"pp={cfg.parallel.pp} dp={cfg.parallel.dp} {cfg.train.schedule} "
                 f"{cfg.memory.policies}")
        try:
            check_against_reference(cfg, run_dir)
            sched = build_schedule(cfg.train.schedule, cfg.parallel.pp, cfg.train.micro_batches)
            for row in step_rows(run_dir):
                for st in row["stages"]:
                    assert st["held_microbatches_peak"] == max_in_flight(sched[st["stage"]])
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [["memory.peer_swap=true", 'memory.limit="64MB"'],
                                   ["rebalance.enabled=true"]])
def test_migration_and_peer_swap_are_refused_with_zero_bubble(tmp_path, capsys, extra):
    args = ["run", "--set", f'run.dir="{tmp_path}"', "--set", 'train.schedule="zb-h1"']
    for e in extra:
        args += ["--set", e]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and '"1f1b"' in err and "zb-h1" in err, err
    assert not any(tmp_path.iterdir())


def test_cli_schedule_prints_zero_bubble(capsys):
    assert main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "W3" in out and "B3" in out



@pytest.mark.timeout(180)
def test_memory_planner_counts_what_waits_for_w():
    from trainwright.plan.memory import InFlight, LayerMem, min_feasible_bytes, required_bytes
    from trainwright.schedule.actions import max_waiting_w

    layers = [LayerMem(0, saved_bytes=100, input_bytes=10, forward_s=1.0, backward_s=1.0),
              LayerMem(1, saved_bytes=50, input_bytes=10, forward_s=1.0, backward_s=1.0)]
    pol = {0: "recompute", 1: "swap"}
    assert required_bytes(layers, pol, 3) == 3 * 20 + 100
    assert required_bytes(layers, pol, InFlight(3, 2)) == 3 * 20 + 100 + 2 * 150
    assert min_feasible_bytes(layers, InFlight(3, 2)) == 3 * 20 + 2 * 150 + 100 + 1
    sched = build_schedule("zb-h1", 4, 8)
    assert [max_waiting_w(a) for a in build_schedule("1f1b", 4, 8)] == [0] * 4
    waits = [max_waiting_w(a) for a in sched]
    assert all(1 <= w <= max_in_flight(a) for w, a in zip(waits, sched, strict=True))


@pytest.mark.timeout(180)
def test_plan_auto_picks_the_schedule_of_least_predicted_step(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--schedule", "auto", "--pp", "2", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    tried = [t for t in plan["depths_tried"] if "step_s" in t]
    assert {t["schedule"] for t in tried} == {"1f1b", "gpipe", *ZB, "interleaved-1f1b", "zb-v"}
    best = min(tried, key=lambda t: (not t["fits"], t["step_s"]))
    assert (plan["schedule"], plan["virtual_stages"]) == (best["schedule"],
                                                          best["virtual_stages"])
    assert main(["schedule", "--schedule", "zb-h2", "--pp", "3", "--micro-batches", "6"]) == 0
