"""What each model chunk of a rank holds over a step, walked from the rank's action list.

With several chunks per rank (interleaved 1F1B, ZB-V) a chunk's layers hold activations
only for *its own* micro-batches, so one in-flight count per rank overstates the memory
of every chunk. :func:`chunk_states` walks a rank's list and records, at every point
where a peak can occur, how many micro-batches each chunk holds (forwarded, not yet
released: released at ``B``, or at ``W`` under a split backward) and how many of those
wait between ``B`` and ``W``. Pure: no torch.
"""

from __future__ import annotations

from trainwright.schedule.base import COMPUTE, Action, ActionKind

__all__ = ["chunk_states"]


def chunk_states(actions: list[Action]) -> list[dict[int, tuple[int, int]]]:
    """Every maximal state of a rank's chunks over one step.

    Args:
        actions: one rank's action list (``Action.stage`` names the chunk).

    Returns:
        States ``{chunk: (held, waiting_w)}``, none dominated by another (each count at
        most the other's): a memory peak is the maximum over these states of
        ``sum(held * bytes held per micro-batch + waiting_w * bytes brought back for W)``.
    """
    split = any(a.kind == ActionKind.W for a in actions)
    chunks = sorted({a.stage for a in actions if a.kind in COMPUTE})
    held = dict.fromkeys(chunks, 0)
    waiting = dict.fromkeys(chunks, 0)
    seen: list[dict[int, tuple[int, int]]] = []
    for a in actions:
        if a.kind == ActionKind.F:
            held[a.stage] += 1
        elif a.kind == ActionKind.B:
            if split:
                waiting[a.stage] += 1  # its non-kept tensors come back now, stay until W
            else:
                seen.append({c: (held[c], waiting[c]) for c in chunks})  # during B
                held[a.stage] -= 1
                continue
        elif a.kind == ActionKind.W:
            seen.append({c: (held[c], waiting[c]) for c in chunks})  # during W
            held[a.stage] -= 1
            waiting[a.stage] -= 1
            continue
        else:
            continue
        seen.append({c: (held[c], waiting[c]) for c in chunks})
    return _maximal(seen)


def _maximal(states: list[dict[int, tuple[int, int]]]) -> list[dict[int, tuple[int, int]]]:
    """The states no other state dominates (duplicates once), in first-seen order."""
    unique: dict[tuple, dict[int, tuple[int, int]]] = {}
    for st in states:
        unique.setdefault(tuple(x for c in sorted(st) for x in st[c]), st)
    vecs = list(unique)
    return [unique[v] for v in vecs
            if not any(w != v and all(a <= b for a, b in zip(v, w, strict=True))
                       for w in vecs)]

