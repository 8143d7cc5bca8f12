"""A model of scale: one step's time and the busiest node's bytes, token ring vs DDP.

Every message over a link costs ``alpha + bytes / beta`` (the alpha-beta model; a node's
sends share its link, so what one node sends in a burst costs ``alpha + total / beta``).
Compute is ``compute_s`` per node per step, a straggler's ``slow_factor`` times that; the
exchange starts when gradients are ready (no overlap with backward, for both systems).

* **DDP** (ring all-reduce, as gloo and NCCL do it): every rank waits for the slowest, then
  ``2 (n - 1)`` steps of ``G / n`` bytes each. Busiest node: ``2 (n - 1) / n`` G sent.
* **Token ring, as built** (:mod:`~trainwright.tokenring.ring`): the running sum visits
  the ready nodes one after another, each hop one whole sum (``G``) to the next holder
  plus the token header to every other member; a ready node is never cut off, the
  adaptive grace after the on-time nodes is about their spread (0 here), so with one
  straggler the step closes after the ``n - 1`` others; then the closed sum's pass,
  pipelined in ``chunk_bytes`` chunks: ``G / beta + (n - 1)(alpha + chunk / beta)``.
  Busiest node: the sum once, the pass once, plus its headers: each holder sends the
  header (``header_bytes(n)``, measured from the real header's JSON) to ``n - 1``
  members, and each node receives one per hop.
* **Token ring, pipelined sum** (not built; the way on): the running sum travels in
  chunks too, so the accumulation costs ``G / beta + (n - 1)(alpha + chunk / beta)``
  instead of ``(n - 1) G / beta``. Same bytes as built.

Pure arithmetic: numbers in, numbers out (:func:`simulate`, :func:`table`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["ScaleModel", "header_bytes", "simulate", "table", "SYSTEMS"]

SYSTEMS = ("torch_ddp", "tokenring", "tokenring_pipelined_sum")


def header_bytes(n: int, close_window: int = 32) -> int:
    """Bytes of a token header at ``n`` members: the JSON the ring sends (epoch with every
    member's address, ``close_window`` recent closes listing about ``n`` contributors)."""
    members = {str(i): f"tcp://10.0.{i // 256}.{i % 256}:45{i % 1000:03d}" for i in range(n)}
    closes = {str(1000 + s): list(range(n)) for s in range(close_window)}
    h = {"t": "tok", "ep": {"key": [3, 1], "members": members}, "step": 1032,
         "contribs": list(range(n // 2)), "holder": 7, "hop": 123456, "idle": 0,
         "closes": closes, "retx": False, "src": 6, "inc": 2 ** 47, "sq": 99999,
         "shapes": [], "dtypes": []}
    return len(json.dumps(h).encode())


@dataclass
class ScaleModel:
    """Sizes and link costs (defaults: the straggler bench's model on a 10 GbE cluster)."""

    grad_bytes: float = 301_066 * 4
    """One gradient: the bench's MLP (64 -> 512 -> 512 -> 10), fp32."""
    compute_s: float = 0.2
    """Forward + backward per node (the bench's ``pace_s``)."""
    slow_factor: float = 3.0
    alpha_s: float = 50e-6
    beta: float = 1.25e9
    """Link bandwidth, bytes/s (10 Gb/s)."""
    chunk_bytes: float = 256 * 1024
    want_bytes: float = 120
    """The readiness notice each node sends every member once a step."""

    def send(self, nbytes: float) -> float:
        """Seconds for one burst of ``nbytes`` from one node."""
        return self.alpha_s + nbytes / self.beta


def simulate(m: ScaleModel, n: int, straggler: bool) -> dict[str, dict]:
    """Step time (s) and the busiest node's bytes per step over the gradient, per system.

    Args:
        m: the model.
        n: nodes.
        straggler: one node ``slow_factor`` x slower.
    """
    G, h = m.grad_bytes, header_bytes(n)
    slowest = m.compute_s * (m.slow_factor if straggler else 1.0)
    ddp_comm = 2 * (n - 1) * m.send(G / n)
    out = {"torch_ddp": {"step_s": slowest + ddp_comm,
                         "busiest_bytes_over_grad": 2 * (n - 1) / n}}
    adders = n - 1 if straggler else n
    hop = m.send(G + (n - 1) * h)  # the sum to the next holder, the header to the others
    chain = m.send(m.chunk_bytes)
    pass_s = m.send((n - 1) * h) + G / m.beta + (n - 1) * chain
    built = m.compute_s + (adders - 1) * hop + pass_s
    piped = m.compute_s + G / m.beta + (adders - 1) * (chain + m.send((n - 1) * h)) + pass_s
    sent = 2 * G + (n - 1) * h + (n - 1) * m.want_bytes
    received = 2 * G + n * h + (n - 1) * m.want_bytes
    busiest = max(sent, received) / G
    out["tokenring"] = {"step_s": built, "busiest_bytes_over_grad": busiest}
    out["tokenring_pipelined_sum"] = {"step_s": piped, "busiest_bytes_over_grad": busiest}
    return out


def table(m: ScaleModel, sizes: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """One row per (nodes, straggler): every system's step time and busiest bytes."""
    rows = []
    for n in sizes:
        for straggler in (False, True):
            sim = simulate(m, n, straggler)
            rows.append({"nodes": n, "straggler": straggler, "header_bytes": header_bytes(n),
                         **{f"{k}_step_s": round(v["step_s"], 4) for k, v in sim.items()},
                         **{f"{k}_busiest_bytes_over_grad": round(v["busiest_bytes_over_grad"],
                                                                  3)
                            for k, v in sim.items()}})
    return rows
