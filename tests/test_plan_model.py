"""Plan the user's own model, then run the plan (issue 33).

* a stage-to-rank mapping (``parallel.mapping``) trains equal to the one-process reference:
  send/receive peers and data-parallel groups follow the permutation;
* ``trainwright plan --model SPEC`` for a Hugging Face ``config.json`` (Llama-style 8 B and
  GPT-2, written here, built on the meta device) and for small models measured for real;
* ``trainwright run --plan`` runs exactly the plan's choices and refuses a plan for other
  devices or another model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import check_against_reference, run_dir_from_stdout
from trainwright.bench.plan_pick import GPT2, LLAMA_8B
from trainwright.config import Config
from trainwright.dist.testing import run_workers
from trainwright.errors import ConfigError
from trainwright.run.launch import create_run_dir


def _train_recording_layers(rank: int, world: int, jobs: list[tuple[Config, str]]) -> None:
    """``run_workers`` target: train each job; write which layers this rank held."""
    from trainwright.run.trainer import Trainer

    for cfg, run_dir in jobs:
        trainer = Trainer(cfg, Path(run_dir))
        held = [slot.index for slot in trainer.slots]
        trainer.fit()
        trainer.close()
        Path(run_dir, f"layers_{rank}.json").write_text(json.dumps(held))


def _run_row(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "run")


@pytest.mark.timeout(240)
def test_permuted_mapping_trains_equal_to_reference(tiny):
    cfgs = [tiny(**{"parallel.pp": 4, "parallel.mapping": "[2, 0, 3, 1]",
                    "train.schedule": '"1f1b"', "train.micro_batches": 4}),
            tiny(**{"parallel.pp": 2, "parallel.dp": 2, "parallel.mapping": "[1, 0]",
                    "train.micro_batches": 2, "model.name": '"mlp"', "model.n_blocks": 3})]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(_train_recording_layers, 4, list(zip(cfgs, map(str, dirs), strict=True)),
                timeout_s=220)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        check_against_reference(cfg, run_dir)
        pp, order, parts = cfg.parallel.pp, cfg.parallel.mapping, cfg.partition()
        for rank in range(cfg.world_size):
            stage = order.index(rank % pp)
            first = sum(parts[:stage])
            held = json.loads((run_dir / f"layers_{rank}.json").read_text())
            assert held == list(range(first, first + parts[stage])), (rank, stage, held)
        assert _run_row(run_dir)["mapping"] == order




@pytest.mark.slow
@pytest.mark.timeout(170)
@pytest.mark.parametrize("name,hf,params", [("llama8b", LLAMA_8B, 8_030_261_248),
                                            ("gpt2", GPT2, 124_439_808)])
def test_plan_hf_config(tmp_path, name, hf, params):
    pytest.importorskip("transformers")
    import time

    from trainwright.cli.main import main

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    out = tmp_path / "plan.json"
    cpu0 = time.process_time()
    assert main(["plan", "--model", str(folder / "config.json"), "--topology", "nvswitch8",
                 "--gpu-memory", "80GB", "--nodes", "2", "--global-batch", "256", "--dtype",
                 "bfloat16", "--json", str(out)]) == 0
    cpu = time.process_time() - cpu0  # wall time on this shared 2-core host is the load's
    assert cpu < 30, f"planning took {cpu:.1f} s of CPU"
    plan = json.loads(out.read_text())
    assert plan["params"] == params
    per = plan["bytes_per_param"]
    assert (per["weights"], per["grads"], per["optimizer"]) == (2, 2, 12)  # bf16, AdamW
    held = sum(sum(s.values()) for s in plan["state_bytes"])
    assert held * plan["dp"] == pytest.approx(params * 16 * plan["dp"], rel=0.01)
    rows = plan["ranked"]
    assert rows[0]["fits"] and rows[0]["step_s"] == min(r["step_s"] for r in rows if r["fits"])
    assert {r["schedule"] for r in rows} >= {"1f1b", "gpipe", "zb-h1", "zb-h2", "zb-v",
                                             "interleaved-1f1b"}
    assert all(r["reason"] for r in rows if not r["fits"])
    assert max(rows[0]["peak_bytes"]) <= 80e9
    assert Path(plan["toml"]).exists()


TINY = ["--set", "model.n_blocks=2", "--set", "model.d_model=32", "--set", "model.n_heads=2",
        "--set", "model.context=16", "--set", "data.name=synthetic", "--set",
        "train.batch_size=16", "--set", "train.optimizer=sgd", "--set", "train.lr=0.1",
        "--set", "train.steps=3"]


def _slow_link_topology(path: Path) -> Path:
    """Four CPU ranks, every link at loopback speed except devices 1 <-> 2, nearly cut: a
    pipeline 0-1-2-3 on ranks 0-1-2-3 would cross it, so the best mapping is not the
    identity."""
    fast, n = 2.6e9, 4
    bw = [[0.0 if i == j else fast for j in range(n)] for i in range(n)]
    bw[1][2] = bw[2][1] = 1e5
    path.write_text(json.dumps({"name": "cpu4-slow-link", "kind": "cpu", "memory": [2**31] * n,
                                "bandwidth": bw, "host_bandwidth": [5.4e9] * n}))
    return path


@pytest.mark.timeout(240)
def test_run_plan_trains_the_pick_permuted_equal_to_reference(tmp_path, capsys):
    from trainwright.cli.main import main
    from trainwright.run.plan_file import load_plan_config

    topo = _slow_link_topology(tmp_path / "topo.json")
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", *TINY, "--topology", str(topo), "--pp", "4",
                 "--reserve", "0", "--no-calibration", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    order = plan["run_config"]["parallel"]["mapping"]
    assert order != [0, 1, 2, 3], plan["mapping"]
    stage_of = {o: s for s, o in enumerate(order)}
    for s in range(3):  # no pipeline neighbours on the nearly cut link
        assert {order[s], order[s + 1]} != {1, 2}, order
    assert len(stage_of) == 4
    runs = tmp_path / "runs"
    extra = [f'run.dir="{runs}"', "run.report=false", "run.progress=false"]
    cfgs = [load_plan_config(out, extra, cuda=False),
            load_plan_config(Path(plan["toml"]), extra, cuda=False)]
    assert cfgs[0].to_dict() == cfgs[1].to_dict()
    cfg = cfgs[0]
    assert (cfg.parallel.pp, cfg.train.schedule, cfg.train.micro_batches) == \
        (plan["pp"], plan["schedule"], plan["micro_batches"])
    assert cfg.parallel.partition == [len(p) for p in plan["partition"]]
    assert cfg.parallel.mapping == order
    capsys.readouterr()
    assert main(["run", "--plan", plan["toml"], *(x for kv in extra for x in ("--set", kv))]) == 0
    run_dir = run_dir_from_stdout(capsys.readouterr().out)
    check_against_reference(cfg, run_dir)  # which rank holds which stage: the test above
    assert _run_row(run_dir)["mapping"] == order


def test_run_plan_refuses_other_devices_and_other_models(tmp_path, capsys):
    from trainwright.cli.main import main
    from trainwright.run.plan_file import load_plan_config

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", *TINY, "--topology", "cpu", "--devices", "2",
                 "--pp", "2", "--reserve", "0", "--micro-batch-size", "4", "--schedule",
                 "1f1b", "--no-calibration", "--json", str(out)]) == 0
    load_plan_config(out, cuda=False)  # the plan's own model on the plan's devices
    with pytest.raises(ConfigError, match="made for gpt .*4 layers.*builds 5 layers"):
        load_plan_config(out, ["model.n_blocks=3"], cuda=False)
    with pytest.raises(ConfigError, match="made for CPU ranks and this machine has GPUs"):
        load_plan_config(out, cuda=True)
    gpus = json.loads(out.read_text())
    gpus["fingerprint"]["device_kind"] = "cuda"
    other = tmp_path / "gpus.json"
    other.write_text(json.dumps(gpus))
    capsys.readouterr()
    assert main(["run", "--plan", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was made for 2 GPUs" in err[0], err


def test_cpu_plan_uses_this_hosts_calibration(tmp_path, capsys, monkeypatch):
    import trainwright.bench.calibrate as calibrate_mod
    from trainwright.cli.main import main
    from trainwright.plan.calibration import Calibration

    cal = Calibration({"cpu_model": "injected"}, 2, action_s=2e-3, segment_s=1e-4,
                      send_s=5e-5, recv_s=1e-4, slowdown={1: 1.0, 2: 1.5})
    calls = []
    monkeypatch.setattr(calibrate_mod, "calibrate", lambda **kw: calls.append(kw) or cal)
    model = ["plan", "--model", "gpt", *TINY, "--devices", "2", "--reserve", "0", "--top", "2"]
    args = [*model, "--topology", "cpu"]
    out = tmp_path / "plan.json"
    assert main([*args, "--json", str(out)]) == 0
    assert len(calls) == 1  # loaded (or measured) once, not per candidate
    assert "includes this host's calibration: action/segment/send/recv 2000/100/50/100 us" \
        in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["calibration"] == cal.to_dict()
    assert plan["predicted"]["slowdown"] > 1.0  # two ranks computing at once
    assert main(["simulate", str(out)]) == 0  # the replay charges what the plan did
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["step_s"] == pytest.approx(plan["predicted"]["step_s"])
    plain = tmp_path / "plain.json"
    assert main([*args, "--no-calibration", "--json", str(plain)]) == 0
    plain_plan = json.loads(plain.read_text())  # (profiled afresh: its times differ)
    assert len(calls) == 1 and plain_plan["calibration"] is None
    assert plain_plan["predicted"]["slowdown"] == 1.0
    assert all(not c["action_s"] for c in plain_plan["stage_costs"])
    gpus = tmp_path / "gpus.json"  # GPUs: never this host's calibration
    assert main([*model, "--topology", "nvswitch8", "--json", str(gpus)]) == 0
    assert len(calls) == 1 and json.loads(gpus.read_text())["calibration"] is None


def test_a_measured_model_is_profiled_at_every_micro_batch_size(tmp_path, monkeypatch):
    import trainwright.cli.plan_model as plan_model
    from trainwright.cli.main import main

    sizes, measured = [], plan_model._measured_rows

    def spy(model, cfg, size):
        sizes.append(size)
        return measured(model, cfg, size)

    monkeypatch.setattr(plan_model, "_measured_rows", spy)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", *TINY, "--topology", "cpu", "--devices", "2",
                 "--reserve", "0", "--no-calibration", "--json", str(out)]) == 0
    assert sorted(sizes) == [1, 2]  # each size measured, not the one-sample profile scaled
    from trainwright.config import load_config

    cfg = load_config(None, TINY[1::2])  # the --set values
    one, two = measured("gpt", cfg, 1), measured("gpt", cfg, 2)
    assert [r.input_bytes * 2 for r in one] == [r.input_bytes for r in two]
    assert all(r.forward_s > 0 and r.backward_s > 0 for r in [*one, *two])


class _StepTimer:
    """An injected :class:`~trainwright.observe.timing.Timer`: the n-th timed piece of work
    takes n seconds."""

    def __init__(self):
        self.n = 0

    def start(self):
        return None

    def stop(self, mark) -> float:
        self.n += 1
        return float(self.n)


def test_profile_times_come_from_the_device_timer():
    import torch

    from trainwright.observe.tensor_profile import profile_tensors
    from trainwright.observe.timing import WallTimer, device_timer

    assert isinstance(device_timer(torch.device("cpu")), WallTimer)
    torch.manual_seed(0)
    layers = [("a", torch.nn.Linear(4, 4)), ("b", torch.nn.Linear(4, 2))]
    timer = _StepTimer()
    assert not isinstance(timer, WallTimer)  # duck-typed: anything with start / stop
    rows = profile_tensors(layers, torch.randn(3, 4), steps=1, timer=timer)
    # forward a, forward b, then backward b, backward a: 1, 2, 3, 4 seconds
    assert [(r.forward_s, r.backward_s) for r in rows] == [(1.0, 4.0), (2.0, 3.0)]


def _gather_free(rank: int, world: int, out: str) -> None:
    from trainwright.dist.topology import Topology
    from trainwright.pipeline.peer_setup import stage_free_bytes

    topo = Topology.create(2, 1, [1, 0])  # stage 0 on rank 1
    got = stage_free_bytes(topo, 1000 + rank)
    Path(out, f"free_{rank}.json").write_text(json.dumps(got))
    topo.destroy()


@pytest.mark.timeout(120)
def test_each_stage_plans_with_its_own_free_memory(tmp_path):
    run_workers(_gather_free, 2, str(tmp_path), timeout_s=100)
    for rank in range(2):  # stage order, each stage's own figure (not rank 0's twice)
        assert json.loads((tmp_path / f"free_{rank}.json").read_text()) == [1001, 1000]
