"""The action type every schedule is made of, and the lowering of compute orders to actions."""

from __future__ import annotations

from dataclasses import dataclass

from trainwright.errors import PlanError

__all__ = ["Action", "COMPUTE", "KINDS"]

COMPUTE = ("F", "B", "W")
KINDS = ("F", "B", "W", "RECV_F", "SEND_F", "RECV_B", "SEND_B", "SYNC", "STEP")


@dataclass(frozen=True)
class Action:
    """One thing a stage does: ``kind`` on micro-batch ``mb`` (``-1`` for SYNC/STEP)."""

    stage: int
    kind: str
    mb: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}" + ("" if self.mb < 0 else str(self.mb))


def _with_comm(stage: int, n_stages: int, compute: list[tuple[str, int]]) -> list[Action]:
    """Lower compute-only ``(kind, mb)`` pairs to actions with explicit send/recv."""
    out: list[Action] = []
    first, last = stage == 0, stage == n_stages - 1
    for kind, mb in compute:
        if kind == "F":
            if not first:
                out.append(Action(stage, "RECV_F", mb))
            out.append(Action(stage, "F", mb))
            if not last:
                out.append(Action(stage, "SEND_F", mb))
        elif kind == "W":
            out.append(Action(stage, "W", mb))
        else:
            if not last:
                out.append(Action(stage, "RECV_B", mb))
            out.append(Action(stage, "B", mb))
            if not first:
                out.append(Action(stage, "SEND_B", mb))
    out += [Action(stage, "SYNC"), Action(stage, "STEP")]
    return out


def _check(n_stages: int, n_micro: int) -> None:
    if n_stages < 1 or n_micro < 1:
        raise PlanError(f"need at least 1 stage and 1 micro-batch, got {n_stages} and {n_micro}")
