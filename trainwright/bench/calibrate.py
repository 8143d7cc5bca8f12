"""Measure this machine's step-time terms (:class:`~trainwright.plan.calibration.Calibration`).

Three timings, each of the real runtime parts, one thread per rank (as ``trainwright run``
with ``parallel.threads_per_rank = 1``):

* **actions and segments**: a :class:`~trainwright.pipeline.stage.Stage` of 1 and of
  ``max_layers`` tiny linear layers runs forward and backward per micro-batch with one
  autograd segment per layer (a measured step); the same layers are timed by the
  profiler the planner uses (:func:`~trainwright.observe.tensor_profile.profile_tensors`);
  what the stage takes beyond the profile, fitted over the layer count
  (:func:`~trainwright.plan.calibration.fit_overhead`), is the per-action and per-segment
  overhead;
* **send and receive**: two gloo ranks; the sender times
  :meth:`~trainwright.dist.comm.P2P.send` (header and payload posted), the receiver times
  :meth:`~trainwright.dist.comm.P2P.recv` of a message posted beforehand, minus a plain
  ``recv`` of one such message (what the simulator's link model already charges);
* **transport threads**: the same two ranks pass messages one at a time (the sender
  computes about 2 ms between them, as a pipeline stage does), at 1 KiB and 256 KiB; the
  CPU time of each process's threads other than its main one (gloo's transport threads,
  from ``/proc/self/task/*/schedstat``) per message, over the two sizes, gives
  ``transport_s + transport_s_per_byte * bytes`` per message end;
* **delivery**: for ``w = 2 .. max_ranks``, ``w`` processes pass messages down a chain as
  a pipeline's forward does (receive, compute a few ms, send on, :data:`CHAIN_MESSAGES` per
  round, at least :data:`CHAIN_SAMPLES` messages); each receiver records how long after
  the send (or its own receive's start, if later) the receive returned; the mean beyond a
  plain idle receive and ``recv_s`` is ``delivery_s[w]``
  (:func:`~trainwright.plan.calibration.fit_delivery`);
* **shared cores**: ``max_ranks`` processes; for ``k = 1 .. max_ranks``, ``k`` of them time
  the same single-thread matrix products at once (the others wait at a barrier, not
  spinning); ``slowdown[k]`` = their median time over one rank's alone.

The result is cached per machine (:func:`~trainwright.plan.calibration.load` checks the
host) in ``~/.cache/trainwright/calibration.json`` unless a path is given.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainwright.dist import collective as coll
from trainwright.plan.calibration import (
    Calibration,
    default_path,
    fit_delivery,
    fit_overhead,
    fit_slowdown,
    fit_transport,
    load,
    save,
)

__all__ = ["calibrate", "measure"]

log = logging.getLogger(__name__)

_WIDTH = 64
_SIZES = (256, 65536)
"""Payload elements (fp32) timed through P2P: a small and a 256 KiB message."""


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _tiny(n: int) -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    return [(f"l{i}", nn.Linear(_WIDTH, _WIDTH)) for i in range(n)]


def _stage_action_times(n_layers: int, repeats: int) -> tuple[list[float], float]:
    """Seconds per ``F``/``B`` action (mean of the two, per micro-batch) of a stage of
    ``n_layers`` tiny layers, one segment each; and the profile's summed layer time for the
    same (also the mean of forward and backward)."""
    from trainwright.observe.layer_profile import LayerProfiler
    from trainwright.observe.tensor_profile import profile_tensors
    from trainwright.pipeline.stage import LayerSlot, Stage, StepMode
    from trainwright.pipeline.store import ActivationStore

    layers = _tiny(n_layers)
    x, y = torch.randn(8, _WIDTH), torch.randn(8, _WIDTH)
    stage = Stage([LayerSlot(i, name, m) for i, (name, m) in enumerate(layers)],
                  ActivationStore(), LayerProfiler(), is_first=True, loss_fn=_loss)
    stage.options.mode = StepMode(fast=False)
    times = []
    for mb in range(repeats + 3):
        t0 = time.perf_counter()
        stage.forward(mb, (x,), y)
        t1 = time.perf_counter()
        stage.backward(mb)
        t2 = time.perf_counter()
        stage.profiler.end_step()
        if mb >= 3:  # warm-up: allocator, autograd's first graphs
            times.append(((t1 - t0) + (t2 - t1)) / 2)
    profiled = []
    for _ in range(max(repeats // 4, 3)):
        rows = profile_tensors(layers, x, y, _loss)
        profiled.append(sum(r.forward_s + r.backward_s for r in rows) / 2)
    return times, statistics.median(profiled)


TRANSPORT_GAP_MM = 200
"""64 x 64 matrix products the sender computes between two messages of the transport
timing (about 1-2 ms)."""


def _p2p_times(rank: int, repeats: int, group) -> dict:
    """Ranks 0 (sender) and 1 (receiver) of ``group``: see the module docstring."""
    from trainwright.dist.comm import P2P

    p2p = P2P(group, rank, 60.0, torch.device("cpu"))
    out: dict = {"send": [], "recv": {n: [] for n in _SIZES}, "raw": {n: [] for n in _SIZES},
                 "transport": {}}
    # the link model's unit first: one plain message, posted before the receive starts
    for i in range(repeats + 2):
        for n in _SIZES:
            t = torch.randn(n)
            if rank == 0:
                w = coll.isend(t, dst=1, group=group, tag=7)
            coll.barrier(group)
            if rank == 1:
                t0 = time.perf_counter()
                coll.recv(t, src=0, group=group, tag=7)
                if i >= 2:
                    out["raw"][n].append(time.perf_counter() - t0)
            else:
                w.wait()
            coll.barrier(group)
    # the transport threads' CPU per message at each end, by size: messages one by one,
    # the sender computing between them as a pipeline stage does (a stream of messages
    # costs less per message: one wake-up of the transport thread moves several); no
    # barrier between them (a barrier's own messages would count)
    a = torch.randn(64, 64)
    for n in _SIZES:
        t = torch.randn(n)
        coll.barrier(group)
        cpu0 = _transport_cpu_s()
        for i in range(4 * repeats):
            if rank == 0:
                for _ in range(TRANSPORT_GAP_MM):
                    torch.mm(a, a)
                p2p.send(1, "act", i, [t])
            else:
                p2p.recv(0, "act", i)
        p2p.wait_sends()
        out["transport"][n] = (_transport_cpu_s() - cpu0) / (4 * repeats)
        coll.barrier(group)
    # the protocol: header + payload; the receive starts after the send is posted
    for i in range(repeats + 2):
        for n in _SIZES:
            t = torch.randn(n)
            if rank == 0:
                t0 = time.perf_counter()
                p2p.send(1, "act", i, [t])
                if i >= 2:
                    out["send"].append(time.perf_counter() - t0)
            coll.barrier(group)
            if rank == 1:
                t0 = time.perf_counter()
                p2p.recv(0, "act", i)
                if i >= 2:
                    out["recv"][n].append(time.perf_counter() - t0)
            else:
                p2p.wait_sends()
            coll.barrier(group)
    return out


SPIN_BATCH_S = 0.1
"""Seconds of work one rank does alone per timed batch of the shared-core timing: long
against the scheduler's time slices (a few ms), so a batch that shares its core is slowed
by its share, not timed between preemptions."""


def _units(seconds: float) -> Callable[[], None]:
    """Work of about ``seconds`` alone (fixed work: it stretches when the core is shared),
    sized on rank 0 and broadcast, so that every rank does the same."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    for _ in range(20):
        torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b)
    n = torch.tensor([max(1, round(seconds / ((time.perf_counter() - t0) / 50)))])
    coll.broadcast(n, src=0)
    count = int(n)

    def work() -> None:
        for _ in range(count):
            torch.mm(a, b)
    return work


def _spin_times(rank: int, world: int, repeats: int, rounds: int = 3) -> dict[int, list[float]]:
    """Per ``k``: this rank's seconds per batch of work (about :data:`SPIN_BATCH_S` alone)
    while ``k`` ranks work at once. The counts are swept ``rounds`` times, ascending then
    descending (a drift of the machine's load hits every count alike).

    Timing short units alone would miss the sharing: a unit much shorter than a time slice
    mostly runs unpreempted, and the median of such units says ``k`` ranks on fewer cores
    run at full speed (measured here: 0.96 for 4 ranks on 2 cores)."""
    batch = _units(SPIN_BATCH_S)
    out: dict[int, list[float]] = {}
    for r in range(rounds):
        counts = range(1, world + 1) if r % 2 == 0 else range(world, 0, -1)
        for k in counts:
            for _ in range(max(1, repeats // 10)):
                coll.barrier()
                if rank < k:
                    t0 = time.perf_counter()
                    batch()
                    out.setdefault(k, []).append(time.perf_counter() - t0)
                coll.barrier()
    return out


CHAIN_MESSAGES = 8
"""Messages per round down the delivery chain (a pipeline's micro-batches)."""
CHAIN_SAMPLES = 320
"""Delays measured per chain length at least (rounds are added until there are as many):
their mean is a heavy tail's (a scheduler tick in a few of them); with 80, five
calibrations of a 2-rank chain read 1.2-2.3 ms."""
CHAIN_WORK_S = 0.005
"""Seconds of work (alone) a chain rank does per message: a pipeline action of a model
worth pipelining, longer than a scheduler tick, so the sender is still computing when its
transport thread needs the core."""


def _chain_delays(rank: int, world: int) -> dict[int, list[float]]:
    """Per chain length ``w``: this rank's delays of the messages it received (module
    docstring), :data:`CHAIN_SAMPLES` or more over the chain's ``w - 1`` receivers. The
    payload carries the send time (float64; ``perf_counter`` is one monotonic clock for
    every process of the host)."""
    from trainwright.dist.comm import P2P

    p2p = P2P(None, rank, 60.0, torch.device("cpu"))
    work = _units(CHAIN_WORK_S)
    out: dict[int, list[float]] = {}
    for w in range(2, world + 1):
        for _ in range(math.ceil(CHAIN_SAMPLES / (CHAIN_MESSAGES * (w - 1)))):
            coll.barrier()
            if rank < w:
                for i in range(CHAIN_MESSAGES):
                    if rank > 0:
                        start = time.perf_counter()
                        (msg,) = p2p.recv(rank - 1, "act", i)
                        out.setdefault(w, []).append(
                            time.perf_counter() - max(float(msg[0]), start))
                    work()
                    if rank < w - 1:
                        msg = torch.zeros(_SIZES[-1] // 2, dtype=torch.float64)
                        msg[0] = time.perf_counter()
                        p2p.send(rank + 1, "act", i, [msg])
                p2p.wait_sends()
            coll.barrier()
    return out


def _transport_cpu_s() -> float:
    """CPU seconds so far of this process's threads other than the main one (the
    backend's transport threads), from Linux's ``/proc/self/task/*/schedstat`` (run time
    in nanoseconds); 0 where there is none."""
    main, total = threading.main_thread().native_id, 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tids:
        if int(tid) == main:
            continue
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return total * 1e-9


def _worker(rank: int, world: int, repeats: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    got: dict = {"spin": _spin_times(rank, world, repeats),
                 "chain": _chain_delays(rank, world)}
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    if rank < 2:
        got["p2p"] = _p2p_times(rank, repeats, pair)
    coll.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))


def measure(max_ranks: int = 4, repeats: int = 20, max_layers: int = 6) -> Calibration:
    """Take every timing of the module docstring and fit them (about 10-20 s)."""
    from trainwright.bench.paired import host_info
    from trainwright.dist.testing import run_workers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        acts = {n: _stage_action_times(n, repeats) for n in (1, max_layers)}
    finally:
        torch.set_num_threads(threads)
    action_s, segment_s = fit_overhead({n: t for n, (t, _) in acts.items()},
                                       {n: p for n, (_, p) in acts.items()})
    world = max(2, max_ranks)
    with tempfile.TemporaryDirectory(prefix="tw-calibrate-") as d:
        run_workers(_worker, world, repeats, d, timeout_s=600)
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    spin: dict[int, list[float]] = {}
    for r in ranks:
        for k, v in r["spin"].items():
            spin.setdefault(int(k), []).extend(v)
    chain: dict[int, list[float]] = {}
    for r in ranks:
        for w, v in r["chain"].items():
            chain.setdefault(int(w), []).extend(v)
    send = statistics.median(ranks[0]["p2p"]["send"])
    recv = max(statistics.median(
        statistics.median(ranks[1]["p2p"]["recv"][str(n)])
        - statistics.median(ranks[1]["p2p"]["raw"][str(n)]) for n in _SIZES), 0.0)
    plain = statistics.median(ranks[1]["p2p"]["raw"][str(_SIZES[-1])])  # the chain's bytes
    # per message end: the two ends' mean, by the message's bytes (fp32 payloads)
    transport, per_byte = fit_transport(
        {4 * n: statistics.fmean(r["p2p"]["transport"][str(n)] for r in ranks[:2])
         for n in _SIZES})
    cal = Calibration(host_info(), os.cpu_count() or 1, action_s=action_s,
                      segment_s=segment_s, send_s=send, recv_s=recv,
                      slowdown=fit_slowdown(spin), delivery_s=fit_delivery(chain, plain, recv),
                      transport_s=transport, transport_s_per_byte=per_byte)
    log.info("calibration: %s", cal.to_dict())
    return cal


def calibrate(path: Path | None = None, refresh: bool = False, max_ranks: int = 4,
              repeats: int = 20, say: Callable[[str], None] | None = None) -> Calibration:
    """This machine's calibration: the cached one if it was measured here (and covers
    ``max_ranks``), else measured now and cached at ``path`` (default
    :func:`~trainwright.plan.calibration.default_path`).

    ``say`` is told one line before a measurement starts (a CLI's progress line)."""
    from trainwright.bench.paired import host_info

    path = Path(path) if path else default_path()
    cal = None if refresh else load(path, host_info())
    if cal is not None and max(cal.slowdown) >= max_ranks:
        return cal
    (say or log.info)(f"measuring this host's per-action overheads and shared-core slowdown "
                      f"(about 10-20 s, cached in {path})")
    cal = measure(max_ranks=max_ranks, repeats=repeats)
    save(path, cal)
    return cal
