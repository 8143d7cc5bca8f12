"""``trainwright bench sparse``: sparse embedding gradient sync against dense and DDP-sparse.

Every rank of a gloo group holds the same ``rows x dim`` fp32 embedding, as
``nn.Embedding(sparse=True)`` (ours, and torch DDP around it, which uses gloo's sparse
all-reduce) and ``nn.Embedding(sparse=False)`` (dense: one in-place ``all_reduce`` of the
gradient, the strongest dense baseline). At each density every rank looks up its own ids
(uniform with repeats, as many as give that fraction of distinct rows in expectation) and
back-propagates a fixed output gradient. Systems:

* ``trainwright``: :class:`~trainwright.sync.sparse.SparseGradSync` with ``path = "auto"``
  (the cost model chooses, learning per-path corrections as it goes);
* ``forced_allgather`` / ``forced_broadcast`` / ``forced_dense``: the same with the path
  forced, so that in the same run every path is measured beside ``auto``;
* ``dense_allreduce`` and ``ddp_sparse`` (the peers).

The question: does the automatic path pick the fastest path at every density, is it never
slower than a plain dense all-reduce of the table (``ratio_vs_dense_allreduce``), and how
does it compare with DDP's sparse all-reduce at 1 %? Every target of :data:`TARGETS` gets a
:func:`~trainwright.bench.paired.judged` block (median, 90 % interval, verdict on the far
end). :func:`main` runs on loopback, then over shaped links (:func:`with_shaped`).

After one checked warm-up step of every system (all must equal the dense all-reduce),
each density runs ``repeats`` rounds; in a round every system runs ``steps`` steps,
systems in ABBA order
(:func:`~trainwright.bench.paired.round_order`); a round's figure is the median over its
steps, and headline ratios are medians of per-round (paired) ratios.

``sync_s`` is the slowest rank's time from "local gradient ready" (after a barrier) to
"averaged gradient ready". For DDP the synchronisation runs inside backward, so its
per-round ``sync_s`` is the median forward+backward time minus the median of the same under
``no_sync()`` (alternated step by step). ``bytes_sent_per_rank`` is what the collective's
algorithm makes an average rank send, not a wire capture.

By default the ranks talk over 127.0.0.1, where moving a byte costs about as much CPU as
adding it. ``--link RATE`` (``network = "netns"``) puts every rank in its own network
namespace with its egress shaped to RATE (:mod:`trainwright.bench.netns`, needs root),
so the exchange is bound by the link as between real machines.
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.bench.netns import NetnsUnavailable, TwoTierNetwork, emulated, run_ranks
from trainwright.bench.sparse_rank import FORCED, SparseBenchSpec, bench_rank
from trainwright.bench.spec_overrides import spec_overrides
from trainwright.dist import collective as coll
from trainwright.dist.testing import run_workers
from trainwright.errors import ConfigError

__all__ = ["SparseBenchSpec", "TARGETS", "run", "main", "summarise", "rule_held", "with_shaped"]


def _at(rows: list[dict], system: str, density: float) -> dict:
    return next(r for r in rows if r["system"] == system and r["density"] == density)


TARGETS = dict(auto_vs_best_forced=1.05, ratio_vs_dense_allreduce=1.05,
               ratio_vs_dense_allreduce_at_1pct=0.2, ratio_vs_ddp_sparse_at_1pct=0.65,
               ratio_vs_ddp_sparse_at_1pct_shaped=0.7)
"""Issue 39's targets (all "at most"), judged on the far end of the 90 % interval."""


def _ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / max(b, 1e-9) for a, b in zip(num, den, strict=True)]


def _all_met(blocks: dict) -> dict:
    """Per-density judged blocks plus one verdict: met only if met at every density."""
    return {"per_density": blocks, "verdict": "met" if all(
        b["verdict"] == "met" for b in blocks.values()) else "missed"}


def summarise(rows: list[dict], spec: SparseBenchSpec) -> dict:
    """The headline figures, each from paired per-round ratios of ``rows``, and a
    :func:`~trainwright.bench.paired.judged` block (median, 90 % interval, verdict) for
    every target of :data:`TARGETS`."""
    from trainwright.bench.paired import judged, paired

    out: dict = {"paths": {}, "auto_vs_best_forced": {}, "ratio_vs_dense_allreduce": {},
                 "ratio_vs_dense_step": {}}
    lo, hi = min(spec.densities, key=lambda d: abs(d - 0.01)), max(spec.densities)
    judge = {"auto_vs_best_forced": {}, "ratio_vs_dense_allreduce": {},
             "ratio_vs_dense_step": {}}
    for d in spec.densities:
        forced = {p: _at(rows, f"forced_{p}", d)["sync_s_rounds"] for p in FORCED}
        auto = _at(rows, "trainwright", d)
        plain = _at(rows, "dense_allreduce", d)
        out["paths"][str(d)] = {**{p: round(statistics.median(v), 6) for p, v in forced.items()},
                                "auto": round(auto["sync_s"], 6), "auto_took": auto["path_counts"]}
        best = [min(v[i] for v in forced.values()) for i in range(spec.repeats)]
        out["auto_vs_best_forced"][str(d)] = paired(auto["sync_s_rounds"], best)
        judge["auto_vs_best_forced"][str(d)] = judged(
            _ratios(auto["sync_s_rounds"], best), TARGETS["auto_vs_best_forced"])
        # the sync alone: "local gradient ready" to "averaged gradient ready" on both sides
        out["ratio_vs_dense_allreduce"][str(d)] = paired(auto["sync_s_rounds"],
                                                         plain["sync_s_rounds"])
        target = TARGETS["ratio_vs_dense_allreduce_at_1pct" if d == lo
                         else "ratio_vs_dense_allreduce"]
        judge["ratio_vs_dense_allreduce"][str(d)] = judged(
            _ratios(auto["sync_s_rounds"], plain["sync_s_rounds"]), target)
        # backward + sync: what turning sparse sync on changes in a step (the dense model's
        # backward fills the table-sized gradient that our dense path fills in the sync)
        step = [f + s for f, s in zip(auto["fwd_bwd_s_rounds"], auto["sync_s_rounds"],
                                      strict=True)]
        plain_step = [f + s for f, s in zip(plain["fwd_bwd_s_rounds"], plain["sync_s_rounds"],
                                            strict=True)]
        out["ratio_vs_dense_step"][str(d)] = paired(step, plain_step)
        judge["ratio_vs_dense_step"][str(d)] = judged(_ratios(step, plain_step), target)
    out["auto_vs_best_forced_max"] = max(v["ratio"] for v in out["auto_vs_best_forced"].values())
    out["ratio_vs_dense_allreduce_max"] = max(
        v["ratio"] for v in out["ratio_vs_dense_allreduce"].values())
    ours_lo = _at(rows, "trainwright", lo)["sync_s_rounds"]
    ddp_lo = [max(x, 1e-9) for x in _at(rows, "ddp_sparse", lo)["sync_s_rounds"]]
    ddp = paired(ours_lo, ddp_lo)
    out.update(ddp)  # the headline: paired_ratios, ratio, ratio_spread, interval
    out["ratio_vs_ddp_sparse_at_1pct"] = ddp["ratio"]
    out["ratio_vs_ddp_sparse_at_1pct_spread"] = ddp["ratio_spread"]
    out["ratio_vs_dense_at_1pct"] = out["ratio_vs_dense_allreduce"][str(lo)]["ratio"]
    others = [_at(rows, s, hi)["sync_s_rounds"] for s in ("dense_allreduce", "ddp_sparse")]
    out["ratio_vs_best_other_at_50pct"] = paired(
        _at(rows, "trainwright", hi)["sync_s_rounds"],
        [min(v[i] for v in others) for i in range(spec.repeats)])["ratio"]
    ddp_target = TARGETS["ratio_vs_ddp_sparse_at_1pct" if spec.network == "loopback"
                         else "ratio_vs_ddp_sparse_at_1pct_shaped"]
    out["judged"] = {
        "auto_vs_best_forced_max": _all_met(judge["auto_vs_best_forced"]),
        "ratio_vs_dense_allreduce": _all_met(judge["ratio_vs_dense_allreduce"]),
        "ratio_vs_dense_step": _all_met(judge["ratio_vs_dense_step"]),
        "ratio_vs_ddp_sparse_at_1pct": judged(_ratios(ours_lo, ddp_lo), ddp_target),
    }
    out["targets_met"] = {k: v["verdict"] == "met" for k, v in out["judged"].items()}
    return out


def rule_held(taken: list[dict]) -> bool:
    """Whether every step ``auto`` did not spend measuring a path followed the sticky rule.

    From what each step recorded (estimates, noise, the path held before it): the path
    taken is the cheapest estimate, or the held path when the cheapest is not cheaper
    beyond both paths' noise (:func:`~trainwright.sync.sparse_cost.sticky_path`). Recomputed
    here from the JSON's own numbers, so a choice that left the rule shows as ``False``.
    """
    for t in taken:
        est, noise = t["estimates_s"], t["noise"]
        if t["explored"] or not est:
            continue
        best = min(est, key=est.get)
        if t["path"] == best:
            continue
        held = t["held"]
        if t["path"] != held or held not in est:
            return False
        if est[best] * (1 + noise[best]) < est[held] * (1 - noise[held]):
            return False
    return True


def worker(tmp: str, rank: int) -> None:
    """One rank of the ``netns`` benchmark (started inside its namespace by :func:`run`)."""
    from trainwright.dist.comm import exit_now

    data = json.loads((Path(tmp) / "spec.json").read_text())
    spec = SparseBenchSpec(**data["spec"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world,
                            timeout=datetime.timedelta(seconds=data["timeout_s"]))
    bench_rank(rank, spec.world, spec, str(Path(tmp) / "result.json"),
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
                raise ConfigError(f"{exc} (or --link none to measure on loopback only)") from None
        else:
            run_workers(bench_rank, spec.world, spec, str(out), timeout_s=timeout_s)
        data = json.loads(out.read_text())
    from trainwright.bench.paired import host_info

    rows = data["rows"]
    result = dict(benchmark="sparse", spec=asdict(spec), link_model=data["link"], rows=rows,
                  host=host_info(),
                  network=(f"{spec.world} network namespaces, {spec.link_rate} egress per rank "
                           f"(tc htb)" if spec.network == "netns"
                           else "loopback 127.0.0.1, no shaping"))
    result.update(summarise(rows, spec))
    ours = [r for r in rows if r["system"] == "trainwright"]
    result["auto_followed_sticky_rule"] = rule_held([t for r in ours for t in r["paths_taken"]])
    return result


SHAPED_KEYS = ("network", "rows", "link_model", "paths", "auto_vs_best_forced",
               "ratio_vs_dense_allreduce", "ratio_vs_dense_step", "paired_ratios", "ratio",
               "ratio_spread", "interval", "ratio_vs_ddp_sparse_at_1pct", "judged",
               "targets_met", "auto_followed_sticky_rule")


def with_shaped(result: dict, spec: SparseBenchSpec, rate: str, timeout_s: float = 3000) -> dict:
    """Add the run over ``rate``-shaped links (network namespaces) to a loopback ``result``.

    The shaped run's figures go under ``result["shaped"]``; its DDP judgement (target
    :data:`TARGETS` ``ratio_vs_ddp_sparse_at_1pct_shaped``) also joins the top-level
    ``judged`` and ``targets_met``, with the headline ``ratio_vs_ddp_sparse_at_1pct_shaped``.
    Where namespaces cannot be built (not root, no iproute2) the reason is recorded and the
    verdict is ``"not run"``: a missing run never reads as a met target.
    """
    from dataclasses import replace

    key = "ratio_vs_ddp_sparse_at_1pct_shaped"
    try:
        shaped = run(replace(spec, network="netns", link_rate=rate), timeout_s)
    except ConfigError as exc:
        result["shaped"] = {"link_rate": rate, "skipped": str(exc)}
        result["judged"][key] = {"target": TARGETS[key], "target_is": "at_most",
                                 "verdict": "not run"}
        result["targets_met"][key] = False
        return result
    result["shaped"] = {"link_rate": rate, **{k: shaped[k] for k in SHAPED_KEYS}}
    result[key] = shaped["ratio_vs_ddp_sparse_at_1pct"]
    result["judged"][key] = shaped["judged"]["ratio_vs_ddp_sparse_at_1pct"]
    result["targets_met"][key] = result["judged"][key]["verdict"] == "met"
    return result


def main(args) -> dict:
    """CLI entry: ``trainwright bench sparse [--repeats N] [--steps N] [--link RATE|none]
    [--spec rows=N ...]``: on loopback, then over links shaped to RATE (default 1gbit)
    unless ``--link none``."""
    default = SparseBenchSpec()
    repeats = getattr(args, "repeats", None) or default.repeats
    steps = getattr(args, "steps", None) or default.steps
    asked = getattr(args, "link", None)
    link = asked or "1gbit"
    if asked and asked != "none":  # asked for by name: say at once, before the loopback run
        try:
            TwoTierNetwork.check_privilege()
        except NetnsUnavailable as exc:
            raise ConfigError(f"{exc} (or --link none to measure on loopback only)") from None
    spec = SparseBenchSpec(**{"repeats": repeats, "steps": steps, "link_rate": link,
                              **spec_overrides("sparse", default, getattr(args, "spec", None))})
    result = run(spec)
    return result if link == "none" else with_shaped(result, spec, link)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: python -m trainwright.bench.sparse --worker TMPDIR RANK "
                 "(started by `trainwright bench sparse --link RATE`)")
