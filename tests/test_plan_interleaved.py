"""Planning with several model chunks per rank (interleaved 1F1B, ZB-V): per-chunk memory
states, the planner's predicted step, and ``--schedule auto``. Pure, no processes."""

from __future__ import annotations

import itertools
import json

import pytest

from trainwright.cli.main import main
from trainwright.config import load_config
from trainwright.errors import PlanError
from trainwright.observe.tensor_profile import LayerTensors, SavedTensor
from trainwright.plan.choose import best_plan, schedule_candidates
from trainwright.plan.devices import preset
from trainwright.plan.memory import (
    ChunkInFlight,
    LayerMem,
    added_time,
    greedy_plan,
    min_feasible_bytes,
    optimal_plan,
    required_bytes,
)
from trainwright.plan.planner import PlanRequest, make_plan
from trainwright.plan.simulate import Links, simulate
from trainwright.schedule.actions import ActionKind, build_schedule, stage_ranks
from trainwright.schedule.carry import steady_state
from trainwright.schedule.occupancy import chunk_states

IL = "interleaved-1f1b"


def _walk_peak(actions, held: dict[int, int], back: dict[int, int]) -> int:
    """Most bytes a rank holds, walking its list: chunk ``c`` holds ``held[c]`` per
    micro-batch from F to its release (W, or B without W), plus ``back[c]`` from B to W."""
    split = any(a.kind == ActionKind.W for a in actions)
    cur = peak = 0
    for a in actions:
        if a.kind == ActionKind.F:
            cur += held[a.stage]
        elif a.kind == ActionKind.B:
            cur += back[a.stage] if split else 0
            peak = max(peak, cur)
            cur -= 0 if split else held[a.stage]
        elif a.kind == ActionKind.W:
            cur -= held[a.stage] + back[a.stage]
        peak = max(peak, cur)
    return peak


def _rank_layers(p: int, v: int, schedule: str, r: int) -> list[LayerMem]:
    """Two layers per chunk of rank ``r``, sizes differing by chunk and layer."""
    ranks = stage_ranks(schedule, p, v)
    out = []
    for k in (k for k in range(p * v) if ranks[k] == r):
        for j in range(2):
            i = 2 * k + j
            out.append(LayerMem(i, 1000 * (i + 1) + 37 * j, 100 + 10 * i, 1e-3 * (1 + j),
                                2e-3, chunk=k))
    return out


@pytest.mark.parametrize("schedule, p, m, v", [(IL, 2, 4, 2), (IL, 3, 6, 3), (IL, 4, 8, 2),
                                               ("zb-v", 2, 4, 2), ("zb-v", 4, 8, 2)])
def test_chunk_states_give_the_walked_peak_for_any_policies(schedule, p, m, v):
    for r, actions in enumerate(build_schedule(schedule, p, m, v)):
        flight = ChunkInFlight(chunk_states(actions))
        layers = _rank_layers(p, v, schedule, r)
        for pols in (["keep"], ["recompute"], ["keep", "swap", "recompute"]):
            policies = {x.layer: pols[j % len(pols)] for j, x in enumerate(layers)}
            held, back, transient = {}, {}, 0
            for x in layers:
                keep = policies[x.layer] == "keep"
                held[x.chunk] = held.get(x.chunk, 0) + x.input_bytes + keep * x.saved_bytes
                back[x.chunk] = back.get(x.chunk, 0) + (not keep) * x.saved_bytes
                transient = max(transient, 0 if keep else x.saved_bytes)
            expect = _walk_peak(actions, held, back) + transient
            assert required_bytes(layers, policies, flight) == expect, (schedule, r, pols)


def test_min_feasible_and_optimal_plan_are_exact_with_chunks():
    p, v, m = 2, 2, 4
    for schedule in (IL, "zb-v"):
        actions = build_schedule(schedule, p, m, v)[0]
        flight = ChunkInFlight(chunk_states(actions))
        layers = _rank_layers(p, v, schedule, 0)[:5]
        everything = [dict(zip([x.layer for x in layers], pols, strict=True))
                      for pols in itertools.product(("keep", "swap", "recompute"),
                                                    repeat=len(layers))]
        least = min(required_bytes(layers, pol, flight) for pol in everything)
        assert min_feasible_bytes(layers, flight) == least + 1
        keep = required_bytes(layers, {}, flight)
        limit = (least + keep) // 2
        fitting = [pol for pol in everything if required_bytes(layers, pol, flight) < limit]
        best = min(added_time(layers, pol, 1e6) for pol in fitting)
        plan = optimal_plan(layers, flight, limit, 1e6)
        assert plan.required_bytes < limit
        assert plan.added_time_s == pytest.approx(best, rel=1e-6, abs=1e-12)
        greedy = greedy_plan(layers, flight, limit, 1e6)  # the greedy rule: may not fit
        assert greedy.required_bytes >= limit or greedy.added_time_s >= plan.added_time_s


def _rows(n: int, fwd: float = 0.25, bwd: float = 0.5, out_bytes: int = 0) -> list:
    """``n`` equal layers; saved tensors of different sizes."""
    return [LayerTensors(i, f"l{i}", fwd, bwd, input_bytes=64, output_bytes=out_bytes,
                         param_bytes=1000,
                         tensors=[SavedTensor(0, 1000 * (1 + i % 3), [1], "float32")])
            for i in range(n)]


def _request(rows, schedule, p, m, v=1, **kw) -> PlanRequest:
    return PlanRequest(rows, schedule, p, m, preset("nvswitch8", 2**34), peer_swap=False,
                       virtual_stages=v, **kw)


# ZB-V: 12.5, the first stage's B free and its W the whole backward (Stage.backward); 12.0
# in steady state, rank 1 running its carried W, SYNC and STEP while rank 0 forwards
@pytest.mark.parametrize("schedule, v, unit_step", [(IL, 2, 13.5), (IL, 4, 12.75),
                                                    ("zb-v", 2, 12.0), ("1f1b", 1, 15.0)])
def test_planned_step_is_the_replay_of_each_chunks_costs(schedule, v, unit_step):
    # p = 2, m = 4, 8 layers of F = 0.25, B = 0.5: a rank's F = 1 and B = 2 in all, split
    # over its chunks; free links. The unit-cost step of docs/schedules.md's tables.
    p, m, rows = 2, 4, _rows(8)
    plan = make_plan(_request(rows, schedule, p, m, v))
    assert plan.virtual_stages == v and len(plan.partition) == p * v
    assert plan.stage_ranks == stage_ranks(schedule, p, v)
    for k, idx in enumerate(plan.partition):
        assert plan.costs[k].forward_s == pytest.approx(sum(rows[i].forward_s for i in idx))
        assert plan.costs[k].backward_s == pytest.approx(sum(rows[i].backward_s for i in idx))
    lists = build_schedule(schedule, p, m, v)
    replay = simulate(steady_state(lists) if schedule == "zb-v" else lists, plan.costs,
                      Links(list(range(p)), plan.stage_bandwidth))
    if schedule == "zb-v":  # without carrying: the step of docs/schedules.md's table
        whole = make_plan(_request(rows, schedule, p, m, v, carry_weight_grads=False))
        assert whole.sim.step_s == pytest.approx(12.5)
    assert plan.sim.step_s == pytest.approx(replay.step_s)
    assert plan.sim.step_s == pytest.approx(unit_step)
    assert sum(plan.sim.busy_s) == pytest.approx(p * m * 3)
    cfg = plan.to_dict()["config"]
    assert cfg == {"train.schedule": schedule, "train.micro_batches": m, "parallel.pp": p,
                   "parallel.virtual_stages": v,
                   "parallel.partition": [len(x) for x in plan.partition]}


def test_auto_picks_the_least_step_and_the_config_runs():
    # p = 4, m = 8, 16 equal layers, free links: unit steps 1F1B 33, ZB-H1 29, ZB-H2 27,
    # interleaved v = 2 28.5, v = 4 26.25 (3m + 3(p - 1) / v), ZB-V 25.5 (docs/schedules.md),
    # 24 = the bound in steady state, ranks 1-3 running their carried W passes first
    rows = _rows(16, fwd=0.25, bwd=0.5)
    cands, skipped = schedule_candidates(4, 8, 16)
    assert ("zb-v", 2) in cands and (IL, 4) in cands and not skipped
    plan, tried = best_plan(_request(rows, "1f1b", 4, 8), cands)
    assert (plan.schedule, plan.virtual_stages) == ("zb-v", 2), tried
    step = {(t["schedule"], t["virtual_stages"]): t["step_s"] for t in tried}
    assert step[(IL, 4)] == pytest.approx(24 + 3 * 3 / 4)
    assert step[("zb-h2", 1)] == pytest.approx(27)
    assert step[(IL, 2)] == pytest.approx(28.5) and step[("1f1b", 1)] == pytest.approx(33)
    assert plan.sim.step_s == pytest.approx(24)
    assert plan.sim.step_s == min(step.values())
    keys = plan.to_dict()["config"]
    overrides = [f"{k}={json.dumps(x)}" for k, x in keys.items()]
    cfg = load_config(None, [*overrides, "model.n_blocks=14", "train.batch_size=32"])
    cfg.check_layers(16)  # the trainer's own checks: partition of pp * v stages
    assert cfg.parallel.partition == [len(x) for x in plan.partition]


def test_candidates_leave_out_what_cannot_run():
    cands, skipped = schedule_candidates(4, 6, 20)  # 6 micro-batches, 4 ranks
    assert ("zb-v", 2) in cands and not any(s == IL for s, _ in cands)
    assert all("not a multiple of pp = 4" in r["skipped"] for r in skipped)
    cands, skipped = schedule_candidates(4, 8, 6)  # 6 layers: no 8 stages
    assert not any(v > 1 for _, v in cands) and len(skipped) == 4
    assert all("more than the model's 6 layers" in r["skipped"] for r in skipped)
    cands, _ = schedule_candidates(2, 4, 6)
    assert [c for c in cands if c[1] > 1] == [("zb-v", 2), (IL, 2), (IL, 3)]
    with pytest.raises(PlanError, match="multiple of parallel.pp"):
        make_plan(_request(_rows(16), IL, 4, 6, 2))
    with pytest.raises(PlanError, match="8 stages need at least 8 layers"):
        make_plan(_request(_rows(6), "zb-v", 4, 8, 2))


@pytest.mark.timeout(120)
def test_cli_plan_auto_names_schedule_and_chunks(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--schedule", IL, "--virtual-stages", "2", "--pp", "2", "--meta",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["schedule"] == IL and plan["virtual_stages"] == 2
    assert len(plan["partition"]) == 4 and plan["config"]["parallel.virtual_stages"] == 2
    assert "x 2 chunks per rank" in text and "parallel.virtual_stages=2" in text
    assert main(["simulate", str(out)]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["step_s"] == pytest.approx(plan["predicted"]["step_s"])
    assert main(["plan", "--schedule", "auto", "--pp", "2", "--meta", "--json", str(out)]) == 0
    tried = json.loads(out.read_text())["depths_tried"]
    assert {(t["schedule"], t["virtual_stages"]) for t in tried} >= {
        ("1f1b", 1), ("zb-h2", 1), ("zb-v", 2), (IL, 2), (IL, 3), (IL, 4)}


@pytest.mark.parametrize("schedule, v", [("zb-v", 2), ("zb-h1", 1), (IL, 2)])
def test_simulated_memory_holds_each_chunks_bytes_and_what_waits_for_w(schedule, v):
    from trainwright.plan.simulate import StageCost
    p, m = 2, 4
    sched = build_schedule(schedule, p, m, v)
    n = p * v
    costs = [StageCost(1.0 + k, 2.0, held_bytes=1000 * (k + 1), transient_bytes=7,
                       w_held_bytes=100 * (k + 1)) for k in range(n)]
    r = simulate(sched, costs, Links(list(range(p)), [[1e12] * p] * p))
    for rank, actions in enumerate(sched):
        held = {k: costs[k].held_bytes for k in range(n)}
        split = any(a.kind == ActionKind.W for a in actions)
        # split backward: B brings back w_held, kept with the rest until W; else transient
        back = {k: costs[k].w_held_bytes if split else costs[k].transient_bytes
                for k in range(n)}
        cur = peak = 0
        for a in actions:
            if a.kind == ActionKind.F:
                cur += held[a.stage]
            elif a.kind == ActionKind.B:
                cur += back[a.stage]
                peak = max(peak, cur)
                cur -= 0 if split else held[a.stage] + back[a.stage]
            elif a.kind == ActionKind.W:
                cur -= held[a.stage] + back[a.stage]
            peak = max(peak, cur)
        assert r.own_peak_bytes[rank] == peak, (schedule, rank)


@pytest.mark.parametrize("args, needle", [
    (["--schedule", "1f1b", "--virtual-stages", "2"], "goes with --schedule interleaved"),
    (["--schedule", "zb-v", "--virtual-stages", "3"], "exactly 2 chunks per rank"),
    (["--schedule", IL, "--virtual-stages", "1"], "needs 2 or more chunks")])
def test_cli_plan_refuses_virtual_stages_that_do_not_fit_the_schedule(args, needle, capsys,
                                                                     tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--meta", "--pp", "2", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()
