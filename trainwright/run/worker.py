"""One rank of a training job: join the process group, build the stage, run the steps.

Runs the same way under ``trainwright run`` (which spawns local ranks with torchrun's
environment variables) and under ``torchrun`` / SLURM directly.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.config import Config, load_config
from trainwright.dist.comm import Watchdog, exit_now
from trainwright.errors import ConfigError, PeerLost
from trainwright.observe.telemetry import setup_logging
from trainwright.run.manifest import resume_step
from trainwright.run.trainer import Trainer, TrainerOptions

__all__ = ["DistEnv", "run_worker", "train", "resume_hint", "EXIT_PEER_LOST", "EXIT_FAILED"]

log = logging.getLogger(__name__)
EXIT_FAILED = 1
EXIT_PEER_LOST = 3


@dataclass
class DistEnv:
    """The torchrun-style environment of this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool
    """True when the launcher (torchrun's agent or ``trainwright run``) hosts the store."""

    @classmethod
    def from_env(cls) -> DistEnv:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT... from os.environ."""
        e = os.environ
        return cls(rank=int(e["RANK"]), world_size=int(e["WORLD_SIZE"]),
                   local_rank=int(e.get("LOCAL_RANK", 0)),
                   local_world_size=int(e.get("LOCAL_WORLD_SIZE", e["WORLD_SIZE"])),
                   master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(e.get("MASTER_PORT", 29500)),
                   agent_store=e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")

    def store(self, timeout_s: float, master: bool = False) -> dist.TCPStore:
        """A client (or, with ``master``, the server) of the rendezvous store."""
        return dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                             is_master=master, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)


def resolve_device(cfg: Config) -> tuple[str, str]:
    """The process group's backend and the device kind (``"cpu"`` / ``"cuda"``) that
    ``parallel.backend`` and ``parallel.device`` ask for on this host.

    Raises:
        ConfigError: CUDA asked for where none is visible, or NCCL without CUDA devices.
    """
    backend, kind = cfg.parallel.backend, cfg.parallel.device
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if kind == "auto":
        kind = "cuda" if backend == "nccl" else "cpu"
    if kind == "cpu" and backend == "nccl":
        raise ConfigError('parallel.backend = "nccl" needs parallel.device = "cuda" (or '
                          '"auto"); use backend "gloo" to train on the CPU')
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError('parallel.device = "cuda" (or backend "nccl") but no CUDA device '
                          'is visible; set parallel.device = "cpu" and backend "gloo"')
    return backend, kind


def _device(cfg: Config, env: DistEnv) -> tuple[str, torch.device]:
    backend, kind = resolve_device(cfg)
    if kind == "cuda":  # the CUDA branch: local ranks round-robin over the visible devices
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return backend, torch.device("cuda", index)
    return backend, torch.device("cpu")


def _agree_run_dir(store, env: DistEnv, run_dir: Path | None, cfg: Config) -> Path:
    """Under torchrun every rank parsed the config; rank 0 creates the run dir for all.

    Raises:
        ConfigError: rank 0 could not create it; every rank raises rank 0's message (each
            exits 2 in that one line, none waits for a directory that never comes).
    """
    if run_dir is not None:
        return run_dir
    if env.rank == 0:
        from trainwright.run.launch import create_run_dir
        try:
            run_dir = create_run_dir(cfg)
        except ConfigError as exc:
            store.set("tw/run_dir_error", str(exc))
            store.set("tw/run_dir", "")
            raise
        store.set("tw/run_dir", str(run_dir.resolve()))
    got = store.get("tw/run_dir").decode()
    if not got:
        raise ConfigError(store.get("tw/run_dir_error").decode())
    return Path(got)


def run_worker(cfg: Config, run_dir: Path | None,
               resume: bool = False) -> tuple[int, Path]:
    """Train as one rank of the job described by the environment.

    Args:
        cfg: the configuration, read once by whoever started this process.
        run_dir: the run directory (None under torchrun: rank 0 creates one).
        resume: continue from the run directory's latest checkpoint.

    Returns:
        The process exit code (0 on success) and the run directory.
    """
    env = DistEnv.from_env()
    rt = cfg.runtime
    order = cfg.parallel.mapping or list(range(cfg.parallel.pp))
    setup_logging(f"[rank {env.rank} stage {order.index(env.rank % cfg.parallel.pp)}]",
                  logging.INFO if env.rank == 0 else logging.WARNING)
    threads = cfg.parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    backend, device = _device(cfg, env)
    hosts_store = env.rank == 0 and not env.agent_store
    store = env.store(rt.collective_timeout_s, master=hosts_store)
    run_dir = _agree_run_dir(store, env, run_dir, cfg)
    store_host = -1 if env.agent_store else 0

    once = threading.Lock()

    def lost(rank: int, reason: str) -> None:
        once.acquire()  # the watchdog thread and the main thread may both get here; log once
        who = "the launcher (store host)" if rank < 0 else \
            f"rank {rank} (stage {order.index(rank % cfg.parallel.pp)}, " \
            f"replica {rank // cfg.parallel.pp})"
        log.error("lost %s: %s. Stopping this rank. %s", who, reason, resume_hint(run_dir))
        exit_now(EXIT_PEER_LOST)

    watchdog = Watchdog(lambda: env.store(rt.peer_timeout_s), env.rank, env.world_size,
                        rt.peer_timeout_s, lost, store_host=store_host).start()
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("tw/pg", store), rank=env.rank,
                                world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=rt.collective_timeout_s))
        train(cfg, run_dir, device=device, resume=resume, watchdog=watchdog,
              fault_rank=env.rank)
    except PeerLost as exc:
        lost(exc.rank, str(exc))
    except Exception as exc:
        if _is_comm_failure(exc):  # a collective broke: most likely a peer died; ask who
            verdict = watchdog.verdict(2 * rt.peer_timeout_s)
            if verdict is not None:
                lost(*verdict)
        log.exception("failed: %s", exc)
        watchdog.stop(failed=f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED, run_dir
    watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0, run_dir


def resume_hint(run_dir: Path) -> str:
    """How to continue ``run_dir``: from its last checkpoint, or why that is not possible."""
    step = resume_step(run_dir)  # the newest complete one (an unfinished save is not)
    if step is None:
        return "No checkpoint was written yet (see run.checkpoint_every); start again."
    return f"Continue from step {step} with `trainwright run --resume {run_dir}`."


def _is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed transport (gloo, NCCL, the store)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo", "Connection closed", "Connection reset", "NCCL"))


def train(cfg: Config, run_dir: Path, *, device: torch.device | None = None,
          resume: bool = False, watchdog: Watchdog | None = None,
          fault_rank: int | None = None) -> float | None:
    """Run one training job on the already initialised default process group.

    Every rank of the group calls this with the same arguments; it may be called several
    times in one process group (tests do), each call building its own mesh groups and
    destroying them when training ends. A thin wrapper of
    :class:`~trainwright.run.trainer.Trainer`.

    Returns:
        The last step's mean loss on rank 0, None on other ranks.
    """
    trainer = Trainer(cfg, run_dir, device=device, resume=resume,
                      options=TrainerOptions(watchdog=watchdog, fault_rank=fault_rank))
    loss = trainer.fit()
    trainer.close()
    return loss


def main(argv: list[str] | None = None) -> int:
    """``python -m trainwright.run.worker RUN_DIR [--resume]``: one locally spawned rank
    (the launcher wrote ``RUN_DIR/config.toml``; this process reads it, once)."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    return run_worker(load_config(run_dir / "config.toml"), run_dir, resume="--resume" in args)[0]


if __name__ == "__main__":
    exit_now(main())  # the rank is torn down; skip the interpreter shutdown (see exit_now)
