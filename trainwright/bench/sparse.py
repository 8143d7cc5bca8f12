"""``trainwright bench sparse``: sparse embedding gradient sync against dense and DDP-sparse.

Every rank of a gloo group holds three copies of the same ``rows x dim`` fp32 embedding:
ours (``nn.Embedding(sparse=True)`` + :class:`~trainwright.sync.sparse.SparseGradSync`),
dense (``nn.Embedding(sparse=False)`` + one in-place ``all_reduce`` of the gradient, the
strongest dense baseline) and torch DDP (``DistributedDataParallel`` around an
``nn.Embedding(sparse=True)``, which uses gloo's sparse all-reduce). At each density every
rank looks up its own ids (uniform with repeats, as many as give that fraction of distinct
rows in expectation) and back-propagates a fixed output gradient. The systems run
interleaved, ``repeats`` rounds after one warm-up round.

``sync_s`` is the slowest rank's time from "local gradient ready" (after a barrier) to
"averaged gradient ready". For DDP the synchronisation runs inside backward, so its
``sync_s`` is the median forward+backward time minus the median of the same under
``no_sync()``. ``fwd_bwd_s`` (local forward+backward) is reported for every system: the
dense system pays for materialising the full gradient there. ``bytes_sent_per_rank`` is
what the collective's algorithm makes an average rank send (ring all-gather / all-reduce,
binomial-tree broadcast; gloo's sparse all-reduce coalesces, all-gathers metadata, then
all-gathers (``allgatherv``) indices and values and sums the W sparse tensors), not a wire
capture. ``paths_taken`` lists our path per round (the first is the warm-up), with the
rounds spent measuring a path (exploration) marked.

By default the ranks talk over 127.0.0.1, where moving a byte costs about as much CPU as
adding it. ``--link RATE`` (``network = "netns"``) puts every rank in its own network
namespace with its egress shaped to RATE (:mod:`trainwright.bench.netns`, needs root),
so the exchange is bound by the link as between real machines.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainwright.bench.netns import NetnsUnavailable, TwoTierNetwork, emulated, run_ranks
from trainwright.dist import collective as coll
from trainwright.dist.testing import run_workers
from trainwright.errors import ConfigError

__all__ = ["SparseBenchSpec", "run", "main"]

SYSTEMS = ("trainwright", "dense_allreduce", "ddp_sparse")


@dataclass(kw_only=True)
class SparseBenchSpec:
    """The benchmark workload."""

    rows: int = 1_000_000
    """Embedding rows."""
    dim: int = 64
    """Embedding width (fp32)."""
    world: int = 4
    """Ranks (gloo, one thread each)."""
    densities: list = field(default_factory=lambda: [0.001, 0.01, 0.1, 0.5])
    """Expected fraction of rows each rank touches."""
    repeats: int = 5
    """Measured rounds per density (after one warm-up round)."""
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


def _bench_rank(rank: int, world: int, spec: SparseBenchSpec, out_path: str,
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
    sync = SparseGradSync(None, world)
    progress = _progress(rank, len(spec.densities) * (spec.repeats + 1), progress_path)
    rows = []
    for density in spec.densities:
        rows += _density_rows(spec, rank, world, density, ours, dense, ddp, sync, progress)
    progress(None)
    if rank == 0:
        Path(out_path).write_text(json.dumps(dict(rows=rows, link=asdict(sync.link))))


def _density_rows(spec: SparseBenchSpec, rank: int, world: int, density: float, ours, dense,
                  ddp, sync, progress) -> list[dict]:
    """Measure the three systems at one density (interleaved rounds); one row per system."""
    ids = _ids(spec, rank, density)
    gout = torch.randn(ids.numel(), spec.dim, generator=torch.Generator().manual_seed(rank))
    times = {k: [] for k in ("ours_fb", "ours_sync", "dense_fb", "dense_sync", "ddp_fb",
                             "ddp_nosync_fb")}
    choice, taken = None, []
    for rep in range(spec.repeats + 1):
        dense.weight.grad = None
        dfb = _timed(lambda: dense(ids).backward(gout))
        dsy = _timed(lambda: (coll.all_reduce(dense.weight.grad), dense.weight.grad.div_(world)))
        if rep:
            dense.weight.grad = None
        fb = _timed(lambda: ours(ids).backward(gout))
        sy = _timed(lambda: sync.sync([ours.weight]))
        choice = sync.last[0]
        taken.append(dict(path=choice.path, explored=choice.explored,
                          cheapest=min(choice.estimates_s, key=choice.estimates_s.get)))
        if not rep:  # warm-up round: all three must agree; nothing is measured
            _check_same(ours.weight.grad, dense.weight.grad)
        ours.weight.grad = None
        with ddp.no_sync():
            nfb = _timed(lambda: ddp(ids).backward(gout))
        ddp.module.weight.grad = None
        pfb = _timed(lambda: ddp(ids).backward(gout))
        if not rep:
            _check_same(ddp.module.weight.grad, dense.weight.grad)
            dense.weight.grad = None
        ddp.module.weight.grad = None
        if rep:
            for k, v in zip(times, (fb, sy, dfb, dsy, pfb, nfb), strict=True):
                times[k].append(v)
        progress(f"density {density:.1%}")
    med = {k: statistics.median(v) for k, v in times.items()}
    unique = torch.tensor([ids.unique().numel()], dtype=torch.int64)
    every = [torch.zeros_like(unique) for _ in range(world)]
    coll.all_gather(every, unique)
    counts = [int(c) for c in every]
    w, row_bytes = world, spec.dim * 4
    return [
        dict(system="trainwright", density=density, sync_s=med["ours_sync"],
             fwd_bwd_s=med["ours_fb"], bytes_sent_per_rank=choice.bytes_sent_per_rank
             + (w - 1) * 16, path=choice.path, estimates_s=choice.estimates_s,
             rows_per_rank=counts, sync_s_all=times["ours_sync"], paths_taken=taken),
        dict(system="dense_allreduce", density=density, sync_s=med["dense_sync"],
             fwd_bwd_s=med["dense_fb"], bytes_sent_per_rank=2 * (w - 1) / w * spec.rows * row_bytes,
             sync_s_all=times["dense_sync"]),
        dict(system="ddp_sparse", density=density,
             sync_s=max(med["ddp_fb"] - med["ddp_nosync_fb"], 0.0),
             fwd_bwd_s=med["ddp_nosync_fb"], fwd_bwd_sync_s=med["ddp_fb"],
             # gloo: metadata all-gather, then ring all-gatherv of indices and of values
             bytes_sent_per_rank=(w - 1) * (sum(counts) / w * (row_bytes + 8) + 9 * 8)),
    ]


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


def _at(rows: list[dict], system: str, density: float) -> float:
    return next(r["sync_s"] for r in rows if r["system"] == system and r["density"] == density)


def worker(tmp: str, rank: int) -> None:
    """One rank of the ``netns`` benchmark (started inside its namespace by :func:`run`)."""
    from trainwright.dist.comm import exit_now

    data = json.loads((Path(tmp) / "spec.json").read_text())
    spec = SparseBenchSpec(**data["spec"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world,
                            timeout=datetime.timedelta(seconds=data["timeout_s"]))
    _bench_rank(rank, spec.world, spec, str(Path(tmp) / "result.json"),
                str(Path(tmp) / "progress"))
    coll.barrier()
    dist.destroy_process_group()
    exit_now(0)


def run(spec: SparseBenchSpec, timeout_s: float = 3000) -> dict:
    """Run every system at every density; returns the rows and the ratios.

    Raises:
        ConfigError: an unknown ``spec.network``, or ``"netns"`` where namespaces cannot
            be built (not root, no iproute2).
    """
    if spec.network not in ("loopback", "netns"):
        raise ConfigError(f"network = {spec.network!r}; choose 'loopback' or 'netns'")
    with tempfile.TemporaryDirectory(prefix="tw-bench-sparse-") as tmp:
        out = Path(tmp) / "result.json"
        if spec.network == "netns":
            (Path(tmp) / "spec.json").write_text(json.dumps(dict(spec=asdict(spec),
                                                                 timeout_s=timeout_s)))
            net = TwoTierNetwork(spec.world, 1, spec.link_rate)
            try:
                with emulated(net):
                    run_ranks("trainwright.bench.sparse", tmp, spec.world, net,
                              timeout_s=timeout_s,
                              total=len(spec.densities) * (spec.repeats + 1),
                              label="bench sparse")
            except NetnsUnavailable as exc:
                raise ConfigError(f"{exc} (or leave out --link to measure on loopback)") from None
        else:
            run_workers(_bench_rank, spec.world, spec, str(out), timeout_s=timeout_s)
        data = json.loads(out.read_text())
    rows = data["rows"]
    result = dict(benchmark="sparse", spec=asdict(spec), link_model=data["link"], rows=rows,
                  torch=torch.__version__,
                  network=(f"{spec.world} network namespaces, {spec.link_rate} egress per rank "
                           f"(tc htb)" if spec.network == "netns"
                           else "loopback 127.0.0.1, no shaping"))
    lo, hi = min(spec.densities, key=lambda d: abs(d - 0.01)), max(spec.densities)
    ours_lo, ours_hi = _at(rows, "trainwright", lo), _at(rows, "trainwright", hi)
    result["ratio_vs_dense_at_1pct"] = ours_lo / _at(rows, "dense_allreduce", lo)
    result["ratio_vs_ddp_sparse_at_1pct"] = ours_lo / max(_at(rows, "ddp_sparse", lo), 1e-9)
    best_hi = min(_at(rows, s, hi) for s in SYSTEMS[1:])
    result["ratio_vs_best_other_at_50pct"] = ours_hi / best_hi
    for r in rows:  # local forward+backward plus sync: what a training step pays
        r["total_s"] = r.get("fwd_bwd_sync_s", r["fwd_bwd_s"] + r["sync_s"])
    total = {(r["system"], r["density"]): r["total_s"] for r in rows}
    for d, name in ((lo, "1pct"), (hi, "50pct")):
        result[f"total_ratio_vs_best_other_at_{name}"] = total["trainwright", d] / min(
            total[s, d] for s in SYSTEMS[1:])
    result["targets_met"] = dict(
        dense_at_1pct=result["ratio_vs_dense_at_1pct"] <= 0.2,
        ddp_sparse_at_1pct=result["ratio_vs_ddp_sparse_at_1pct"] <= 0.7,
        best_at_50pct=result["ratio_vs_best_other_at_50pct"] <= 1.1)
    ours = [r for r in rows if r["system"] == "trainwright"]
    result["paths"] = {str(r["density"]): r["path"] for r in ours}
    # every step not spent measuring a path (exploration) took the model's cheapest
    result["paths_are_model_cheapest"] = all(
        t["explored"] or t["path"] == t["cheapest"] for r in ours for t in r["paths_taken"])
    return result


def main(args) -> dict:
    """CLI entry: ``trainwright bench sparse [--repeats N] [--link RATE]``."""
    repeats = getattr(args, "repeats", None) or SparseBenchSpec().repeats
    link = getattr(args, "link", None)
    return run(SparseBenchSpec(repeats=repeats, network="netns" if link else "loopback",
                               link_rate=link or "1gbit"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: python -m trainwright.bench.sparse --worker TMPDIR RANK "
                 "(started by `trainwright bench sparse --link RATE`)")
