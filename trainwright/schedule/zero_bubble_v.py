"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024) as action lists.

Two model chunks per rank in a V: the model is cut into ``2p`` stages and rank ``r`` holds
stages ``r`` and ``2p - 1 - r``, so a micro-batch's forward goes down the ranks and back
up, and rank 0 holds both the first stage and the loss. Stages ``p - 1`` and ``p`` share
rank ``p - 1``: their hand-over stays on the rank (the executor passes it locally).
The backward is split into ``B`` and ``W`` as in ZB-H1/H2 (:mod:`.zero_bubble`).

Each rank's order is the one the paper lays out (torch's ``ScheduleZBVZeroBubble`` runs
the same): rank ``r`` first forwards ``2(p - r) - 1`` micro-batches on its first chunk, then
``r`` pairs of forwards (second chunk, first chunk), then ``p - r`` rounds of ``F B W`` on its
second chunk; the steady state alternates ``F B W`` on the first chunk and on the second,
``W`` straight after its ``B``; the cool-down finishes the ``B`` passes and then the ``W``
passes. On the first stage ``B`` does nothing and ``W`` runs the whole backward (nobody
waits for that stage's input gradients; see :meth:`trainwright.pipeline.stage.Stage.backward`).

[Note: why not a dry run] An earlier order came from a list-scheduling dry run under unit
costs. On the pipeline bench (2 ranks, 8 micro-batches) it left each rank idle 6-10 % of the
step (a ``B`` costs more than an ``F`` or a ``W``, and every hand-over has latency, which
unit costs do not see); the paper's order, with ``W`` right after ``B``, keeps slack in the
loop between the ranks and idled 3-5 %.
"""

from __future__ import annotations

from trainwright.errors import PlanError
from trainwright.schedule.base import Action, ActionKind, _lower

__all__ = ["zb_v", "v_rank_of"]


def v_rank_of(stage: int, n_ranks: int) -> int:
    """The rank holding virtual stage ``stage`` in the V placement."""
    return stage if stage < n_ranks else 2 * n_ranks - 1 - stage


def _order(p: int, m: int) -> list[list[tuple[ActionKind, int, int]]]:
    """Every rank's compute order ``(kind, stage, mb)`` as the ZB-V paper lays it out."""
    n_micro = max(2 * p - 1, m)  # enough micro-batches to fill the V; extra ones dropped
    return [[o for o in _rank_order(r, p, n_micro) if o[2] < m] for r in range(p)]


def _rank_order(r: int, p: int, n_micro: int) -> list[tuple[ActionKind, int, int]]:
    c0, c1 = r, 2 * p - 1 - r
    ops: list[tuple[ActionKind, int, int]] = []
    f = {c0: 0, c1: 0}  # forwards issued per chunk
    b = {c0: 0, c1: 0}  # B passes issued per chunk

    def fwd(s: int) -> None:
        ops.append((ActionKind.F, s, f[s]))
        f[s] += 1

    def bwd(s: int, w: bool) -> None:
        ops.append((ActionKind.B, s, b[s]))
        if w:
            ops.append((ActionKind.W, s, b[s]))
        b[s] += 1

    for _ in range(2 * (p - r) - 1):
        fwd(c0)
    for _ in range(r):
        fwd(c1)
        fwd(c0)
    for _ in range(p - r):
        fwd(c1)
        bwd(c1, w=True)
    while f[c1] < f[c0] or f[c0] < n_micro:
        if f[c0] < n_micro:
            fwd(c0)
        bwd(c0, w=True)
        fwd(c1)
        bwd(c1, w=True)
    w0, w1 = b[c0], b[c1]  # the W passes still to do start here
    for _ in range(r):
        bwd(c0, w=False)
        bwd(c1, w=False)
    for _ in range(p - r):
        bwd(c0, w=False)
        ops.append((ActionKind.W, c0, w0))
        w0 += 1
    ops += [(ActionKind.W, c1, i) for i in range(w1, b[c1])]
    ops += [(ActionKind.W, c0, i) for i in range(w0, b[c0])]
    return ops


def zb_v(n_ranks: int, n_micro: int, virtual_stages: int = 2) -> list[list[Action]]:
    """ZB-V: two chunks per rank in a V, split backward; one action list per **rank**.

    Args:
        n_ranks: pipeline ranks ``p`` (the model has ``2p`` stages).
        n_micro: micro-batches per step.
        virtual_stages: must be 2 (the V has two legs).
    """
    if n_ranks < 1 or n_micro < 1:
        raise PlanError(f"need at least 1 stage and 1 micro-batch, got {n_ranks} and {n_micro}")
    if virtual_stages != 2:
        raise PlanError(f"ZB-V places exactly 2 chunks per rank (parallel.virtual_stages = 2),"
                        f" got {virtual_stages}")
    order = _order(n_ranks, n_micro)
    return [_lower(order[r], 2 * n_ranks, r) for r in range(n_ranks)]
