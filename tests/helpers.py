"""Helpers shared by several test modules.

A test module imports these (or ``tests.conftest``, ``tests.factories``,
``tests.torch_reference``), never another ``tests/test_*`` module:
``tests/test_helpers_layout.py`` checks it.

* :class:`FakeClock`: the ``clock=`` of a timer under test (``Watchdog``, ``TokenRing``,
  ``Rendezvous``), moved by the test instead of by ``sleep``.
* Pipeline jobs: :func:`train_jobs` (a ``run_workers`` target), :func:`step_rows`,
  :func:`check_against_reference` (the one-process reference of ``run/reference.py``).
* Resume pairs: :func:`resume_pair`, :func:`run_recording_sparse`, :func:`assert_bitwise`.
* Token ring runs: :func:`ring_cfg`, :func:`run_ring`, :func:`assert_identical_replicas`.
* The command line: :func:`run_dir_from_stdout`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from tests.conftest import tiny_overrides
from trainwright.config import Config, load_config
from trainwright.dist.testing import run_workers
from trainwright.run.api import load_model
from trainwright.run.launch import create_run_dir
from trainwright.run.reference import train_reference


class FakeClock:
    """A monotonic clock that moves only when the test says so; pass it as ``clock=``.

    With ``tick``, every reading also moves it on by ``tick`` seconds (for a loop under test
    that polls the clock: its n-th reading is ``start + n * tick``, however slow the host).
    """

    def __init__(self, start: float = 0.0, tick: float = 0.0):
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        now = self.now
        self.now += self.tick
        return now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---------------------------------------------------------------- pipeline jobs
def train_jobs(rank: int, world: int, jobs: list[tuple[Config, str]]) -> None:
    """``run_workers`` target: train each ``(config, run directory)`` in turn."""
    from trainwright.run.worker import train

    for cfg, run_dir in jobs:
        train(cfg, Path(run_dir))


def step_rows(run_dir: Path) -> list[dict]:
    """The ``step`` rows of a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "step"]


def check_against_reference(cfg: Config, run_dir: Path) -> None:
    """The saved parameters and the logged losses equal one-process training of ``cfg``."""
    ref, ref_losses = train_reference(cfg)
    got = load_model(run_dir)
    for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
    losses = [r["loss"] for r in step_rows(run_dir)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))


# ---------------------------------------------------------------- resume pairs
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train_recording_sparse(rank: int, world: int, jobs: list[tuple[Config, str, bool]],
                           out: str) -> None:
    """``run_workers`` target: train each ``(config, run directory, resume)``; record on
    which steps this rank's sparse sync sent row-sparse gradients (``out/sparse_RANK.json``)."""
    from trainwright.run.worker import train

    sparse_log = logging.getLogger("trainwright.sync.sparse")
    sparse_log.setLevel(logging.INFO)
    seen = {}
    for i, (cfg, run_dir, resume) in enumerate(jobs):
        lines = _Lines()
        sparse_log.addHandler(lines)
        train(cfg, Path(run_dir), resume=resume)
        sparse_log.removeHandler(lines)
        seen[i] = [int(m.split()[3].rstrip(":")) for m in lines.lines
                   if m.startswith("sparse sync step")]
    Path(out, f"sparse_{rank}.json").write_text(json.dumps(seen))


def tiny_config(tmp_path: Path, **kw) -> Config:
    """The tiny configuration of ``tests.conftest`` rooted at ``tmp_path / "runs"``."""
    return load_config(None, tiny_overrides(tmp_path / "runs", **kw))


def run_recording_sparse(tmp_path: Path, jobs: list[tuple[Config, Path, bool]],
                         timeout_s: int) -> dict:
    """Run ``jobs`` in one group of four ranks (:func:`train_recording_sparse`); per rank,
    per job: the steps whose sparse sync sent row-sparse gradients."""
    run_workers(train_recording_sparse, 4, [(c, str(d), r) for c, d, r in jobs], str(tmp_path),
                timeout_s=timeout_s)
    return {r: json.loads((tmp_path / f"sparse_{r}.json").read_text()) for r in range(4)}


def resume_pair(tmp_path: Path, stop: int, resume_cfg: dict | None = None, **kw):
    """An uninterrupted run, and one stopped after ``stop`` steps then resumed (optionally
    with other keys): returns the configs, the directories and the jobs."""
    full = tiny_config(tmp_path, **kw)
    first = tiny_config(tmp_path, **{**kw, "train.steps": stop})
    resumed = tiny_config(tmp_path, **{**kw, **(resume_cfg or {})})
    d_full, d_cut = create_run_dir(full), create_run_dir(first)
    create_run_dir(resumed, d_cut)  # what `trainwright run --resume` writes
    jobs = [(full, d_full, False), (first, d_cut, False), (resumed, d_cut, True)]
    return (full, d_full, d_cut), jobs


def assert_bitwise(a: Path, b: Path, label: str) -> None:
    """Runs ``a`` and ``b`` saved the same parameters bit for bit and logged the same
    losses per step."""
    for (name, p), (_, q) in zip(load_model(a).named_parameters(),
                                 load_model(b).named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m, n=name: f"{label} {n}: {m}")
    last = {r["step"]: r["loss"] for r in step_rows(b)}  # a resumed step is logged once more
    full = {r["step"]: r["loss"] for r in step_rows(a)}
    assert last == full, (label, full, last)


# ---------------------------------------------------------------- token ring runs
RING_TIMEOUTS = {"tokenring.token_timeout_s": 1.5, "tokenring.succession_s": 0.5}
"""Short enough that a killed node is dropped in 2 s, long enough that a live node the host
leaves unscheduled for a moment is not (0.5 s dropped live nodes on 2 loaded cores)."""


def ring_cfg(tmp_path, **extra):
    """4 nodes, an MLP on synthetic data, plain SGD, time-outs short enough for tests."""
    base = {
        "sync.strategy": '"tokenring"', "train.optimizer": '"sgd"', "model.name": '"mlp"',
        "model.d_in": 16, "model.d_model": 32, "model.n_blocks": 2, "train.batch_size": 32,
        "train.steps": 5, "train.lr": 0.1, "run.dir": f'"{tmp_path / "runs"}"',
        "tokenring.close_fraction": 1.0, **RING_TIMEOUTS, "tokenring.close_timeout_s": 20.0,
        "tokenring.standby_timeout_s": 30.0, "tokenring.formation_quiet_s": 10.0,
    }
    base.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def run_ring(cfg, timeout_s=100):
    """Launch the ring of ``cfg`` on this machine; its result (the launcher's deadline
    must not have ended it: 100 s, for rings that take 4-15 s on an idle host)."""
    from trainwright.run.ring_launch import launch_ring

    run_dir = create_run_dir(cfg)
    t0 = time.monotonic()
    result = launch_ring(cfg, run_dir, timeout_s=timeout_s)
    assert time.monotonic() - t0 < timeout_s, "the ring ran into the launcher's deadline"
    return result


def assert_identical_replicas(reports: dict, steps: range) -> None:
    """Every node that applied a step has the same parameter hash after it."""
    for s in steps:
        seen = {k: r["hashes"][str(s)] for k, r in reports.items() if str(s) in r["hashes"]}
        assert len(set(seen.values())) == 1, f"replicas differ after step {s}: {seen}"


# ---------------------------------------------------------------- command line
def run_dir_from_stdout(stdout: str) -> Path:
    """The run directory that ``trainwright run`` printed last."""
    return Path(stdout.strip().splitlines()[-1].removeprefix("run directory: "))
