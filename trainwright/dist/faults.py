"""Fault injection for tests: a process kills (or freezes) itself at one configured point.

This is the one place that acts on the test-only settings: the ``[fault]`` section (a
pipeline rank dies in ``kill_step``, before the first action of ``kill_before`` or halfway
through its action list) and ``tokenring.kill_nodes`` / ``kill_step`` / ``kill_signal``
(ring nodes die after computing their gradient). Production code holds a
:class:`FaultPoint` or None and calls :meth:`FaultPoint.check` where the fault may strike;
with no fault configured it holds None and nothing here runs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FaultPoint", "pipeline_fault", "save_fault", "ring_fault", "SAVE"]

SAVE = "SAVE"
"""``fault.kill_before = "SAVE"``: die in ``kill_step``'s checkpoint save instead."""


@dataclass(frozen=True)
class FaultPoint:
    """Sends this process ``signum`` in step ``step`` where ``here(where)`` holds."""

    step: int
    here: Callable[[object], bool]
    signum: int = signal.SIGKILL

    def check(self, step: int, where: object = None) -> None:
        """Strike if this is the configured step and place."""
        if step == self.step and self.here(where):
            os.kill(os.getpid(), self.signum)


def pipeline_fault(fault, rank: int | None, actions: list) -> FaultPoint | None:
    """The ``[fault]`` section's point for pipeline rank ``rank`` running ``actions``: in
    ``kill_step``, before the first action of kind ``kill_before`` when given, else before
    the action halfway through the list. ``where`` is ``(index, action)``."""
    if rank is None or fault.kill_rank != rank or fault.kill_before == SAVE:
        return None
    kind, half = fault.kill_before, len(actions) // 2
    if kind:
        return FaultPoint(fault.kill_step, lambda at: at[1].kind == kind)
    return FaultPoint(fault.kill_step, lambda at: at[0] == half)


def save_fault(fault, rank: int | None) -> FaultPoint | None:
    """With ``kill_before = "SAVE"``: rank ``kill_rank`` dies in the checkpoint save of
    ``kill_step`` once its files are written, before the checkpoint is completed (a run
    killed mid-save)."""
    if rank is None or fault.kill_rank != rank or fault.kill_before != SAVE:
        return None
    return FaultPoint(fault.kill_step, lambda at: True)


def ring_fault(ring, index: int, restarted: bool) -> FaultPoint | None:
    """The ``tokenring.kill_*`` point for node ``index``: after computing its gradient in
    ``kill_step``. A node restarted after such a kill is not killed again."""
    if restarted or index not in ring.kill_nodes:
        return None
    return FaultPoint(ring.kill_step, lambda at: True, getattr(signal, ring.kill_signal))
