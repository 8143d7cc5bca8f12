"""Carrying a rank's last weight-gradient passes into the next step's start-up wait.

Every step of a pipeline opens with a wait: the rank holding stage ``r`` first (ZB-V: rank
``r``) idles until the ``r`` stages before it have run their first forward. A zero-bubble
schedule ends the same rank's step with weight-gradient passes (``W``) that nothing waits
for but the rank's own optimizer step. Carrying the last of them, with the rank's ``SYNC``
and ``STEP``, to the start of the next step fills that wait:

* the numbers do not change: a carried ``W`` reads what its step's ``B`` left, the
  optimizer step still follows every ``W`` of its step, and the next step's first forward
  on the rank follows the optimizer step;
* the rank's share of a step ends up to ``r`` weight passes sooner. In steady state every
  step still runs ``m`` micro-batches' ``F``, ``B`` and ``W`` and one optimizer step per
  rank; only which step's clock a carried pass falls in changes.

The trainer carries only between two steps of :meth:`Trainer.fit` that nothing inspects in
between (see ``train.carry_weight_grads``); :func:`steady_state` gives the lists a step
then runs, for the simulator.
"""

from __future__ import annotations

from trainwright.schedule.base import Action, ActionKind

__all__ = ["carried", "steady_state", "simulated_lists"]


def carried(actions: list[Action]) -> int:
    """How many actions at the end of a rank's list may move into the next step.

    They are its trailing ``W`` passes, at most as many as the stages whose forward it
    waits for at the start of a step (the lowest stage it runs a forward of), followed by
    its ``SYNC`` and ``STEP``. 0 when no ``W`` would move (stage 0, or a list that does not
    end in ``W, SYNC, STEP``).
    """
    forwards = [a.stage for a in actions if a.kind == ActionKind.F]
    end = [a.kind for a in actions[-2:]]
    if len(actions) < 3 or not forwards or end != [ActionKind.SYNC, ActionKind.STEP]:
        return 0
    cap, n, i = min(forwards), 0, len(actions) - 2
    while n < cap and i > 0 and actions[i - 1].kind == ActionKind.W:
        n, i = n + 1, i - 1
    return n + 2 if n else 0


def steady_state(lists: list[list[Action]]) -> list[list[Action]]:
    """Each rank's step when every step carries: the actions the previous step carried
    first, then the rest of its own list."""
    out = []
    for actions in lists:
        n = carried(actions)
        out.append(actions[len(actions) - n:] + actions[:len(actions) - n] if n else actions)
    return out


def simulated_lists(schedule: str, lists: list[list[Action]], carry: bool = True
                    ) -> list[list[Action]]:
    """The lists a simulator should replay for ``schedule``: the steady step where the
    executor carries (ZB-V with ``train.carry_weight_grads``), else ``lists`` as built."""
    return steady_state(lists) if schedule == "zb-v" and carry else lists
