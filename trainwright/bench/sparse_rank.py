"""What each rank of ``trainwright bench sparse`` runs: the workload, the systems, their
steps, and one density's rows (:mod:`trainwright.bench.sparse` orchestrates the ranks and
judges the rows).

Every system's gradient is checked against the dense all-reduce's in a warm-up step; then
the systems take one step each in turn, ABBA from turn to turn, and each step's phases are
timed as the slowest rank's (after a barrier).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainwright.dist import collective as coll

__all__ = ["FORCED", "SYSTEMS", "SparseBenchSpec", "PILOT_STEPS", "bench_rank", "step_s",
           "steps_for"]

FORCED = ("allgather", "broadcast", "dense")
"""Our sync with ``sync.sparse_path`` forced to each path."""
SYSTEMS = ("trainwright", *(f"forced_{p}" for p in FORCED), "dense_allreduce", "ddp_sparse")
"""``trainwright`` is ours with ``sparse_path = "auto"`` (the cost model chooses)."""


@dataclass(kw_only=True)
class SparseBenchSpec:
    """The benchmark workload."""

    rows: int = 250_000
    """Embedding rows (1M until the paired rounds: 6 systems x 4 densities x 5 rounds x 15
    steps over a 1M-row table take over half an hour on a shared 2-core machine)."""
    dim: int = 64
    """Embedding width (fp32)."""
    world: int = 4
    """Ranks (gloo, one thread each)."""
    densities: list = field(default_factory=lambda: [0.001, 0.01, 0.1, 0.5])
    """Expected fraction of rows each rank touches."""
    repeats: int = 5
    """Measured rounds per density (after one warm-up step of every system), each system's
    steps in ABBA order within a round."""
    steps: int = 15
    """Fewest timed steps per system per round; a round's figure is their median."""
    round_s: float = 12.0
    """Seconds a round should take: where the systems' steps are short, each runs
    ``round_s`` over the sum of their steps (from a 3-step pilot after the warm-up), at
    most ``max_steps``."""
    max_steps: int = 400
    """Most timed steps per system per round."""
    seed: int = 0
    """Seed of the table and the ids."""
    network: str = "loopback"
    """``"loopback"`` (127.0.0.1, no shaping) or ``"netns"``: every rank in its own network
    namespace, its egress shaped to ``link_rate`` (:mod:`trainwright.bench.netns`)."""
    link_rate: str = "1gbit"
    """With ``network = "netns"``: each rank's egress rate (``tc`` syntax)."""


def _ids(spec: SparseBenchSpec, rank: int, density: float) -> torch.Tensor:
    # n uniform draws leave a fraction 1 - exp(-n/rows) of rows touched
    n = max(1, round(-spec.rows * math.log1p(-density)))
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank * 104729 + int(density * 1e6))
    return torch.randint(0, spec.rows, (n,), generator=g)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    coll.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    coll.barrier()
    t0 = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t0)


def _check_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """A sparse gradient equals a dense one, without materialising full-size temporaries."""
    got = got.coalesce()
    rows, vals = got.indices()[0], got.values()
    scale = 1.0 + float(vals.abs().max()) if vals.numel() else 1.0
    diff = float((vals - want.index_select(0, rows)).abs().max()) if vals.numel() else 0.0
    outside = want.abs().sum(dim=1)
    outside[rows] = 0
    if diff > 1e-5 * scale or float(outside.max()) > 0:
        raise AssertionError(f"synchronised gradients differ from the dense all-reduce: "
                             f"max diff {diff:.3g} on shared rows, {float(outside.max()):.3g} "
                             f"outside")


def bench_rank(rank: int, world: int, spec: SparseBenchSpec, out_path: str,
                progress_path: str | None = None) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from trainwright.sync.sparse import SparseGradSync

    torch.manual_seed(spec.seed)
    # one table storage behind three Parameters (nothing updates it): 4 ranks x 256 MB, not x 3
    table = torch.randn(spec.rows, spec.dim) * 0.02
    ours = nn.Embedding.from_pretrained(table, freeze=False, sparse=True)
    dense = nn.Embedding.from_pretrained(table, freeze=False, sparse=False)
    ddp = DistributedDataParallel(nn.Embedding.from_pretrained(table, freeze=False, sparse=True))
    del table
    syncs = {name: SparseGradSync(None, world, path="auto" if name == "trainwright" else name)
             for name in ("trainwright", *FORCED)}
    progress = _progress(rank, len(spec.densities) * (spec.repeats + 1), progress_path)
    rows = []
    for density in spec.densities:
        rows += _density_rows(spec, rank, world, density, (ours, dense, ddp, syncs), progress)
    progress(None)
    if rank == 0:
        Path(out_path).write_text(json.dumps(dict(rows=rows,
                                                  link=asdict(syncs["trainwright"].link))))


def _system_steps(name: str, steps: int, ids, gout, world: int, mods) -> dict:
    """``steps`` steps of one system; per step the slowest rank's seconds of each phase."""
    ours, dense, ddp, syncs = mods
    out = {"fb": [], "sync": [], "nosync_fb": [], "taken": []}
    for _ in range(steps):
        if name == "dense_allreduce":
            dense.weight.grad = None
            out["fb"].append(_timed(lambda: dense(ids).backward(gout)))
            out["sync"].append(_timed(lambda: (coll.all_reduce(dense.weight.grad),
                                               dense.weight.grad.div_(world))))
        elif name == "ddp_sparse":  # its sync runs inside backward: with minus without
            ddp.module.weight.grad = None
            with ddp.no_sync():
                out["nosync_fb"].append(_timed(lambda: ddp(ids).backward(gout)))
            ddp.module.weight.grad = None
            out["fb"].append(_timed(lambda: ddp(ids).backward(gout)))
        else:
            ours.weight.grad = None
            sync = syncs[name.removeprefix("forced_")]
            held = sync._sticky.get(id(ours.weight))
            out["fb"].append(_timed(lambda: ours(ids).backward(gout)))
            out["sync"].append(_timed(lambda s=sync: s.sync([ours.weight])))
            choice = sync.last[0]
            out["taken"].append(dict(path=choice.path, explored=choice.explored,
                                     held=held[0] if held else None,
                                     estimates_s=choice.estimates_s, noise=choice.noise,
                                     credit_s=choice.credit_s))
            out["choice"] = choice
    return out


PILOT_STEPS = 3
"""Steps of each system after the warm-up that size its rounds (see ``round_s``)."""


def step_s(pilot: dict) -> float:
    """A system's median step in its pilot: forward + backward + sync (DDP runs two
    backwards a step: with and without its sync)."""
    return sum(statistics.median(pilot[k]) for k in ("fb", "sync", "nosync_fb") if pilot[k])


def steps_for(spec: SparseBenchSpec, slot_s: float) -> int:
    """Steps per system per round: ``round_s`` over one step of every system (``slot_s``),
    within ``[steps, max_steps]``. The pilot's times are the slowest rank's, so every rank
    gets the same."""
    return max(spec.steps, min(spec.max_steps, math.ceil(spec.round_s / max(slot_s, 1e-6))))


def _round_figure(name: str, got: dict) -> float:
    """One round's sync seconds of a system: the median over its steps."""
    if name == "ddp_sparse":
        return max(statistics.median(got["fb"]) - statistics.median(got["nosync_fb"]), 0.0)
    return statistics.median(got["sync"])


def _warm_and_check(ids, gout, world: int, mods) -> None:
    """One step of every system; all must produce the dense all-reduce's gradient."""
    ours, dense, ddp, syncs = mods
    dense.weight.grad = None
    dense(ids).backward(gout)
    coll.all_reduce(dense.weight.grad)
    dense.weight.grad.div_(world)
    for sync in syncs.values():
        ours.weight.grad = None
        ours(ids).backward(gout)
        sync.sync([ours.weight])
        _check_same(ours.weight.grad, dense.weight.grad)
    ddp.module.weight.grad = None
    ddp(ids).backward(gout)
    _check_same(ddp.module.weight.grad, dense.weight.grad)
    ours.weight.grad = dense.weight.grad = ddp.module.weight.grad = None


def _density_rows(spec: SparseBenchSpec, rank: int, world: int, density: float, mods,
                  progress) -> list[dict]:
    """Every system at one density: rounds of ``steps`` steps per system, the systems
    taking one step each in turn, in ABBA order from one turn to the next.

    Interleaved step by step, every system sees the same drift of the machine within a
    round; in blocks of 15 steps per system (before), each saw its own few seconds, and the
    same path forced and chosen by ``auto`` differed by 10-20 % from round to round. Each
    step thus also starts with caches that other work has used, as a step of training
    does after its forward, backward and update."""
    from trainwright.bench.paired import round_order

    ids = _ids(spec, rank, density)
    gout = torch.randn(ids.numel(), spec.dim, generator=torch.Generator().manual_seed(rank))
    _warm_and_check(ids, gout, world, mods)
    steps = steps_for(spec, sum(
        step_s(_system_steps(name, PILOT_STEPS, ids, gout, world, mods)) for name in SYSTEMS))
    progress(f"density {density:.1%} (warm-up)")
    per_round = {k: [] for k in SYSTEMS}
    fb = {k: [] for k in SYSTEMS}  # forward + backward (DDP: without its sync)
    taken, choice = [], None
    for rnd in range(spec.repeats):
        got = {name: {"fb": [], "sync": [], "nosync_fb": [], "taken": []} for name in SYSTEMS}
        for turn in range(steps):
            for name in round_order(SYSTEMS, rnd * steps + turn):
                one = _system_steps(name, 1, ids, gout, world, mods)
                for key, values in got[name].items():
                    values += one[key]
                if name == "trainwright":
                    choice = one["choice"]
        for name in SYSTEMS:
            per_round[name].append(_round_figure(name, got[name]))
            fb[name].append(statistics.median(got[name]["nosync_fb"] or got[name]["fb"]))
        taken += got["trainwright"]["taken"]
        progress(f"density {density:.1%}")
    unique = torch.tensor([ids.unique().numel()], dtype=torch.int64)
    every = [torch.zeros_like(unique) for _ in range(world)]
    coll.all_gather(every, unique)
    counts = [int(c) for c in every]
    w, row_bytes = world, spec.dim * 4
    sent = {
        "dense_allreduce": 2 * (w - 1) / w * spec.rows * row_bytes,
        # gloo: metadata all-gather, then ring all-gatherv of indices and of values
        "ddp_sparse": (w - 1) * (sum(counts) / w * (row_bytes + 8) + 9 * 8),
    }
    rows = []
    for name in SYSTEMS:
        row = dict(system=name, density=density, sync_s=statistics.median(per_round[name]),
                   sync_s_rounds=per_round[name], fwd_bwd_s=statistics.median(fb[name]),
                   fwd_bwd_s_rounds=fb[name], steps_per_round=steps)
        if name in sent:
            row["bytes_sent_per_rank"] = sent[name]
        rows.append(row)
    ours_row = rows[0]
    ours_row.update(path=choice.path, estimates_s=choice.estimates_s, rows_per_rank=counts,
                    bytes_sent_per_rank=choice.bytes_sent_per_rank + (w - 1) * 16,
                    paths_taken=taken,
                    path_counts={p: sum(t["path"] == p for t in taken) for p in FORCED})
    return rows


def _progress(rank: int, total: int, path: str | None = None):
    """A rich bar on rank 0 (other ranks: no-op); call with a label per round, None to end.

    With ``path``, rank 0 writes ``"done total"`` there instead (for :func:`run_ranks`)."""
    if rank != 0:
        return lambda label: None
    if path is not None:
        done = [0]

        def note(label):
            if label is not None:
                done[0] += 1
                Path(path).write_text(f"{done[0]} {total}")
        return note
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(TextColumn("[bold]bench sparse"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.description}"), transient=True)
    task = bar.add_task("", total=total)
    bar.start()

    def step(label):
        if label is None:
            bar.stop()
        else:
            bar.update(task, advance=1, description=label)

    return step
