"""Start a job: spawn ``pp x dp`` local ranks, or join the torchrun/SLURM job we are in.

Local ranks get exactly torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) with the rendezvous store hosted here, in the
launcher, so the store outlives any worker and the survivors can name the one that died.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from trainwright.config import Config
from trainwright.errors import ConfigError
from trainwright.observe.telemetry import atomic_write_text

__all__ = ["create_run_dir", "in_torchrun", "launch_local", "LaunchResult"]

log = logging.getLogger(__name__)


def in_torchrun() -> bool:
    """Whether this process is one rank of an externally launched job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def create_run_dir(cfg: Config, resume: Path | None = None) -> Path:
    """Make ``run.dir/run.name`` (or ``<model>-<timestamp>``) and write its config.toml.

    With ``resume`` the existing directory is reused and its config.toml rewritten (the
    overrides given for the resumed run, e.g. more steps, are kept there).

    Raises:
        ConfigError: the directory cannot be created or written (nothing has started).
    """
    try:
        if resume is not None:
            run_dir = Path(resume)
        else:
            name = cfg.run.name or f"{cfg.model.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
            run_dir = Path(cfg.run.dir) / name
            suffix = 1
            while run_dir.is_dir() and any(run_dir.iterdir()):
                suffix += 1
                run_dir = Path(cfg.run.dir) / f"{name}-{suffix}"
            run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.toml", cfg.to_toml())
    except OSError as exc:  # a file in the path, no permission, a full disk
        what = f"--resume {resume}" if resume is not None else f"run.dir {cfg.run.dir!r}"
        fix = ("free space or make it writable" if resume is not None else
               "set run.dir to a folder you can write (--set run.dir=PATH)")
        raise ConfigError(f"{what}: cannot write the run directory ({exc.strerror or exc}: "
                          f"{exc.filename}); {fix}") from None
    return run_dir


@dataclass
class LaunchResult:
    """Exit codes of every local rank, and the first one that failed."""

    run_dir: Path
    returncodes: list[int]
    first_failure: int | None

    @property
    def ok(self) -> bool:
        """True when every rank exited 0."""
        return all(rc == 0 for rc in self.returncodes)

    def describe(self, rank: int) -> str:
        """``"rank 2 was killed by SIGKILL"`` / ``"rank 1 exited with code 3"``."""
        rc = self.returncodes[rank]
        if rc < 0:
            return f"rank {rank} was killed by {signal.Signals(-rc).name}"
        return f"rank {rank} exited with code {rc}"

    def message(self) -> str:
        """The first failure, then every other rank: ``"rank 2 was killed by SIGKILL; rank
        0 exited with code 3, rank 1 exited with code 3"``."""
        others = [r for r in range(len(self.returncodes)) if r != self.first_failure]
        return (f"{self.describe(self.first_failure)}; "
                + ", ".join(self.describe(r) for r in others))


def launch_local(cfg: Config, run_dir: Path, resume: bool = False,
                 extra_env: dict[str, str] | None = None) -> LaunchResult:
    """Spawn ``cfg.world_size`` ranks on this host and wait for them.

    When one rank fails, the others are given time to notice and stop by themselves (they
    name the lost rank); any still running after that are killed.

    Args:
        cfg: validated configuration (already written to ``run_dir/config.toml``).
        run_dir: the run directory.
        resume: continue from the latest checkpoint in ``run_dir``.
        extra_env: added to every rank's environment.

    Returns:
        The ranks' exit codes.
    """
    world = cfg.world_size
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=cfg.runtime.collective_timeout_s))
    procs = []
    for rank in range(world):
        env = {**os.environ, **(extra_env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "trainwright.run.worker", str(run_dir)]
        procs.append(subprocess.Popen(cmd + (["--resume"] if resume else []), env=env))
    grace = 3 * cfg.runtime.peer_timeout_s + 15
    first, deadline = None, None
    try:
        while any(p.poll() is None for p in procs):
            for rank, p in enumerate(procs):
                if first is None and p.poll() not in (None, 0):
                    first, deadline = rank, time.monotonic() + grace
                    what = LaunchResult(run_dir, [q.poll() or 0 for q in procs], first)
                    log.warning("%s; waiting up to %.0f s for the other ranks to stop",
                                what.describe(rank), grace)
            if deadline is not None and time.monotonic() > deadline:
                log.error("ranks still running %.0f s after rank %d failed; killing them",
                          grace, first)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    codes = [p.wait() for p in procs]
    if first is None and any(codes):
        first = next(r for r, c in enumerate(codes) if c)
    del store
    return LaunchResult(run_dir, codes, first)
