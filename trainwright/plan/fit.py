"""A stage's memory plan held to the footprint walk.

The policy planners (:mod:`~trainwright.plan.memory`) price activations with the store's
model; :func:`fit_plan` accepts a plan only when the footprint walk
(:func:`~trainwright.plan.footprint.walk`) puts its peak under the limit, lowering the
planners' bound by what the walk found over it. Pure: numbers in, plans out.
"""

from __future__ import annotations

from trainwright.errors import PlanError
from trainwright.plan.footprint import LayerTerms, walk
from trainwright.plan.memory import MemoryPlan, greedy_plan, needs_optimising, optimal_plan

__all__ = ["fit_plan"]


def fit_plan(mems: list, terms: list[LayerTerms], in_flight: int, limit_bytes: int | None,
             host_bandwidth: float, planner: str = "greedy",
             current: dict[int, str] | None = None, copy_back: bool = False,
             arrive: dict[int, list] | None = None, tries: int = 12):
    """:func:`~trainwright.plan.memory.plan_stage` held to the footprint walk.

    The policy planners price activations with the store's model (held bytes and one
    transient); the walk (:func:`~trainwright.plan.footprint.walk`) also sees forward
    working sets, recomputes during backward and gradient buffers. A plan is accepted only
    when the walk's device peak is below ``limit_bytes``; otherwise the planners' bound is
    lowered by the overshoot and they plan again (no margin is added: the bound moves by
    what the walk measured).

    Args:
        mems, in_flight, limit_bytes, host_bandwidth, planner, current: as
            :func:`~trainwright.plan.memory.plan_stage`; ``in_flight.actions`` must hold
            the rank's schedule.
        terms: the rank's :class:`~trainwright.plan.footprint.LayerTerms`, in the order of
            ``mems``.
        copy_back, arrive: see :func:`~trainwright.plan.footprint.walk`.

    Returns:
        None when ``current`` stays (it fits by the walk and recomputes nothing needlessly),
        else the plan, its ``required_bytes`` the walk's peak.

    Raises:
        PlanError: no plan's walk fits under ``limit_bytes``.
    """
    actions, arrive = in_flight.actions, arrive if arrive is not None else in_flight.arrive
    current = dict(current or {})
    if limit_bytes is None:
        return None

    def peak(policies: dict[int, str]) -> int:
        return walk(terms, policies, actions, copy_back, arrive)[0]

    now = peak(current)
    if now < limit_bytes and needs_optimising(mems, current, in_flight, None) is None:
        return None
    make = greedy_plan if planner == "greedy" else optimal_plan
    cap, best = limit_bytes, None
    for _ in range(tries):
        try:
            plan = make(mems, in_flight, cap, host_bandwidth,
                        reason=f"footprint {now} B >= limit {limit_bytes} B" if now >= limit_bytes
                        else "needless recompute")
        except PlanError:  # the store's model finds no plan under ``cap``
            break
        got = peak(plan.policies)
        if got < limit_bytes:
            plan.required_bytes = got
            return plan
        best = got if best is None else min(best, got)
        cap -= got - limit_bytes + 1
    # the store's model ran out (no plan, or none the walk accepts): the cheaper of every
    # layer swapped / every layer recomputed that fits by the walk (which may price them
    # lower than the store's model: a CPU swap brings nothing back)
    uniform = [{x.layer: p for x in terms} for p in ("swap", "recompute")]
    peaks = [peak(pol) for pol in uniform]
    fits = [MemoryPlan.build(mems, pol, in_flight, limit_bytes, host_bandwidth, planner,
                             "every layer swapped or recomputed")
            for pol, got in zip(uniform, peaks, strict=True) if got < limit_bytes]
    if fits:
        plan = min(fits, key=lambda p: p.added_time_s)
        plan.required_bytes = peak(plan.policies)
        return plan
    need = min(peaks) if best is None else min(best, *peaks)
    raise PlanError(f"no memory plan fits the limit {limit_bytes} bytes by the footprint "
                    f"model (forward working sets, recomputes and receive buffers included); "
                    f"the best plan found peaks at {need} bytes; raise memory.limit to at "
                    f"least {need + 1} bytes or use more stages")
