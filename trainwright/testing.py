"""Helpers for multi-process tests: free ports, gloo worker groups, loading a run's weights."""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainwright.api import load_model
from trainwright.config import Config

__all__ = ["free_port", "run_workers", "load_run_model"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, backend: str, errors, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=60))
        fn(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args, backend: str = "gloo",
                timeout_s: float = 120) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by gloo.

    ``fn`` must be importable (module level). A failure in any rank is re-raised here with
    that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, backend, errors, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise TimeoutError(f"{len(alive)} worker(s) still running after {timeout_s} s")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"workers exited with codes {bad}")


def load_run_model(cfg: Config, run_dir: Path, step: int | None = None) -> nn.Sequential:
    """The whole model with the weights of a run's checkpoint (default: the latest)."""
    del cfg  # the run directory holds its own config
    return load_model(run_dir, step)
