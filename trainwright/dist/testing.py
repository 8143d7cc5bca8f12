"""Helpers for multi-process tests: free ports and gloo worker groups on 127.0.0.1."""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainwright.dist.comm import exit_now
from trainwright.dist.ports import free_port

__all__ = ["free_port", "run_workers"]


def _entry(rank: int, fn: Callable, world: int, port: int, backend: str, errors, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_workers dumps stacks on hang
    try:
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
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
    # the store is hosted here on a port the OS picks while binding it: a port found free
    # first and bound by rank 0 seconds later (after importing torch) could be taken by then
    server = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = server.port
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, backend, errors, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    alive = _join_all(procs, errors, timeout_s)
    if alive:
        for p in alive:  # print every thread's stack of each hung worker before killing it
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
    for p in alive:
        p.kill()
        p.join(5)
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        ranks = [procs.index(p) for p in alive]
        raise TimeoutError(f"worker rank(s) {ranks} still running after {timeout_s} s "
                           f"(their stacks are in the captured stderr)")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"workers exited with codes {bad}")


def _join_all(procs: list, errors, timeout_s: float, grace_s: float = 15.0) -> list:
    """Wait for every worker under one deadline; once one fails, the others get ``grace_s``
    to fail or finish too (a rank left waiting on a dead peer would otherwise hold the whole
    timeout). Returns the workers still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if p.is_alive()]
        failed = not errors.empty() or any(p.exitcode not in (None, 0) for p in procs)
        if not alive:
            return []
        if failed:
            deadline = min(deadline, time.monotonic() + grace_s)
        left = deadline - time.monotonic()
        if left <= 0:
            return alive
        wait_for([p.sentinel for p in alive], timeout=min(left, 1.0))
