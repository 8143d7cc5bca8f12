"""Predicting a measured ``trainwright bench planner`` run with the simulator.

Everything here reads a harness run's own trace (:func:`~trainwright.run.harness.
run_gpt_pipeline` results: per-step action events and per-layer profiles) and calibrates
:func:`~trainwright.plan.simulate.simulate` from it; see :mod:`trainwright.bench.planner`
for what is compared.
"""

from __future__ import annotations

import statistics

from trainwright.schedule.base import ActionKind

__all__ = ["measured", "predict", "predict_steps", "loaded_latency"]


def _rows_with_times(tensor_rows: list, results: list[dict], warmup: int) -> list:
    """Tensor-profile rows with the run's own per-layer times (median after warm-up)."""
    import copy

    times: dict[int, tuple[list, list]] = {}
    for res in results:
        for prof in res["profiles"][warmup:]:
            for c in prof:
                f, b = times.setdefault(c["layer"], ([], []))
                f.append(c["forward_s"])
                b.append(c["backward_s"])
    out = copy.deepcopy(tensor_rows)
    for r in out:
        f, b = times[r.layer]
        r.forward_s, r.backward_s = statistics.median(f), statistics.median(b)
    return out


def measured(results: list[dict], warmup: int) -> tuple[float, list[int]]:
    """Mean step time after warm-up (slowest rank per step) and each stage's peak."""
    steps = [max(res["step_s"][i] for res in results)
             for i in range(warmup, len(results[0]["step_s"]))]
    return statistics.fmean(steps), [max(res["peak_bytes"]) for res in results]


_FORWARD = (ActionKind.F, ActionKind.SEND_F)
"""What a micro-batch's forward costs a stage: its compute and posting its activation."""
_BACKWARD = (ActionKind.B, ActionKind.SEND_B)


def _action_mean(res: dict, kinds: tuple, step: int) -> float:
    """Mean over the micro-batches of step ``step`` of the summed durations of ``kinds``."""
    per: list[float] = []
    for events in res["events"][step : step + 1]:
        by_mb: dict[int, float] = {}
        for kind, mb, dur, *_ in events:
            if kind in kinds:
                by_mb[mb] = by_mb.get(mb, 0.0) + dur
        per += list(by_mb.values())
    return statistics.fmean(per) if per else 0.0


def _per_mb(events: list, kinds: tuple) -> dict[int, float]:
    out: dict[int, float] = {}
    for kind, mb, d, *_ in events:
        if kind in kinds:
            out[mb] = out.get(mb, 0.0) + d
    return out


def loaded_latency(results: list[dict], step: int) -> float | None:
    """Mean delivery time of the step's activation and gradient messages, from the trace:
    receive end minus the later of the send's post and the receive's start. On a machine
    with more ranks than cores this is mostly the wait for the sending process to be
    scheduled (gloo moves the data from the sender's side once the receive is posted)."""
    posted: dict[tuple, float] = {}
    for s, res in enumerate(results):
        for kind, mb, _, start in res["events"][step]:
            if kind == ActionKind.SEND_F:
                posted[(ActionKind.F, s + 1, mb)] = start
            elif kind == ActionKind.SEND_B:
                posted[(ActionKind.B, s - 1, mb)] = start
    got = []
    for s, res in enumerate(results):
        for kind, mb, d, start in res["events"][step]:
            key = (ActionKind.F if kind == ActionKind.RECV_F else ActionKind.B, s, mb)
            if kind in (ActionKind.RECV_F, ActionKind.RECV_B) and key in posted:
                got.append(start + d - max(start, posted[key]))
    return statistics.fmean(got) if got else None


_POSTS = frozenset({ActionKind.PEER_RECV, ActionKind.PEER_FETCH, ActionKind.PEER_RETURN})
"""Peer-swap kinds that post transfers and never wait long."""


def _action_overheads(events: list) -> dict[str, float]:
    """Work of actions that only post transfers (mean of the step), which the simulator
    does not otherwise time; waiting actions are timed by the link model."""
    by: dict[str, list[float]] = {}
    for kind, _, d, *_ in events:
        by.setdefault(kind, []).append(d)
    return {k: statistics.fmean(v) for k, v in by.items() if k in _POSTS}


def predict_steps(tensor_rows: list, results: list[dict], spec,
                  schedule: str, placement, latency: float, bandwidth: float,
                  per_mb: bool = False):
    """One prediction per measured step after warm-up (each calibrated on its own step);
    returns the mean predicted step time and the last replay (for peaks). ``per_mb``
    replays each micro-batch's own measured compute time (a diagnostic, not a prediction)."""
    sims = [predict(tensor_rows, results, spec, schedule, placement, latency, bandwidth, step=i,
                    per_mb=per_mb)
            for i in range(spec.warmup, len(results[0]["step_s"]))]
    return statistics.fmean(x.step_s for x in sims), sims[-1]


def predict(tensor_rows: list, results: list[dict], spec, schedule: str,
            placement, latency: float, bandwidth: float, policies: dict | None = None,
            step: int = -1, per_mb: bool = False):
    """Simulator prediction of step ``step`` of a harness run, calibrated from that run.

    Compute: each stage's forward and backward action times of that step (with the send
    posted right after them) as the runtime traced them, means over micro-batches; the
    per-layer profile splits them over layers (for liveness). Memory: tensor sizes from
    the tensor profile. Links: the ping-pong's bandwidth and the step's loaded message
    latency (:func:`loaded_latency`; the ping-pong's latency if it has no messages).
    """
    from trainwright.plan.simulate import Links, simulate
    from trainwright.plan.stage_inputs import stage_costs
    from trainwright.schedule.actions import build_schedule
    from trainwright.schedule.peer import with_peer_swap

    stages = len(results)
    rows = _rows_with_times(tensor_rows, results, spec.warmup)
    parts = spec.parts(stages)
    idx = [list(range(sum(parts[:s]), sum(parts[: s + 1]))) for s in range(stages)]
    placement = placement or _layer_policy_placement(rows, idx, policies or {})
    costs = stage_costs(rows, idx, placement, list(range(stages)), [0.0] * stages,
                        [0.0] * stages)
    for c, res in zip(costs, results, strict=True):
        step = step if step >= 0 else len(res["events"]) - 1
        f = _action_mean(res, _FORWARD, step)
        b = _action_mean(res, _BACKWARD, step)
        c.layer_forward_s = [x * f / max(c.forward_s, 1e-12) for x in c.layer_forward_s]
        c.layer_backward_s = [x * b / max(c.backward_s, 1e-12) for x in c.layer_backward_s]
        c.forward_s, c.backward_s = f, b
        c.step_s = _action_mean(res, (ActionKind.STEP,), step)
        c.action_s = _action_overheads(res["events"][step])
        if per_mb:
            c.mb_forward_s = _per_mb(res["events"][step], _FORWARD)
            c.mb_backward_s = _per_mb(res["events"][step], _BACKWARD)
    peers = {s: sorted(c.peer_bytes) for s, c in enumerate(costs) if c.peer_bytes}
    bw = [[0.0 if i == j else bandwidth for j in range(stages)] for i in range(stages)]
    loaded = loaded_latency(results, step if step >= 0 else len(results[0]["events"]) - 1)
    links = Links(list(range(stages)), bw, host_bandwidth=1e11,
                  latency_s=loaded if loaded is not None else latency)
    return simulate(with_peer_swap(build_schedule(schedule, stages, spec.micro_batches),
                                   peers), costs, links)


def _layer_policy_placement(rows: list, idx: list[list[int]], policies: dict):
    """A placement object equivalent to per-layer runtime policies (host swap = every saved
    tensor of the layer to the host; recompute = the whole layer)."""
    from trainwright.plan.placement import HOST, Chunk, Placement, StagePlacement, TensorPlan

    stages = []
    for s, layers in enumerate(idx):
        tps = []
        for i in layers:
            pol = policies.get(i, "keep")
            for t in rows[i].tensors:
                if pol == "swap":
                    tps.append(TensorPlan(i, t.index, t.nbytes, "host",
                                          [Chunk(HOST, t.nbytes)]))
                else:
                    tps.append(TensorPlan(i, t.index, t.nbytes, pol))
        stages.append(StagePlacement(s, s, tps, 0, 0, 0.0, True))
    return Placement(list(range(len(idx))), stages, {}, {})
