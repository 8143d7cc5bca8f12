"""The token ring's data: the token and its messages, the protocol's time-outs, the closing
rule, the sum.

Shared by :mod:`~trainwright.tokenring.ring` (the protocol) and the trainer side
(:mod:`~trainwright.tokenring.exchange`, :mod:`~trainwright.run.ring_node`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainwright.errors import CommError
from trainwright.tokenring.membership import Epoch

__all__ = ["RingLeft", "RingFailed", "RingTimes", "contributors_needed", "sum_canonical",
           "Token", "token_header", "CLOSE_WINDOW", "TICK_CLOSES"]

CLOSE_WINDOW = 32
"""Closes carried to the next holder with every token (and in a relay after silence)."""
TICK_CLOSES = 2
"""Closes carried in the token's notice to the other members: those of the steps after
``step - TICK_CLOSES`` (``step`` the open one), i.e. the last close, so every member learns
each close from the hops of the step after it. Messages between live nodes are never lost
(ZeroMQ queues them; per-link sequence numbers say so), so a short window suffices; it
bounds the notice's size as the ring grows (each close lists up to every member)."""


class RingLeft(CommError):
    """This node was dropped from the ring (or saw a conflicting close) and must go standby."""


class RingFailed(CommError):
    """The ring cannot go on: fewer than ``min_nodes`` remain, or a closed step's sum
    was lost with the nodes that held it."""


@dataclass
class RingTimes:
    """Time-outs of the protocol (seconds); see :class:`~trainwright.config.TokenRingConfig`."""

    token_timeout_s: float = 2.0
    succession_s: float = 1.0
    idle_hold_s: float = 0.02
    close_timeout_s: float = 120.0
    fetch_after_s: float = 0.3
    close_grace_s: float = 0.0


def contributors_needed(close_fraction: float, members: int) -> int:
    """Contributions (equal shards) a step needs to close: ``ceil(fraction * members)``."""
    return max(1, math.ceil(close_fraction * members - 1e-9))


def sum_canonical(grads: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
    """Sum per-node gradient lists in node-index order (same float order on every node)."""
    order = sorted(grads)
    acc = [g.clone() for g in grads[order[0]]]
    for i in order[1:]:
        for a, g in zip(acc, grads[i], strict=True):
            a.add_(g)
    return acc


@dataclass
class Token:
    """The token: open step, contributions taken in it, next holder, hop count, and hops
    since the last news (a full idle round lets a holder keep it briefly)."""

    step: int
    contribs: list[int]
    holder: int
    hop: int
    idle: int = 0


def token_header(tok: Token, epoch: Epoch, closes: dict[int, list[int]], *, to_holder: bool,
                 retx: bool = False) -> dict:
    """The header of one token message.

    The next holder (``to_holder``) gets the whole token: the membership and the last
    ``CLOSE_WINDOW`` closes. Every other member gets a notice of the same hop (so each
    knows the holder, and when the ring went quiet) that stays small as the ring grows:
    the last close (:data:`TICK_CLOSES`), and the membership only during the
    epoch's first ``2 n`` hops (the hop count restarts with each epoch), its key after
    that. A relay after silence (``retx``) is whole.
    """
    whole = to_holder or retx
    window = CLOSE_WINDOW if whole else TICK_CLOSES
    ep = (epoch.to_json() if whole or tok.hop < 2 * len(epoch.members)
          else {"key": list(epoch.key)})
    return {"t": "tok", "ep": ep, "step": tok.step, "contribs": tok.contribs,
            "holder": tok.holder, "hop": tok.hop, "idle": tok.idle,
            "closes": {str(s): c for s, c in closes.items() if s > tok.step - window},
            "retx": retx}
