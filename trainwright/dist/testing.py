"""Helpers for multi-process tests: free ports and gloo worker groups on 127.0.0.1."""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainwright.dist.comm import exit_now
from trainwright.dist.ports import free_port

__all__ = ["free_port", "run_workers"]


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
    exit_now(0)  # finished and torn down: skip the interpreter shutdown (see exit_now)


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
