"""A stage: an ordered list of layers, each run as its own autograd segment.

[Note: one segment per layer] Each layer's input is detached (and set to require grad), so
every (layer, micro-batch) pair owns a separate autograd graph held in the activation
store. Backward walks the layers in reverse, feeding each segment the gradient of its
output and reading the gradient of its input. This costs nothing in arithmetic and gives
per-layer control: a layer can change its memory policy, or leave for another stage,
between any two schedule actions, because no graph spans two layers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from trainwright.observe.layer_profile import LayerProfiler
from trainwright.observe.timing import Timer, WallTimer
from trainwright.pipeline.deferred_linear import WeightStash, defer_linears
from trainwright.pipeline.split_backward import backward_input, backward_weight
from trainwright.pipeline.store import ActivationStore, Segment, as_tuple

__all__ = ["LayerSlot", "StepMode", "StageOptions", "Stage"]


@dataclass
class LayerSlot:
    """A layer placed on a stage, with its own optimizer (so it can migrate alone)."""

    index: int
    """Position in the whole model."""
    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None


def _nbytes(values: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def _detach(values: tuple, grad: bool) -> tuple:
    return tuple(
        t.detach().requires_grad_(grad and t.is_floating_point())
        if isinstance(t, torch.Tensor) else t
        for t in values
    )


@dataclass(frozen=True)
class StepMode:
    """How one step runs the layers."""

    fast: bool = False
    """Fuse consecutive ``keep`` layers into one segment, unmeasured (when no plan needs
    per-layer figures and no policy change or migration is pending)."""
    measured_mb: int | None = None
    """On a fast step, the micro-batch that still runs layer by layer, measured: a profile
    step's sample of every layer's costs (the others stay fused)."""


@dataclass
class StageOptions:
    """The settings a rank's stages read; the chunks of an interleaved rank share one.

    The trainer builds it with the stages and sets :attr:`mode` before every step; nothing
    else writes it.
    """

    autocast: Callable | None = None
    """Mixed precision: a factory of the autocast context every layer's forward (and
    recompute) runs in; the loss is then taken in fp32. None: full precision."""
    loss_gradient: Callable | None = None
    """``loss -> tensor`` to start backward from instead of 1 (fp16 loss scaling)."""
    split_backward: bool = False
    """The schedule has ``W`` actions: ``B`` computes input gradients only, and linear layers
    of every stage but the first stash their weight side for ``W``
    (:mod:`~trainwright.pipeline.deferred_linear`)."""
    mode: StepMode = field(default_factory=StepMode)
    """This step's mode."""
    timer: Timer = field(default_factory=WallTimer)
    """Times each measured layer's forward and backward
    (:func:`~trainwright.observe.timing.device_timer`: CUDA events on a GPU)."""


class Stage:
    """Runs forward and backward of its layers on micro-batches.

    Args:
        slots: the layers, in model order.
        store: the activation store holding segments between forward and backward.
        profiler: per-layer cost collection.
        is_first: whether this is stage 0 (its model inputs need no gradient).
        loss_fn: ``(output, target) -> loss`` on the last stage, else None.
        loss_scale: multiplies each micro-batch loss (``1 / micro_batches``) so the
            accumulated gradient is the gradient of the mean loss.
        options: the rank's settings (shared by its chunks; default: fp32, one backward).
    """

    def __init__(self, slots: list[LayerSlot], store: ActivationStore, profiler: LayerProfiler,
                 *, is_first: bool, loss_fn: Callable | None = None, loss_scale: float = 1.0,
                 options: StageOptions | None = None):
        self.options = options if options is not None else StageOptions()
        self.slots = list(slots)
        self.store, self.profiler = store, profiler
        self.is_first, self.loss_fn, self.loss_scale = is_first, loss_fn, loss_scale
        self.retiring: dict[int, LayerSlot] = {}
        """Layers no longer forwarded here whose held segments still need a backward."""
        self.record_rng: set[int] = set()
        """Layers whose segments also record the RNG state (they may be shipped)."""
        self._weight_work: dict[int, list] = {}
        """Micro-batch -> segments whose weight gradients (W) are still to compute."""
        self._deferred: dict[int, tuple | None] = {}
        """First stage under a split backward: micro-batch -> its output gradients, kept by
        B for W to run the whole backward at once (see :meth:`backward`)."""
        for s in self.slots:
            self._adopt(s)

    @property
    def fast(self) -> bool:
        """This step fuses consecutive ``keep`` layers (:class:`StepMode`)."""
        return self.options.mode.fast

    @property
    def measured_mb(self) -> int | None:
        """The micro-batch a fast step still measures layer by layer (:class:`StepMode`)."""
        return self.options.mode.measured_mb

    @property
    def autocast(self) -> Callable | None:
        """The autocast context factory (:class:`StageOptions`)."""
        return self.options.autocast

    @property
    def loss_gradient(self) -> Callable | None:
        """The gradient backward starts from on the last layer (:class:`StageOptions`)."""
        return self.options.loss_gradient

    @property
    def defer_weights(self) -> bool:
        """Linear layers stash their weight side for ``W`` (a split backward, not on the
        first stage, whose ``B`` nothing waits for)."""
        return self.options.split_backward and not self.is_first

    def _adopt(self, slot: LayerSlot) -> None:
        self.store.exclude_params([slot.module])
        pbytes = sum(p.numel() * p.element_size() for p in slot.module.parameters())
        self.profiler.register(slot.index, slot.name, pbytes)

    def add_layers(self, slots: list[LayerSlot]) -> None:
        """Forward these layers here from now on (a migration's receiver side)."""
        for slot in slots:
            self._adopt(slot)
        self.slots = sorted([*self.slots, *slots], key=lambda x: x.index)

    def retire_layers(self, indices) -> list[LayerSlot]:
        """Stop forwarding these layers; they stay for the backward of held segments."""
        indices = set(indices)
        gone = [s for s in self.slots if s.index in indices]
        self.slots = [s for s in self.slots if s.index not in indices]
        if not self.slots:
            raise RuntimeError(f"stage would lose all its layers ({sorted(indices)})")
        self.retiring.update({s.index: s for s in gone})
        return gone

    def drop_retired(self, indices) -> list[LayerSlot]:
        """Delete retired layers once no segment of theirs is held (giver, end of migration)."""
        held = {layer for layer, _ in self.store.held()}
        out = []
        for i in indices:
            if i in held:
                raise RuntimeError(f"layer {i} still holds activations; cannot delete it")
            out.append(self.retiring.pop(i))
            self.profiler.forget(i)
        return out

    def layer(self, index: int) -> LayerSlot:
        """The slot of a layer forwarded or retiring here."""
        for s in self.slots:
            if s.index == index:
                return s
        return self.retiring[index]

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the loss."""
        return self.loss_fn is not None

    def parameters(self) -> list[nn.Parameter]:
        """All parameters of the stage's layers, in layer order."""
        return [p for s in self.slots for p in s.module.parameters()]

    def _stash(self) -> WeightStash | None:
        """A new segment's stash for deferred linear layers, or None when not deferring."""
        return WeightStash() if self.defer_weights and self.autocast is None else None

    def _run(self, slot: LayerSlot, inp: tuple, is_last_layer: bool,
             target: torch.Tensor | None, stash: WeightStash | None = None) -> tuple:
        with self.autocast() if self.autocast is not None else nullcontext(), \
                defer_linears(slot.module, stash) if stash is not None else nullcontext():
            out = as_tuple(slot.module(inp[0] if len(inp) == 1 else inp))
        if is_last_layer and self.loss_fn is not None:
            logits = out[0].float() if self.autocast is not None else out[0]
            out = (self.loss_fn(logits, target) * self.loss_scale,)
        return out

    def _runs(self, mb: int | None = None) -> list[list[int]]:
        """Positions of the slots, grouped into the segments a forward of micro-batch ``mb``
        makes: one per layer, or on a fast step (:attr:`fast`, ``mb`` not
        :attr:`measured_mb`) runs of consecutive ``keep`` layers."""
        runs: list[list[int]] = []
        fusable_prev, fast = False, self.fast and (mb is None or mb != self.measured_mb)
        for i, slot in enumerate(self.slots):
            fusable = (fast and self.store.policy(slot.index) == "keep"
                       and slot.index not in self.record_rng)
            if fusable and fusable_prev:
                runs[-1].append(i)
            else:
                runs.append([i])
            fusable_prev = fusable
        return runs

    def infer(self, inputs: tuple, target: torch.Tensor | None = None) -> tuple:
        """Forward only (evaluation): every layer under ``torch.no_grad``, nothing held.

        Returns:
            The last layer's outputs, or ``(loss,)`` on the last stage given ``target``.
        """
        x = as_tuple(inputs)
        last = len(self.slots) - 1
        with torch.no_grad():
            for i, slot in enumerate(self.slots):
                x = self._run(slot, x, i == last and target is not None, target)
        return x

    def forward(self, mb: int, inputs: tuple, target: torch.Tensor | None = None) -> tuple:
        """Run every layer on micro-batch ``mb`` under its policy and hold the segments.

        Returns:
            The last layer's outputs, detached (what is sent on), or ``(loss,)`` detached
            on the last stage.
        """
        x = as_tuple(inputs)
        last = len(self.slots) - 1
        for run in self._runs(mb):
            i = run[0]
            inp = _detach(x, grad=not (self.is_first and i == 0))
            if len(run) > 1:
                x, stash = inp, self._stash()
                for j in run:
                    x = self._run(self.slots[j], x, j == last, target, stash)
                self.store.put(Segment(self.slots[i].index, mb, inp, x, stash=stash,
                                       span=tuple(self.slots[j].index for j in run)))
                continue
            x = self._forward_layer(self.slots[i], mb, inp, i == last, target)
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in x)

    def _forward_layer(self, slot: LayerSlot, mb: int, inp: tuple, is_last: bool,
                       target: torch.Tensor | None) -> tuple:
        """One layer as its own segment, under its policy, measured."""
        policy = self.store.policy(slot.index)
        in_bytes = _nbytes(inp)
        if policy == "recompute":
            rng = _rng_state(inp)
            t0 = self.options.timer.start()
            with torch.no_grad():
                out = self._run(slot, inp, is_last, target)
            dt = self.options.timer.stop(t0)
            seg = Segment(slot.index, mb, inp, None, policy=policy, rng_state=rng,
                          target=target if is_last else None)
            self.profiler.forward(slot.index, dt, None, in_bytes, _nbytes(out))
        else:
            rng = _rng_state(inp) if slot.index in self.record_rng else None
            stash = self._stash()
            with self.store.capture(inp, swap=policy == "swap",
                                    segment=(slot.index, mb)) as cap:
                t0 = self.options.timer.start()
                out = self._run(slot, inp, is_last, target, stash)
                dt = self.options.timer.stop(t0)
            seg = Segment(slot.index, mb, inp, out, storages=cap.saved, policy=policy,
                          swapped=cap.swapped, rng_state=rng, stash=stash)
            self.profiler.forward(slot.index, dt, cap.activation_bytes, in_bytes,
                                  _nbytes(out))
        self.store.put(seg)
        return out

    def backward(self, mb: int, grads: tuple | None = None, split: bool = False) -> tuple:
        """Back-propagate micro-batch ``mb`` through every layer, releasing its segments.

        Args:
            grads: gradients of this stage's outputs, aligned with them (None entries for
                outputs that need none); None on the last stage, which starts from the loss.
            split: compute input gradients only (zero-bubble B); the segments stay held,
                with what their weight gradients need, until :meth:`backward_weight`.

        Returns:
            Gradients of the stage's inputs (None where an input needs no gradient).
        """
        if split and self.is_first:
            # nobody waits for the first stage's input gradients (token ids need none), so
            # its B defers everything to W, which runs one unsplit backward: B + W in two
            # passes costs more than one (torch's pipelining does the same on stage 0)
            self._deferred[mb] = grads
            return (None,)
        # the layers holding a segment of mb: normally every slot; during a migration, layers
        # shipped away are skipped and layers received (or retiring) are included
        known = {s.index: s for s in [*self.slots, *self.retiring.values()]}
        # a store shared by several chunks of a rank (interleaved) also holds theirs
        held = {layer for layer, m in self.store.held() if m == mb and layer in known}
        order = sorted(held, reverse=True)
        loss_layer = self.slots[-1].index if self.is_last else None
        for i, index in enumerate(order):
            seg = self.store.peek(index, mb) if split else self.store.pop(index, mb)
            if i + 1 < len(order):  # the next layer back starts coming home while this computes
                self.store.prefetch(order[i + 1], mb)
            grads = self._backward_segment(seg, known, loss_layer, grads, split)
        return grads

    def _backward_segment(self, seg: Segment, known: dict, loss_layer: int | None,
                          grads: tuple | None, split: bool) -> tuple:
        """One segment's backward (or its B with ``split``); returns its input gradients."""
        slot = known[seg.layer]
        outputs, transient = seg.outputs, sum(s.nbytes for s in seg.swapped)
        if seg.policy == "recompute":
            seg.stash = self._stash()
            with _rng_restored(seg.inputs, seg.rng_state), \
                    self.store.capture(seg.inputs) as cap:
                outputs = self._run(slot, seg.inputs, seg.layer == loss_layer, seg.target,
                                    seg.stash)
            transient = cap.activation_bytes
            self.profiler.saved(slot.index, transient)
        holds_loss = loss_layer is not None and loss_layer in (seg.span or (seg.layer,))
        if grads is None and holds_loss and self.loss_gradient is not None:
            grads = (self.loss_gradient(outputs[0]),)
        t0 = self.options.timer.start()
        if split:
            params = [p for index in (seg.span or (seg.layer,))
                      for p in known[index].module.parameters()]
            self.store.add_bytes(transient)  # brought back or rebuilt: held until W
            got, work = backward_input(outputs, grads, seg.inputs, params, seg.stash)
            seg.outputs = None  # the boundary nodes or the stash keep what W needs, no more
            self._weight_work.setdefault(seg.mb, []).append(
                (seg, work, transient, self.options.timer.stop(t0)))
            return got
        with self.store.transient(transient):
            _backward(outputs, grads)
        if not seg.span:
            self.profiler.backward(slot.index, self.options.timer.stop(t0))
        return tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                     for t in seg.inputs)

    def backward_weight(self, mb: int) -> None:
        """W of micro-batch ``mb``: weight gradients left by :meth:`backward` with ``split``;
        releases its segments."""
        if mb in self._deferred:
            self.backward(mb, self._deferred.pop(mb))
            return
        for seg, work, transient, b_s in self._weight_work.pop(mb, []):
            t0 = self.options.timer.start()
            backward_weight(work)
            if not seg.span:
                self.profiler.backward(seg.layer, b_s, self.options.timer.stop(t0))
            self.store.pop(seg.layer, mb)
            self.store.add_bytes(-transient)


def _backward(outputs: tuple, grads: tuple | None) -> None:
    if grads is None:
        pairs = [(o, None) for o in outputs]
    else:
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
    pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs],
                                grad_tensors=[g for _, g in pairs] if grads else None)


def _cuda_devices(values: tuple) -> list:
    return sorted({t.device for t in values if isinstance(t, torch.Tensor) and t.is_cuda},
                  key=str)


def _rng_state(values: tuple) -> tuple:
    """CPU (and CUDA) RNG state, so a recomputation draws the same random numbers."""
    return (torch.get_rng_state(),
            [torch.cuda.get_rng_state(d) for d in _cuda_devices(values)])


@contextmanager
def _rng_restored(values: tuple, state: tuple):
    devices = _cuda_devices(values)
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        for d, s in zip(devices, state[1], strict=True):
            torch.cuda.set_rng_state(s, d)
        yield
