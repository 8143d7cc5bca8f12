"""A model of scale: one step's time and the busiest node's bytes, token ring vs DDP.

Every message over a link costs ``alpha + bytes / beta`` (the alpha-beta model; a node's
sends share its link, so what one node sends in a burst costs ``alpha + total / beta``).
Compute is ``compute_s`` per node per step, a straggler's ``slow_factor`` times that; the
exchange starts when gradients are ready (no overlap with backward, for both systems).

* **DDP** (ring all-reduce, as gloo and NCCL do it): every rank waits for the slowest, then
  ``2 (n - 1)`` steps of ``G / n`` bytes each. Busiest node: ``2 (n - 1) / n`` G sent.
* **Token ring, as built** (:mod:`~trainwright.tokenring.ring`): the running sum visits
  the ready nodes one after another, each hop one whole sum (``G``) and the whole token
  to the next holder, the token's notice to every other member; a ready node is never cut off, the
  adaptive grace after the on-time nodes is about their spread (0 here), so with one
  straggler the step closes after the ``n - 1`` others; then the closed sum's pass,
  pipelined in ``chunk_bytes`` chunks: ``G / beta + (n - 1)(alpha + chunk / beta)``, or,
  for a sum of at most ``floor((n - 1) / 2)`` chunks, both ways round (the ring's
  :func:`~trainwright.tokenring.sumpass.pass_routes`): ``2 G / beta + ceil((n - 1) / 2)
  (alpha + chunk / beta)``.
  Busiest node: the sum once, the pass once, plus its headers: each holder sends the
  whole token to the next holder and the notice to ``n - 2`` members, and each node
  receives one message per hop (:func:`message_bytes`: the ring's own headers, as
  :func:`~trainwright.tokenring.token.token_header` builds and
  :func:`~trainwright.tokenring.wire.pack` encodes them, in an epoch past its first
  ``2 n`` hops).
* **Token ring, pipelined sum** (not built; the way on): the running sum travels in
  chunks too, so the accumulation costs ``G / beta + (n - 1)(alpha + chunk / beta)``
  instead of ``(n - 1) G / beta``. Same bytes as built.

Not counted: the chunks' headers of the sum's pass (one per 256 KiB chunk, about 0.1 % of
it) and, once per epoch, the membership in the first ``2 n`` hops' notices.

Pure arithmetic: numbers in, numbers out (:func:`simulate`, :func:`table`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainwright.tokenring.membership import Epoch
from trainwright.tokenring.sumpass import pass_routes
from trainwright.tokenring.token import CLOSE_WINDOW, Token, token_header
from trainwright.tokenring.wire import pack

__all__ = ["ScaleModel", "message_bytes", "simulate", "table", "SYSTEMS"]

SYSTEMS = ("torch_ddp", "tokenring", "tokenring_pipelined_sum")


def message_bytes(n: int) -> tuple[int, int]:
    """Header bytes of one hop's token messages at ``n`` members: (the whole token to the
    next holder, the notice to each other member). Built by the ring's own
    :func:`~trainwright.tokenring.token.token_header` and encoded by
    :func:`~trainwright.tokenring.wire.pack` (with the link's source, incarnation and
    sequence fields), mid-run: half the members in the open step, every member in each of
    the last ``CLOSE_WINDOW`` closes, the epoch past its first ``2 n`` hops."""
    epoch = Epoch((3, 1), {i: f"tcp://10.0.{i // 256}.{i % 256}:45{i % 1000:03d}"
                           for i in range(n)})
    step = 1032
    tok = Token(step, list(range(n // 2)), holder=7, hop=2 * n + 5)
    closes = {s: list(range(n)) for s in range(step - CLOSE_WINDOW, step)}
    link = {"src": 6, "inc": 2 ** 47, "sq": 99999}

    def size(to_holder: bool) -> int:
        return len(pack({**token_header(tok, epoch, closes, to_holder=to_holder), **link},
                        [])[0])
    return size(True), size(False)


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
    G, (whole, notice) = m.grad_bytes, message_bytes(n)
    slowest = m.compute_s * (m.slow_factor if straggler else 1.0)
    ddp_comm = 2 * (n - 1) * m.send(G / n)
    out = {"torch_ddp": {"step_s": slowest + ddp_comm,
                         "busiest_bytes_over_grad": 2 * (n - 1) / n}}
    adders = n - 1 if straggler else n
    headers = whole + (n - 2) * notice  # one hop's: the token to the next, notices to the rest
    hop = m.send(G + headers)  # ... and the sum to the next holder
    chain = m.send(m.chunk_bytes)
    routes = len(pass_routes(list(range(n)), 0, math.ceil(G / m.chunk_bytes)))
    hops = math.ceil((n - 1) / 2) if routes == 2 else n - 1
    pass_s = m.send(headers) + routes * G / m.beta + hops * chain
    built = m.compute_s + (adders - 1) * hop + pass_s
    piped = m.compute_s + G / m.beta + (adders - 1) * (chain + m.send(headers)) + pass_s
    sent = 2 * G + headers + (n - 1) * m.want_bytes
    received = 2 * G + whole + (n - 1) * notice + (n - 1) * m.want_bytes
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
            whole, notice = message_bytes(n)
            rows.append({"nodes": n, "straggler": straggler, "token_bytes": whole,
                         "notice_bytes": notice,
                         **{f"{k}_step_s": round(v["step_s"], 4) for k, v in sim.items()},
                         **{f"{k}_busiest_bytes_over_grad": round(v["busiest_bytes_over_grad"],
                                                                  3)
                            for k, v in sim.items()}})
    return rows
