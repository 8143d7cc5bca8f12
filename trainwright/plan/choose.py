"""Choose a pipeline schedule by predicted step time: the candidates and the plan of each.

``trainwright plan --schedule auto`` plans every candidate schedule at every depth it
tries and keeps the plan where every rank fits its budget, then the least predicted step
time (:func:`best_plan`). The candidates (:func:`schedule_candidates`) are the
one-stage-per-rank schedules (GPipe, 1F1B, ZB-H1, ZB-H2), ZB-V (two chunks per rank in a
V) and interleaved 1F1B with 2 .. ``max_virtual`` chunks per rank, each only where it can
run: every multi-chunk schedule needs ``pp >= 2`` and at least ``pp * v`` layers,
interleaved 1F1B also a number of micro-batches that is a multiple of ``pp``.
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from trainwright.plan.planner import PlanRequest, PlanResult, make_plan
from trainwright.schedule.actions import SCHEDULES

__all__ = ["schedule_candidates", "best_plan", "PEER_SWAP_SCHEDULES", "MAX_AUTO_VIRTUAL"]

PEER_SWAP_SCHEDULES = ("1f1b", "gpipe")
"""Schedules the run-time peer swap works with (the others are planned without it)."""

MAX_AUTO_VIRTUAL = 4
"""Most chunks per rank that ``auto`` tries for interleaved 1F1B."""


def schedule_candidates(pp: int, micro_batches: int, n_layers: int,
                        max_virtual: int = MAX_AUTO_VIRTUAL) -> tuple[list[tuple[str, int]],
                                                                     list[dict]]:
    """Every ``(schedule, virtual_stages)`` worth planning, and those left out with why.

    Args:
        pp: pipeline ranks; ``micro_batches``: per step; ``n_layers``: the model's layers.
        max_virtual: most chunks per rank tried for interleaved 1F1B.

    Returns:
        ``(candidates, skipped)``; each skipped row names the schedule, its
        ``virtual_stages`` and the reason.
    """
    out = [(s, 1) for s in SCHEDULES if pp <= n_layers]
    skipped = []
    wanted = [("zb-v", 2)] + [("interleaved-1f1b", v) for v in range(2, max_virtual + 1)]
    for s, v in wanted:
        why = ""
        if pp < 2:
            why = "needs pp >= 2"
        elif pp * v > n_layers:
            why = f"{pp * v} stages need more than the model's {n_layers} layers"
        elif s == "interleaved-1f1b" and micro_batches % pp:
            why = f"{micro_batches} micro-batches are not a multiple of pp = {pp}"
        if why:
            skipped.append({"pp": pp, "schedule": s, "virtual_stages": v, "skipped": why})
        else:
            out.append((s, v))
    return out, skipped


def best_plan(base: PlanRequest, candidates: list[tuple[str, int]]
              ) -> tuple[PlanResult | None, list[dict]]:
    """Plan ``base`` under every candidate schedule; keep the best.

    Args:
        base: the request (its ``schedule`` and ``virtual_stages`` are replaced; peer swap
            stays on only for :data:`PEER_SWAP_SCHEDULES`).
        candidates: ``(schedule, virtual_stages)`` pairs.

    Returns:
        The plan where every rank fits, then of least predicted step time (None when no
        candidate could be planned), and one row per candidate: its prediction, or the
        error that ruled it out.
    """
    best, key, tried = None, None, []
    for schedule, v in candidates:
        req = replace(base, schedule=schedule, virtual_stages=v,
                      peer_swap=base.peer_swap and schedule in PEER_SWAP_SCHEDULES)
        try:
            plan = make_plan(req)
        except Exception as exc:  # a schedule that cannot work is reported, not fatal
            tried.append({"pp": req.pp, "schedule": schedule, "virtual_stages": v,
                          "error": str(exc)[:200]})
            continue
        fits = all(sp.fits for sp in plan.placement.stages)
        tried.append({"pp": req.pp, "schedule": schedule, "virtual_stages": v,
                      "micro_batches": req.micro_batches, "fits": fits,
                      "step_s": plan.sim.step_s})
        if key is None or (not fits, plan.sim.step_s) < key:
            best, key = plan, (not fits, plan.sim.step_s)
    return best, tried
