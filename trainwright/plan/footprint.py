"""The footprint model: every byte a pipeline rank holds, at every moment of its schedule.

One model for every planner (``memory.limit`` planning, ``trainwright plan``, the simulator,
the peer-swap planner; per chunk under interleaved schedules). Pure: numbers in, bytes out.

Terms, per rank (all measured once by the profile, none a constant tuned to a model):

* **static** — ``weights`` (parameter bytes of the rank's layers), ``gradients`` (the
  same bytes again) and ``optimizer`` state (:data:`OPTIMIZER_STATE` parameter-sized
  buffers per optimizer; divided by ``shards`` when the update is sharded, as under
  ``sync.strategy = "hierarchical"``). Present all step long.
* **activations** — walked action by action over the rank's schedule
  (:func:`walk`), so the worst moment is the schedule's own, not a formula's:

  - ``F`` of a layer: while it runs, ``work`` bytes more than before it (its forward's
    transient working set: every storage it creates, freed or not, at its highest;
    ``work_nograd`` for a recomputed layer, whose first forward runs without a graph); after
    it, ``kept`` bytes stay (keep: what autograd saved plus its output; recompute and
    swap: its output only, the input being the previous layer's output, already held);
    swap also moves ``saved`` bytes to the host copy, and where the profile ran the layer
    swapped, its working set and what stays are those measured (``work_swap``,
    ``kept_swap``: the store moves each saved tensor out as it is saved);
  - receive buffers (``RECV_F``: the chunk's input; ``RECV_B``: the gradient of its output,
    ``output_bytes`` of its last layer): under the interleaved runtime each exists one
    receive of its stream early (posted ahead, :func:`arrivals`), under the single-chunk
    runtime from its ``RECV``; the input is held by its segment, the gradient until its
    backward is done. A sent output (``SEND_F``) and a sent input gradient (``SEND_B``:
    ``input_bytes`` of the chunk's first layer) outlive their use until ``SYNC``, where
    the runtime waits for its sends (a sent output outlives its micro-batch's ``W`` too);
    every send also holds its header (:data:`SEND_HEADER_BYTES`) until then, and every
    receive its own while the payload arrives (from its post, when posted ahead); a
    hand-over between two chunks of the rank (ZB-V's turn) is the tensor itself: no
    buffer, no header, no pending send;
  - ``B`` of a layer: a recomputed layer runs its forward again (``work`` on top, then its
    ``kept`` under keep stays until the layer's backward is done, or until ``W`` when the
    backward is split); a swapped layer's host copy is read back in place on a CPU (no
    new device bytes) and copied back (``saved`` bytes) on an accelerator, where the next
    swapped layer down is already coming back (prefetched) while it computes;
  - ``B`` under a split backward (a zero-bubble schedule, any chunk but the model's
    first): what the weight side keeps for ``W`` stays (``w_held``: a deferred linear's
    input; with ``w_keeps_input`` the layer below's output too); the rest of what the
    forward kept, or a recompute brought back, is freed (where ``w_held`` was measured);
  - ``W`` (split backward): the segments and what was brought back are released.
  Gradients and backward intermediates are not activations for the live meter (it does
  not count them; the ``gradients`` static term holds the accumulated ones). The CUDA
  allocator holds them, though: where the profile measured a layer's ``back_work`` by
  the allocator (on a GPU), its ``B`` also sees that, plus the gradient arriving from
  the layer above (a received one is already a buffer).
* **data** — the step's batch, all step: every micro-batch's inputs on the rank of the
  model's first stage (``input_bytes`` of its first layer each; a micro-batch's input is a
  view of them), and every micro-batch's loss targets (``target_bytes`` each) on the rank
  that computes the loss, with every micro-batch's loss value (its ``output_bytes``, a
  scalar the runtime keeps for the step's report; counted from the step's start, a few
  bytes early) (metered: the batch tensors, read before the step's first action).
* **host** — swap copies held on the host, walked the same way (on a CPU host they live in
  the same RAM; the meter tells them apart by where they were allocated).

:func:`walk` returns the peaks; :func:`stage_footprint` adds the static terms; the planners
are held to the walk by :func:`trainwright.plan.fit.fit_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwright.schedule.base import ActionKind

__all__ = ["OPTIMIZER_STATE", "LayerTerms", "Footprint", "static_bytes", "walk",
           "stage_footprint", "arrivals"]

SEND_HEADER_BYTES = 520
"""Bytes of the metadata header every point-to-point send carries (65 int64,
:data:`trainwright.dist.comm.HEADER_LEN`), held with its payload until the step's ``SYNC``
waits for the sends."""

OPTIMIZER_STATE = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
"""Parameter-sized state buffers per optimizer (Adam: first and second moments)."""


@dataclass(frozen=True)
class LayerTerms:
    """One layer's measured bytes per micro-batch (the profile's meter, see module).

    ``work``: highest bytes its forward had alive at once that it created (input excluded);
    ``kept``: what stays alive after its forward under keep (saved for backward plus output);
    ``saved``: what a policy can move (saved for backward, input and output excluded: the
    store's ``saved_bytes``); ``output_bytes``: its output; ``input_bytes``: its input (held by
    its segment under every policy: the previous layer's output, or the received tensor).
    """

    layer: int
    work: int
    kept: int
    saved: int
    output_bytes: int
    input_bytes: int
    param_bytes: int = 0
    chunk: int = 0
    work_nograd: int = -1
    """``work`` of its forward without a graph (how a recomputed layer's first forward runs:
    intermediates are freed as soon as used); -1: not measured, ``work`` is used."""
    back_work: int = -1
    """Highest bytes its backward allocated above what was allocated when it began, by the
    CUDA allocator (gradients of its activations and input, kernel workspaces); -1: not
    measured (a CPU profile, whose meter does not count gradients): not walked."""
    work_swap: int = -1
    """``work`` of its forward when its saved tensors are swapped to the host (the store
    moves each out as it is saved, so fewer stay on the device while it runs); -1: not
    measured, ``work`` is used."""
    kept_swap: int = -1
    """What stays on the device after that forward (its output, and saved tensors the store
    does not move: those sharing its input's storage); -1: not measured, the output."""
    w_held: int = -1
    """Bytes its forward created that are still alive between its ``B`` and its ``W`` under
    a split backward (what the weight side keeps: a deferred linear's input; input and
    output excluded); -1: not measured, ``kept`` stays until ``W``."""
    w_keeps_input: bool = False
    """Whether its ``B`` leaves its input alive for ``W`` (a linear on its input stashes it):
    then the layer below keeps its output until ``W``."""
    target_bytes: int = 0
    """One micro-batch's loss targets, on the layer that computes the loss (the model's
    last; 0 elsewhere). The stage holds the step's targets, every micro-batch's, all step:
    the runtime reads them before the step's first action."""

    def forward_work(self, policy: str) -> int:
        """The forward's working set under ``policy`` (recompute runs it without a graph,
        swap moves saved tensors out as they are saved)."""
        if policy == "recompute" and self.work_nograd >= 0:
            return self.work_nograd
        return self.work_swap if policy == "swap" and self.work_swap >= 0 else self.work

    def held(self, policy: str) -> int:
        """Device bytes its forward leaves behind under ``policy`` (input not included)."""
        if policy == "keep":
            return self.kept
        return self.kept_swap if policy == "swap" and self.kept_swap >= 0 else self.output_bytes


@dataclass
class Footprint:
    """A rank's predicted bytes: static terms, the activation walk's peaks, and totals."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    """Device-resident activation peak over the step (what the live meter measures)."""
    host: int
    """Host-swap copies at their peak (the meter's host bytes)."""
    moment: str = ""
    """The action at which the activation peak happens, e.g. ``"1F3 layer 5"``."""
    terms: dict = field(default_factory=dict)

    @property
    def static(self) -> int:
        """Weights, gradients and optimizer state."""
        return self.weights + self.gradients + self.optimizer

    @property
    def device(self) -> int:
        """Everything on the device at the worst moment (static + activations)."""
        return self.static + self.activations


def static_bytes(param_bytes: int, optimizer: str, momentum: float = 0.0,
                 shards: int = 1) -> tuple[int, int, int]:
    """``(weights, gradients, optimizer state)`` of ``param_bytes`` of parameters.

    Raises:
        ValueError: an unknown optimizer or ``shards < 1``.
    """
    key = "sgd_momentum" if optimizer == "sgd" and momentum > 0 else optimizer
    if key not in OPTIMIZER_STATE or shards < 1:
        raise ValueError(f"need optimizer in {sorted(OPTIMIZER_STATE)} and shards >= 1; got "
                         f"{optimizer!r}, shards={shards}")
    return param_bytes, param_bytes, OPTIMIZER_STATE[key] * param_bytes // shards


def arrivals(actions: list) -> dict[int, list]:
    """When each receive buffer comes into being on a rank whose receives are posted ahead.

    The runtime's point-to-point layer (:mod:`trainwright.dist.comm`, [Note: receives posted
    ahead]) posts a stream's next receive when the one before it returns, into buffers
    shaped like its message: each buffer exists from the previous ``RECV`` of its stream
    (the first from its own) and, like a received one, lives until what uses it is done
    (:func:`walk`). Metered (the live meter's allocations at the peak, by action): ZB-V
    pp 4 x 8, rank 0 held 2 of its last chunk's 8 received inputs and none of its first
    chunk's gradients it had used; the walk had kept every buffer of a stream from its
    first ``RECV`` until ``SYNC`` (+59 % on that rank).

    Args:
        actions: the rank's actions.

    Returns:
        Action position -> the ``RECV_F``/``RECV_B`` actions whose buffer exists from just
        before that position.
    """
    last: dict[tuple, int] = {}
    out: dict[int, list] = {}
    for i, a in enumerate(actions):
        if a.kind in ("RECV_F", "RECV_B"):
            stream = (a.kind, a.stage)
            out.setdefault(last.get(stream, i), []).append(a)
            last[stream] = i
    return out


_OTHER_END = {ActionKind.SEND_F: 1, ActionKind.RECV_F: -1, ActionKind.SEND_B: -1,
              ActionKind.RECV_B: 1}
"""Transfer kind -> the other end's chunk, relative to the action's."""


def walk(layers: list[LayerTerms], policies: dict[int, str], actions: list,
         copy_back: bool = False, arrive: dict[int, list] | None = None,
         send_header: int = SEND_HEADER_BYTES) -> tuple[int, int, str]:
    """Device and host activation peaks of one rank over its schedule.

    Args:
        layers: the rank's layers in model order (``chunk`` = the model stage of each).
        policies: layer -> ``"keep"``, ``"swap"`` or ``"recompute"`` (missing: keep).
        actions: the rank's actions (:class:`~trainwright.schedule.base.Action`: ``stage``
            is the chunk, ``kind.value`` one of ``F, B, W, RECV_B, ...``, ``mb``).
            The model's first stage is the chunk that receives no input (no ``RECV_F``):
            under a split backward its ``B`` is deferred to ``W`` (its input needs no
            gradient); the last stage receives no gradient (no ``RECV_B``).
        copy_back: swapped tensors are copied back to the device at backward (accelerator);
            False on a CPU, where the host copy is read in place.
        arrive: :func:`arrivals` of the rank (the interleaved runtime, which posts
            receives ahead): receive buffers that exist before the action that needs them.
            None (the single-chunk runtime, which posts none ahead): each comes at its
            own ``RECV``. Either way a received input is held by its segment, a received
            gradient until its backward is done.
        send_header: bytes of each send's header, held until ``SYNC`` (0: not walked).

    Returns:
        ``(device peak, host peak, moment of the device peak)``.
    """
    by_chunk: dict[int, list[LayerTerms]] = {}
    for x in layers:
        by_chunk.setdefault(x.chunk, []).append(x)
    fed = {a.stage for a in actions if a.kind == "RECV_F"}
    first = {c for c in by_chunk if c not in fed}
    pol = {x.layer: policies.get(x.layer, "keep") for x in layers}
    held: dict[tuple[int, int], dict] = {}  # (chunk, mb) -> {layer (-1: input): bytes}
    host: dict[tuple[int, int], int] = {}
    back: dict[tuple[int, int], int] = {}   # brought back at B, held until W
    grad_buf: dict[tuple[int, int], int] = {}
    received: set[tuple[int, int]] = set()  # inputs whose buffer exists (held by a segment)
    sent: set[tuple[int, int]] = set()  # outputs sent: alive until SYNC waits for the sends
    bufs = 0  # pending sends' buffers and headers: alive until the step's SYNC
    # the step's data, read before its first action: every micro-batch's inputs on the
    # model's first stage, its targets on the loss's stage, with its loss (a scalar kept for
    # the step's report; counted from the start, a few bytes early)
    micro_batches = len({a.mb for a in actions if a.kind == "F"})
    cur = micro_batches * (sum(by_chunk[c][0].input_bytes for c in first)
                           + sum(x.target_bytes + x.output_bytes for x in layers
                                 if x.target_bytes))
    peak = host_cur = host_peak = 0
    moment = ""

    def see(extra: int, where: str) -> None:
        nonlocal peak, moment
        if cur + extra > peak:
            peak, moment = cur + extra, where

    def release(key: tuple[int, int]) -> None:
        nonlocal cur, host_cur
        cur -= sum(held.pop(key, {}).values()) + back.pop(key, 0)
        host_cur -= host.pop(key, 0)

    def backward(a, key, rows: list[LayerTerms], split: bool) -> None:
        nonlocal cur, bufs
        down = list(reversed(rows))
        # the received gradient goes once the top segment's backward is done (a run of
        # kept layers is one segment; any other layer one of its own)
        top = 1
        while pol[down[0].layer] == "keep" and top < len(down) and \
                pol[down[top].layer] == "keep":
            top += 1
        for j, x in enumerate(down):
            if not split and j > 0 and pol[x.layer] == "recompute":
                # its output was the input of the segment above, released with it: its
                # recompute makes a new one (in ``work``)
                gone = min(held.get(key, {}).get(x.layer, 0), x.output_bytes)
                if gone:
                    held[key][x.layer] -= gone
                    cur -= gone
            # on an accelerator the next layer down starts coming back while this one
            # computes (the store's prefetch): its saved bytes are on the device too
            below = down[j + 1] if j + 1 < len(down) else None
            ahead = below.saved if copy_back and below is not None \
                and pol[below.layer] == "swap" else 0
            # measured by the allocator (back_work >= 0): the gradient coming from the layer
            # above is alive too (the rank's top layer's is a receive buffer, counted)
            incoming = x.output_bytes if x.back_work >= 0 and j > 0 else 0
            if pol[x.layer] == "recompute":
                see(x.work + ahead + incoming, f"{a} layer {x.layer} (recompute)")
                extra = x.kept
            elif pol[x.layer] == "swap" and copy_back:
                extra = x.saved
            else:
                extra = 0
            see(extra + max(x.back_work, 0) + incoming + ahead, f"{a} layer {x.layer}")
            if split:  # brought back, or what the weight side keeps of it: held until W
                if x.w_held >= 0 and pol[x.layer] != "swap":
                    above = down[j - 1] if j > 0 else None
                    out = x.output_bytes if (
                        above.w_keeps_input if above is not None else key in sent) else 0
                    keeps = x.w_held + out
                    h = held.get(key, {}).get(x.layer, 0)
                    if pol[x.layer] == "keep":  # B frees the rest of what the forward kept
                        if h > keeps:
                            held[key][x.layer] = keeps
                            cur -= h - keeps
                    else:  # recomputed: the output W reads is its first forward's, held
                        extra = min(extra, x.w_held + max(0, out - h))
                back[key] = back.get(key, 0) + extra
                cur += extra
            else:  # the segment is released once its backward is done
                h = held.get(key, {}).pop(x.layer, 0)
                if x is rows[-1] and key in sent:  # the pending send keeps the output
                    kept_out = min(h, x.output_bytes)
                    h -= kept_out
                    bufs += kept_out
                cur -= h
                if j == top - 1:
                    consumed(key)
        if not split:
            release(key)

    def receive(r, posted: bool = False) -> None:
        """``r``'s buffer comes into being, with its header's: held from a post ahead
        until ``r`` returns, or alive while the payload arrives."""
        nonlocal cur
        rk, rrows = (r.stage, r.mb), by_chunk.get(r.stage, [])
        if not rrows or local(r):  # a hand-over: the sender's tensor, counted there
            return
        if r.kind == "RECV_F" and rk not in received:
            received.add(rk)  # the received input is the segment's: released with it
            held.setdefault(rk, {})[-1] = n = rrows[0].input_bytes
        elif r.kind == "RECV_B" and rk not in grad_buf:
            # consumed by the micro-batch's backward (its W when split), then released
            grad_buf[rk] = n = rrows[-1].output_bytes
        else:
            return
        cur += n
        if posted:
            headers[(r.kind, rk)] = send_header
            cur += send_header
        see(0 if posted else send_header, f"{r}" + (" posted" if ahead else ""))

    def consumed(key: tuple[int, int]) -> None:
        """The backward of ``key`` (its ``W`` under a split backward) is done with its received
        gradient: released."""
        nonlocal cur
        cur -= grad_buf.pop(key, 0)

    def local(a) -> bool:
        """Whether transfer ``a`` is a hand-over between two chunks of this rank (ZB-V's
        turn): the runtime passes the tensor itself, no message, no header."""
        return a.stage + _OTHER_END[a.kind] in by_chunk

    ahead = arrive is not None
    early = arrive or {}
    headers: dict[tuple, int] = {}  # receives posted ahead -> their header buffers
    for i, a in enumerate(actions):
        for r in early.get(i, ()):  # receives posted ahead
            receive(r, posted=True)
        kind, c, mb = a.kind, a.stage, a.mb  # ActionKind is a str Enum: == "F" holds
        rows, key = by_chunk.get(c, []), (c, mb)
        if kind in ("RECV_F", "RECV_B"):
            receive(a)
            cur -= headers.pop((kind, key), 0)  # decoded: the header buffer goes
        elif kind in ("SEND_F", "SEND_B") and local(a):
            if kind == "SEND_B" and rows:  # the chunk below's received gradient, until used
                grad_buf[(c - 1, mb)] = n = rows[0].input_bytes
                cur += n
                see(0, f"{a} (hand-over)")
            continue  # the output stays its segment's (and the next chunk's input)
        elif kind in ("SEND_F", "SEND_B") and send_header:  # the header, until SYNC
            cur, bufs = cur + send_header, bufs + send_header
            see(0, f"{a} header")
        if kind == "SEND_F":
            sent.add(key)
        elif kind == "SEND_B" and rows:  # the pending send keeps the input gradient
            n = rows[0].input_bytes
            cur, bufs = cur + n, bufs + n
            see(0, f"{a}")
        elif kind == "SYNC":
            cur, bufs = cur - bufs, 0
            received.clear()
            sent.clear()
            grad_buf.clear()
        if kind == "F" and rows:
            if key not in held:  # the first stage's input: a view of the step's data
                held[key] = {-1: 0}
            for x in rows:
                see(x.forward_work(pol[x.layer]), f"{a} layer {x.layer}")
                h = x.held(pol[x.layer])
                held[key][x.layer] = h
                cur += h
                if pol[x.layer] == "swap":
                    host[key] = host.get(key, 0) + x.saved
                    host_cur += x.saved
                    host_peak = max(host_peak, host_cur)
        elif kind == "B" and rows:
            if c in first and _splits(actions):
                continue  # deferred to W, which runs the whole backward
            backward(a, key, rows, split=_splits(actions))
            if not _splits(actions):
                consumed(key)
        elif kind == "W" and rows:
            if c in first:
                backward(a, key, rows, split=False)
            else:
                if key in sent:  # the pending send keeps the output until
                    # SYNC (metered on the single-chunk runtime: ZB-H1 pp 4, stage 1 held
                    # every sent output of the micro-batches whose W was done)
                    out = held.get(key, {})
                    kept_out = min(out.get(rows[-1].layer, 0), rows[-1].output_bytes)
                    if kept_out:
                        out[rows[-1].layer] -= kept_out
                        bufs += kept_out
                release(key)
            consumed(key)  # a split backward's W still reads the received gradient (the
            # last linear's stashed output gradient is that tensor)
    return peak, host_peak, moment


def _splits(actions: list) -> bool:
    return any(a.kind == "W" for a in actions)


def stage_footprint(layers: list[LayerTerms], policies: dict[int, str], actions: list,
                    optimizer: str = "sgd", momentum: float = 0.0, shards: int = 1,
                    copy_back: bool = False, arrive: dict[int, list] | None = None
                    ) -> Footprint:
    """A rank's whole footprint: :func:`static_bytes` of its layers plus :func:`walk`.

    Args:
        layers, policies, actions, copy_back, arrive: see :func:`walk`.
        optimizer, momentum, shards: see :func:`static_bytes`.

    Returns:
        The :class:`Footprint`, its ``terms`` the per-layer rows used.
    """
    w, g, o = static_bytes(sum(x.param_bytes for x in layers), optimizer, momentum, shards)
    dev, host, moment = walk(layers, policies, actions, copy_back, arrive)
    return Footprint(w, g, o, dev, host, moment,
                     {x.layer: {"work": x.work, "kept": x.kept, "saved": x.saved,
                                "output_bytes": x.output_bytes,
                                "back_work": x.back_work, "policy":
                                policies.get(x.layer, "keep")} for x in layers})
