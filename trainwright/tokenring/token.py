"""The token ring's data: the token, the protocol's time-outs, the closing rule, the sum.

Shared by :mod:`~trainwright.tokenring.ring` (the protocol) and the trainer side
(:mod:`~trainwright.tokenring.exchange`, :mod:`~trainwright.run.ring_node`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainwright.errors import CommError

__all__ = ["RingLeft", "RingFailed", "RingTimes", "contributors_needed", "sum_canonical",
           "Token"]


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
