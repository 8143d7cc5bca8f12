"""The command line: bad configs, resume, a killed worker, and the default run's outputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.helpers import run_dir_from_stdout
from trainwright.cli import main
from trainwright.config import load_config
from trainwright.dist.ports import free_port
from trainwright.run.api import load_model
from trainwright.run.reference import train_reference

BAD = [
    (["--set", "train.stesp=3"], r"unknown config key 'train.stesp'; did you mean 'train.steps'"),
    (["--set", "train.steps=ten"], r"train.steps = 'ten' has the wrong type \(str\); expected an"),
    (["--set", "parallel.pp=7"], r"parallel.pp = 7 is larger than the model's 6 layers"),
    (["--set", "train.micro_batches=5"],
     r"train.micro_batches = 5 does not divide the per-replica batch 32 .*allowed: \[1, 2, 4"),
    (["--set", "train.schedule=zb"], r"train.schedule = 'zb' is not allowed; choose one of"),
    (["--set", "nonsense"], r"not of the form section.key=value"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", BAD)
def test_bad_config_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    code = main(["run", *argv, "--set", f'run.dir="{tmp_path}"'])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad config"


@pytest.mark.timeout(60)
def test_bad_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = [1\n")
    assert main(["run", str(bad)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.toml")]) == 2


@pytest.mark.timeout(60)
def test_exit_code_from_the_installed_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainwright.cli", "run", "--set",
                           "parallel.pp=99", "--set", f'run.dir="{tmp_path}"'],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: parallel.pp = 99")
    assert not any(tmp_path.iterdir())


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainwright.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_resume_equals_uninterrupted(tmp_path):
    sets = tiny_overrides(tmp_path / "runs", **{"train.optimizer": '"adamw"', "train.lr": 0.01,
                                                 "model.name": '"mlp"', "model.n_blocks": 3,
                                                 "train.steps": 2})
    argv = [x for s in sets for x in ("--set", s)]
    first = _cli("run", *argv)
    assert first.returncode == 0, first.stderr
    run_dir = run_dir_from_stdout(first.stdout)
    second = _cli("run", "--resume", str(run_dir), "--set", "train.steps=3")
    assert second.returncode == 0, second.stderr
    cfg = load_config(run_dir / "config.toml")
    assert cfg.train.steps == 3
    ref, ref_losses = train_reference(cfg)  # uninterrupted, 3 steps
    got = load_model(run_dir)
    for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in steps]),
                               torch.tensor(ref_losses))


@pytest.mark.timeout(240)
def test_killed_worker_stops_every_rank_naming_it(tmp_path):
    sets = tiny_overrides(tmp_path / "runs", **{"parallel.pp": 2, "parallel.dp": 2,
                                                 "train.steps": 400, "fault.kill_rank": 2,
                                                 "fault.kill_step": 3})
    proc = subprocess.Popen([sys.executable, "-m", "trainwright.cli", "run",
                             *[x for s in sets for x in ("--set", s)]],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines, killed_at = [], None
    for line in proc.stderr:
        lines.append(line)
        if killed_at is None and "rank 2 was killed by SIGKILL" in line:
            killed_at = time.monotonic()
    proc.wait(timeout=30)
    done_at = time.monotonic()
    text = "".join(lines)
    assert proc.returncode != 0, text
    assert killed_at is not None, text
    assert done_at - killed_at < 60, f"ranks took {done_at - killed_at:.0f} s to stop"
    for rank in (0, 1, 3):  # each survivor says which rank was lost, and exits non-zero
        assert re.search(rf"\[rank {rank} stage \d\] ERROR lost rank 2 \(stage 0, replica 1\)",
                         text), text
        assert f"rank {rank} exited with code 3" in text, text


@pytest.mark.timeout(240)
def test_joins_a_torchrun_job(tmp_path):
    sets = tiny_overrides(tmp_path / "runs")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "trainwright.cli", "run",
                           *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr
    run_dir = run_dir_from_stdout(proc.stdout)
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "trace.json").exists()
    cfg = load_config(run_dir / "config.toml")
    ref, _ = train_reference(cfg)
    for a, b in zip(load_model(run_dir).parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.timeout(60)
def test_torchrun_rank_reads_and_validates_the_config_once(tmp_path, monkeypatch, capsys):
    """Under torchrun the command reads and validates the config file once in each process
    and hands that Config to the rank (which does not load it again)."""
    import trainwright.run.worker as worker
    from trainwright.config import Config

    path = tmp_path / "run.toml"
    path.write_text(load_config(None, tiny_overrides(tmp_path / "runs")).to_toml())
    reads, built, given = [], [], []
    read_text, from_dict = Path.read_text, Config.from_dict.__func__
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        reads.append(self) if self == path else None) or read_text(self, *a, **k))
    monkeypatch.setattr(Config, "from_dict", classmethod(
        lambda cls, data: built.append(data) or from_dict(cls, data)))

    def one_rank(cfg, run_dir, resume=False):
        given.append(cfg)
        return 0, tmp_path / "runs" / "r"

    monkeypatch.setattr(worker, "run_worker", one_rank)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", str(path)]) == 0
    assert len(reads) == 1 and len(built) == 1, (reads, len(built))
    assert len(given) == 1 and isinstance(given[0], Config)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"run directory: {tmp_path / 'runs' / 'r'}"


def _assert_run_outputs(run_dir: Path) -> list[float]:
    for name in ("metrics.jsonl", "trace.json", "report.html", "config.toml"):
        assert (run_dir / name).exists(), name
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert {e["args"]["kind"] for e in trace if e["ph"] == "X"} >= {"F", "B", "STEP"}
    assert "<img src=\"data:image/png;base64," in (run_dir / "report.html").read_text()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[-1]["kind"] == "end"
    assert any(r["kind"] == "layers" for r in rows)
    return [r["loss"] for r in rows if r["kind"] == "step"]


@pytest.mark.timeout(240)
def test_run_writes_outputs_and_the_loss_falls(tmp_path):
    sets = tiny_overrides(tmp_path / "runs", **{"train.steps": 30, "run.report": "true",
                                                 "data.name": '"stdlib"',
                                                 "data.max_bytes": 200000,
                                                 "train.optimizer": '"adamw"', "train.lr": 0.01})
    proc = _cli("run", *[x for s in sets for x in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("run directory: ")
    losses = _assert_run_outputs(run_dir_from_stdout(proc.stdout))
    assert len(losses) == 30 and losses[-1] < 0.8 * losses[0]
    again = _cli("report", str(run_dir_from_stdout(proc.stdout)))
    assert again.returncode == 0 and again.stdout.strip().endswith("report.html")


@pytest.mark.timeout(60)
def test_schedule_command_prints_the_grid(capsys):
    assert main(["schedule", "--pp", "2", "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["step", "s0", "s1"] and out[1].split() == ["0", "F0", "."]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_default_run_under_three_minutes(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run(["trainwright", "run", "--set", f'run.dir="{tmp_path}"'],
                          capture_output=True, text=True, timeout=380)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    losses = _assert_run_outputs(run_dir_from_stdout(proc.stdout))
    assert losses[-1] < losses[0] - 2.0
    assert took < 180, f"default run took {took:.0f} s"


@pytest.mark.timeout(60)
def test_config_table_matches_the_code():
    root = Path(__file__).parents[1]
    made = subprocess.run([sys.executable, str(root / "tools" / "config_table.py")],
                          capture_output=True, text=True, check=True).stdout.strip()
    readme = (root / "docs" / "configuration.md").read_text()
    start = readme.index("| key | default | meaning |")
    lines = []
    for line in readme[start:].split("\n"):
        if not line.startswith("|"):
            break
        lines.append(line)
    assert "\n".join(lines) == made, "docs/configuration.md is stale: run tools/config_table.py"
