"""What ``trainwright bench planner`` predicts from one profile of the model.

The sweep's spec (:class:`ForecastSpec`), the profile (:class:`Profile`, several takes
:func:`merged` into one), and from them: a configuration's step time
(:func:`predict`: the simulator over the schedule's action lists, with the machine's
calibration and the model's terms under shared cores), each stage's peak
(:func:`predicted_peaks`: the footprint model) and the plans made under a limit
(:func:`plan_limit`). The model's terms under shared cores are fitted here too, to its
contention runs (:data:`CONTENTION_RUNS`, :func:`fit_inflation`).
:mod:`~trainwright.bench.planner_forecast` measures the profile, runs the sweep and judges
these predictions against it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace

from trainwright.errors import ConfigError

__all__ = ["DEFAULT_CONFIGS", "ForecastSpec", "Profile", "merged", "layer_policies",
           "predict", "predicted_peaks", "plan_limit", "CONTENTION_RUNS",
           "contention_configs", "fit_inflation", "inflations_of", "COPY_INFLATION_FLOOR"]

DEFAULT_CONFIGS = [  # (pp, micro-batches, schedule, policy)
    (2, 2, "gpipe", "keep"), (2, 4, "1f1b", "keep"), (2, 8, "1f1b", "recompute"),
    (2, 4, "gpipe", "swap"), (2, 8, "zb-h1", "keep"), (2, 4, "zb-h2", "recompute"),
    (2, 4, "interleaved-1f1b", "keep"), (2, 8, "zb-v", "keep"),
    (4, 4, "gpipe", "keep"), (4, 8, "1f1b", "keep"), (4, 2, "1f1b", "swap"),
    (4, 8, "gpipe", "recompute"), (4, 4, "zb-h1", "swap"), (4, 8, "zb-h2", "keep"),
    (4, 4, "interleaved-1f1b", "recompute"), (4, 8, "zb-v", "keep"),
    *[(pp, 8, sched, f"limit{pct}") for pct in (30, 50, 80)
      for pp, sched in ((4, "1f1b"), (4, "gpipe"), (2, "1f1b"), (4, "zb-h1"))],
]
"""28 configurations; the 12 under a limit plan 42 stages."""


@dataclass(kw_only=True)
class ForecastSpec:
    """The GPT every configuration trains (fixed micro-batch size) and the configurations."""

    n_blocks: int = 6
    d_model: int = 128
    n_heads: int = 4
    context: int = 64
    micro_batch_size: int = 4
    steps: int = 12
    warmup: int = 2
    repeats: int = 3
    """Rounds of every configuration; its measured step is their median. Three, so that
    one run far off the others (a run of pp 4 ZB-H1 x 8 took 523 ms where its other two
    took 280 and 248, 2026-12-08) does not move it: with two, the median is their mean."""
    profile_repeats: int = 5
    configs: list = field(default_factory=lambda: [list(c) for c in DEFAULT_CONFIGS])
    calibration: str = ""
    """Where the machine's calibration is cached ("": ``~/.cache/trainwright``)."""

    @property
    def n_layers(self) -> int:
        """Embedding, blocks and head."""
        return self.n_blocks + 2

    def parts(self, n_stages: int) -> list[int]:
        """Layers per (model) stage, as even as possible (the first get the extra ones)."""
        n = self.n_layers
        return [n // n_stages + (s < n % n_stages) for s in range(n_stages)]

    def overrides(self, pp: int, mbs: int, schedule: str, policy) -> list[str]:
        """``--set`` values of one configuration (``policy``: one name, or one per layer)."""
        from trainwright.schedule.actions import VIRTUAL_SCHEDULES

        v = 2 if schedule in VIRTUAL_SCHEDULES else 1
        pols = [policy] if isinstance(policy, str) else list(policy)
        return [f"model.n_blocks={self.n_blocks}", f"model.d_model={self.d_model}",
                f"model.n_heads={self.n_heads}", f"model.context={self.context}",
                'model.factory="trainwright.bench.live_meter:bench_gpt"',
                'data.factory="trainwright.bench.live_meter:bench_data"', "data.max_bytes=1000000",
                f"train.batch_size={mbs * self.micro_batch_size}",
                f"train.micro_batches={mbs}", f'train.schedule="{schedule}"',
                "train.optimizer=sgd", "train.lr=0.01", f"parallel.pp={pp}",
                f"parallel.virtual_stages={v}",
                f"parallel.partition={self.parts(pp * v)}", "parallel.threads_per_rank=1",
                f"memory.policies={json.dumps(pols)}", "run.report=false",
                "run.progress=false",
                "run.checkpoint_every=0", "run.trace_steps=0", "run.profile_every=1000"]


@dataclass
class Profile:
    """Everything the prediction knows, measured once."""

    rows: list
    """:class:`~trainwright.observe.tensor_profile.LayerTensors` per layer (median times)."""
    opt_step_s: list[float]
    """SGD step per layer."""
    latency_s: float
    bandwidth_Bps: float
    host_bandwidth_Bps: float
    wall_s: float
    table: object = None
    """The footprint terms of the same micro-batch
    (:func:`~trainwright.pipeline.profile.profile_model`'s
    :class:`~trainwright.pipeline.profile.ProfileTable`): what :func:`predicted_peaks` and
    :func:`plan_limit` use; None: the simulator's activation-store peak instead."""
    takes_ms: list = field(default_factory=list)
    """Per take of a :func:`merged` profile, its layers' forward + backward, summed (ms)."""
    copy_cpu_s_per_byte: float = 0.0
    """Thread CPU seconds per byte of the host-swap copies in one process (the swap's
    forward copies, :meth:`~trainwright.pipeline.swap.HostSwap.take_copies`); 0: not
    measured. A run's own over this is its copies' inflation (:func:`fit_inflation`)."""

    def summary(self) -> dict:
        """JSON view (per-layer times and bytes, links)."""
        return {"layers": [{"name": r.name, "forward_s": r.forward_s,
                            "backward_s": r.backward_s, "weight_s": r.weight_s,
                            "saved_bytes": r.saved_bytes,
                            "input_bytes": r.input_bytes, "output_bytes": r.output_bytes}
                           for r in self.rows],
                "opt_step_s": self.opt_step_s, "latency_s": self.latency_s,
                "bandwidth_Bps": self.bandwidth_Bps,
                "host_bandwidth_Bps": self.host_bandwidth_Bps, "wall_s": self.wall_s,
                "takes_ms": self.takes_ms, "copy_cpu_s_per_byte": self.copy_cpu_s_per_byte}


def merged(takes: list[Profile]) -> Profile:
    """One profile from several takes of it at different moments: every time the median
    of the takes' (the footprint terms and the rows' bytes are the last take's; sizes do
    not drift). This machine's speed wanders by 15-30 % over minutes: a profile taken in
    two seconds of a slow phase (its layers summed 38 ms against 33-34 ms before and after)
    moved every prediction of a sweep by as much."""
    last = takes[-1]
    med = statistics.median
    rows = [replace(r, forward_s=med(t.rows[i].forward_s for t in takes),
                    backward_s=med(t.rows[i].backward_s for t in takes),
                    weight_s=med(t.rows[i].weight_s for t in takes))
            for i, r in enumerate(last.rows)]
    return Profile(rows, [med(t.opt_step_s[i] for t in takes) for i in range(len(last.rows))],
                   med(t.latency_s for t in takes), med(t.bandwidth_Bps for t in takes),
                   med(t.host_bandwidth_Bps for t in takes), sum(t.wall_s for t in takes),
                   last.table, [round(1e3 * sum(r.forward_s + r.backward_s for r in t.rows), 2)
                                for t in takes],
                   med(t.copy_cpu_s_per_byte for t in takes))


def _layout(spec: ForecastSpec, pp: int, schedule: str):
    """``(virtual stages, layers of each model stage, rank of each model stage)``."""
    from trainwright.schedule.actions import VIRTUAL_SCHEDULES, stage_ranks

    v = 2 if schedule in VIRTUAL_SCHEDULES else 1
    if pp * v > spec.n_layers:
        raise ValueError(f"{schedule} on pp {pp} cuts the model into {pp * v} stages but it "
                         f"has {spec.n_layers} layers: raise n_blocks to at least "
                         f"{pp * v - 2} or drop that configuration")
    parts = spec.parts(pp * v)
    idx = [list(range(sum(parts[:s]), sum(parts[: s + 1]))) for s in range(pp * v)]
    return v, idx, stage_ranks(schedule, pp, v)


def layer_policies(spec: ForecastSpec, policy) -> dict[int, str]:
    if isinstance(policy, str):
        return dict.fromkeys(range(spec.n_layers), policy)
    return dict(enumerate(policy))


def predict(profile: Profile, spec: ForecastSpec, pp: int, mbs: int, schedule: str,
            policy, cal=None, inflation: float = 1.0, copy_inflation: float = 1.0) -> dict:
    """Predicted step time and per-stage activation peak of one configuration, from the
    profile (and the machine's calibration ``cal``; None: the profile alone).

    ``policy``: one name for every layer, or one per layer. ``inflation`` and
    ``copy_inflation``: the model's compute and its host-swap copies under shared cores
    over their profiled times (:func:`fit_inflation`; used when ``cal`` measured the
    processor-sharing replay's terms)."""
    from trainwright.bench.planner_predict import _layer_policy_placement
    from trainwright.plan.calibration import count_segments, with_delivery, with_overheads
    from trainwright.plan.simulate import Links, simulate
    from trainwright.plan.stage_inputs import stage_costs
    from trainwright.schedule.actions import build_schedule
    from trainwright.schedule.carry import simulated_lists

    v, idx, ranks = _layout(spec, pp, schedule)
    pols = layer_policies(spec, policy)
    per_rank = [[i for s, layers in enumerate(idx) if ranks[s] == r for i in layers]
                for r in range(pp)]
    placement = _layer_policy_placement(profile.rows, per_rank, pols)
    step_s = [sum(profile.opt_step_s[i] for i in layers) for layers in idx]
    costs = stage_costs(profile.rows, idx, placement, list(range(pp)), step_s,
                        [0.0] * len(idx), rank_of=ranks if v > 1 else None)
    if cal is not None:
        costs = with_overheads(costs, [count_segments(layers, pols) for layers in idx], cal)
    bw = [[0.0 if i == j else profile.bandwidth_Bps for j in range(pp)] for i in range(pp)]
    links = with_delivery(Links(list(range(pp)), bw, host_bandwidth=profile.host_bandwidth_Bps,
                                latency_s=profile.latency_s), cal, pp)
    lists = simulated_lists(schedule, build_schedule(schedule, pp, mbs, v))
    sim = simulate(lists, costs, links, slowdown=cal.factor if cal is not None else None,
                   sharing=cal.sharing(inflation, copy_inflation) if cal is not None else None)
    return {"step_s": sim.step_s, "slowdown": sim.slowdown, "busy_s": list(sim.busy_s),
            "peak_bytes": list(sim.own_peak_bytes)}


def predicted_peaks(profile: Profile, spec: ForecastSpec, pp: int, mbs: int, schedule: str,
                    policy) -> dict:
    """Per-stage predicted peaks of one configuration: ``{"device": [...], "host": [...] or
    None}``: the footprint model's (:func:`~trainwright.pipeline.budget.predicted_footprints`:
    activations walked over each rank's schedule, host copies apart) when the profile has
    its terms, else the simulator's activation-store peak and no host prediction."""
    if profile.table is None:
        return {"device": predict(profile, spec, pp, mbs, schedule, policy)["peak_bytes"],
                "host": None}
    from trainwright.config import load_config
    from trainwright.pipeline.budget import predicted_footprints

    cfg = load_config(None, spec.overrides(pp, mbs, schedule, policy))
    fps = predicted_footprints(cfg, profile.table)
    return {"device": [f.activations for f in fps], "host": [f.host for f in fps]}


def plan_limit(profile: Profile, spec: ForecastSpec, pp: int, mbs: int, schedule: str,
               fraction: float) -> dict:
    """Per-layer policies planned from the profile for each stage's limit of ``fraction``
    of its predicted unconstrained peak (:func:`predicted_peaks`, every layer kept).

    With the footprint terms, the plan is the one ``memory.limit`` makes in a run
    (:func:`~trainwright.plan.fit.fit_plan` per rank, held to the walk); without
    them, the peer-swap planner's with host swap and recompute only.

    Returns:
        ``limits`` (bytes per rank), ``policies`` (one per layer), ``fits`` (per rank, the
        planner's word).
    """
    keep = predicted_peaks(profile, spec, pp, mbs, schedule, "keep")["device"]
    limits = [int(fraction * p) for p in keep]
    if profile.table is not None:
        return _fit_limits(profile, spec, pp, mbs, schedule, limits)
    from trainwright.pipeline.peer_setup import runtime_policies
    from trainwright.plan.devices import DeviceTopology
    from trainwright.plan.placement import Rules
    from trainwright.plan.planner import PlanRequest, make_plan

    v, idx, _ = _layout(spec, pp, schedule)
    bw = [[0.0 if i == j else profile.bandwidth_Bps for j in range(pp)] for i in range(pp)]
    topo = DeviceTopology("loopback", [max(keep) * 4] * pp, bw,
                          [profile.host_bandwidth_Bps] * pp)
    req = PlanRequest(profile.rows, schedule, pp, mbs, topo, budget=limits,
                      partition=[len(x) for x in idx], peer_swap=False, virtual_stages=v,
                      latency_s=profile.latency_s,
                      rules=Rules(short_s=math.inf, long_s=math.inf,
                                  families=("host", "recompute")))
    plan = make_plan(req).to_dict()
    got = runtime_policies(plan)
    return {"limits": limits, "fits": list(plan["fits"]),
            "policies": [got.get(i, "keep") for i in range(spec.n_layers)]}


def _fit_limits(profile: Profile, spec: ForecastSpec, pp: int, mbs: int, schedule: str,
                limits: list[int]) -> dict:
    """:func:`plan_limit` with the footprint terms: per rank, the plan ``memory.limit``
    makes (:func:`~trainwright.plan.fit.fit_plan`). A limit below what any plan can
    meet (a run would refuse it, naming the smallest feasible) is raised to the smallest
    feasible, every layer recomputed or swapped, the better: ``requested_limits`` keeps
    what was asked."""
    from trainwright.config import load_config
    from trainwright.errors import PlanError
    from trainwright.pipeline.budget import (
        chunked_layer_mems,
        rank_chunks,
        rank_terms,
        stage_in_flight,
    )
    from trainwright.plan.fit import fit_plan
    from trainwright.plan.footprint import walk

    cfg = load_config(None, spec.overrides(pp, mbs, schedule, "keep"))
    table = profile.table
    chunks = rank_chunks(cfg, cfg.partition(len(table)))
    used, policies, fits = [], {}, []
    for r, (rows, flight) in enumerate(zip(rank_terms(cfg, table), stage_in_flight(cfg),
                                           strict=True)):
        mems = chunked_layer_mems(list(table), chunks[r])
        actions = list(flight.actions)
        try:
            plan = fit_plan(mems, rows, flight, limits[r], profile.host_bandwidth_Bps,
                            cfg.memory.planner)
            pol, limit = (plan.policies if plan is not None else {}), limits[r]
        except PlanError:
            uniform = [{x.layer: p for x in rows} for p in ("recompute", "swap")]
            pol = min(uniform, key=lambda u: walk(rows, u, actions, arrive=flight.arrive)[0])
            limit = max(limits[r], 1 + walk(rows, pol, actions, arrive=flight.arrive)[0])
        used.append(limit)
        fits.append(walk(rows, pol, actions, arrive=flight.arrive)[0] < limit)
        policies.update(pol)
    return {"limits": used, "requested_limits": list(limits), "fits": fits,
            "policies": [policies.get(i, "keep") for i in range(spec.n_layers)]}


CONTENTION_RUNS = ((3, "1f1b", "keep"), (3, "gpipe", "keep"), (3, "1f1b", "swap"))
"""Micro-batches, schedule and policy of the runs per rank count that measure the model's
compute and host-swap copies under shared cores (:func:`fit_inflation`): configurations the
sweep does not hold, so that no prediction it judges is fitted to its own run; two that
keep every layer, so that one run's noise moves the compute's fit half as much, and one
that swaps every layer to the host for the copies'."""


def contention_configs(spec: ForecastSpec, keys: list[tuple]) -> list[tuple]:
    """The :data:`CONTENTION_RUNS` of each rank count of the sweep.

    Raises:
        ConfigError: the sweep holds one of them (it would be judged against itself).
    """
    probes = [(pp, *run) for pp in sorted({k[0] for k in keys}) for run in CONTENTION_RUNS]
    clash = [k for k in probes if k in keys]
    if clash:
        raise ConfigError(f"bench planner: the sweep holds {clash}, a run that measures the "
                          f"model's compute under shared cores; drop it from the sweep")
    return probes


COPY_INFLATION_FLOOR = 1.0
"""The least ``copy_inflation`` :func:`fit_inflation` fits: a host copy in a pipeline of
ranks sharing the host takes at least its single-process time (until 2026-12-08 the floor
was 0.5, and one all-swap run in the keep runs' noise reached it)."""


def fit_inflation(profile: Profile, spec: ForecastSpec, cal, configs: list[list],
                  measured_s: list[float], copies_measured: float | None = None) -> dict:
    """The model's terms under shared cores, from its contention runs ``configs`` (which
    took ``measured_s``): ``inflation``, its compute time over its profile, at which the
    processor-sharing replay of the runs that keep every layer takes what they took (their
    geometric means equal); then ``copy_inflation``, its host-swap copies' time over the
    single-process swap rate: ``copies_measured`` where the runs that swap every layer
    measured it (their copies' thread CPU per byte over the profile's,
    :func:`~trainwright.bench.planner_forecast.copy_ratios`), the fitted value beside it as
    ``copy_inflation_fitted``; else fitted, with that inflation, to those runs' step times
    (1.0 without one; never below :data:`COPY_INFLATION_FLOOR`). A fit is ill-conditioned
    where the copies are a small share of the step: fits of 0.5 to 4.76 came out of the
    same sweep on one day, where the measured ratio of four runs read 1.44-1.84. Both 1.0
    when ``cal`` did not measure the replay's terms."""
    from trainwright.plan.calibration import fit_increasing

    if cal is None or cal.sharing() is None:
        return {"inflation": 1.0, "copy_inflation": 1.0}

    def fitted(policy: str, at, lowest: float) -> float | None:
        runs = [(c, m) for c, m in zip(configs, measured_s, strict=True) if c[3] == policy]
        if not runs:
            return None

        def predicted(x: float) -> float:
            return statistics.geometric_mean(
                predict(profile, spec, *c, cal, *at(x))["step_s"] for c, _ in runs)
        return fit_increasing(predicted, statistics.geometric_mean(m for _, m in runs),
                              lowest, 8.0)
    inflation = fitted("keep", lambda x: (x, 1.0), 0.5) or 1.0
    # copies sharing the memory with other ranks' work run no faster than alone: an
    # all-swap run within the keep runs' noise (113 / 122 / 105 ms against 108-127,
    # 2026-12-08) fitted 0.5, the old floor, and made every swap plan at pp 4 too cheap
    copies = fitted("swap", lambda x: (inflation, x), COPY_INFLATION_FLOOR) or 1.0
    if copies_measured is None:
        return {"inflation": round(inflation, 4), "copy_inflation": round(copies, 4)}
    return {"inflation": round(inflation, 4), "copy_inflation": round(copies_measured, 4),
            "copy_inflation_fitted": round(copies, 4)}


def inflations_of(contention: dict | None) -> tuple[float, float]:
    """``(inflation, copy_inflation)`` fitted for a rank count (1.0 where none was):
    :func:`predict`'s last arguments."""
    c = contention or {}
    return c.get("inflation", 1.0), c.get("copy_inflation", 1.0)
