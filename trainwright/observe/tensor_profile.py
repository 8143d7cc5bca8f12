"""Tensor-level profiling for the peer-swap planner: every saved tensor's bytes and live times.

Extends :mod:`trainwright.observe.layer_profile` (per-layer costs) down to the tensors
autograd saves: for each layer, in forward order, every *storage* it saves for backward (parameters,
buffers and the layer's own input excluded; views of one storage counted once, which is
how the activation store counts and how the peer-swap runtime moves them), with its bytes,
the time it was packed (forward) and first unpacked (backward), relative to the start of
the step. The live interval of a tensor *in a pipeline* depends on the schedule: see
:func:`trainwright.plan.simulate.liveness`, which turns per-layer times into intervals.

Two modes:

* :func:`profile_tensors` runs the layers for real (a few steps, times measured, the last
  step's bytes). Times come from a :class:`~trainwright.observe.timing.Timer`: wall
  clock on the CPU, CUDA events on a GPU (:func:`~trainwright.observe.timing.device_timer`),
  which time the kernels rather than their launch (checked on an H100 by the GPU check;
  tested here with an injected timer);
* :func:`profile_tensors_meta` runs them on the meta device, for models far larger than
  this machine: sizes are exact (the same ops, the same saved tensors; attention is routed
  to the fused kernel real runs use), times come from a
  cost model: ``forward_s = flops / flops_per_s + moved_bytes / bytes_per_s`` (FLOPs from
  :class:`torch.utils.flop_counter.FlopCounterMode`, moved bytes = saved + output),
  ``backward_s = 2 * forward_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from trainwright.observe.timing import Timer, device_timer

__all__ = ["SavedTensor", "LayerTensors", "profile_tensors", "profile_tensors_meta",
           "saved_storages"]


@dataclass
class SavedTensor:
    """One storage a layer saves for backward (per micro-batch)."""

    index: int
    """Order of first pack in the layer's forward (the peer-swap runtime's key)."""
    nbytes: int
    shape: list[int]
    dtype: str
    packed_s: float = 0.0
    """When it was packed, seconds from the start of the step."""
    unpacked_s: float = 0.0
    """When backward first unpacked it."""


@dataclass
class LayerTensors:
    """A layer's costs and its saved tensors, per micro-batch."""

    layer: int
    name: str
    forward_s: float
    backward_s: float
    input_bytes: int
    output_bytes: int
    param_bytes: int
    tensors: list[SavedTensor] = field(default_factory=list)
    weight_s: float = 0.0
    """Of ``backward_s``, a split backward's ``W`` (:attr:`LayerCost.weight_s
    <trainwright.observe.layer_profile.LayerCost.weight_s>`); 0: not measured."""

    @property
    def saved_bytes(self) -> int:
        """Sum of the saved storages' bytes."""
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return asdict(self)


def _sid(t: torch.Tensor) -> int:
    # the storage's C++ identity: valid on the meta device too, where every data_ptr is 0
    return t.untyped_storage()._cdata


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor))


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class saved_storages:
    """Context manager recording the unique storages autograd saves inside it.

    Args:
        exclude: storage ids never recorded (parameters, buffers, the layer's inputs).
        clock: returns "now" in seconds (for pack times).
    """

    def __init__(self, exclude: set[int], clock: Callable[[], float] = time.perf_counter):
        self.exclude, self.clock = exclude, clock
        self.tensors: list[SavedTensor] = []
        self._index: dict[int, SavedTensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        sid = _sid(t)
        if sid in self.exclude:
            return t
        if sid not in self._index:
            rec = SavedTensor(len(self.tensors), t.untyped_storage().nbytes(), list(t.shape),
                              str(t.dtype).removeprefix("torch."), packed_s=self.clock())
            self._index[sid] = rec
            self.tensors.append(rec)
        return (self._index[sid], t)

    def _unpack(self, x):
        if isinstance(x, tuple):
            rec, t = x
            if not rec.unpacked_s:
                rec.unpacked_s = self.clock()
            return t
        return x

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _since(t0: float) -> Callable[[], float]:
    return lambda: time.perf_counter() - t0


def _excluded(module: nn.Module, inputs: tuple) -> set[int]:
    return {_sid(t) for t in [*module.parameters(), *module.buffers(), *inputs]
            if isinstance(t, torch.Tensor)}


def profile_tensors(layers: list[tuple[str, nn.Module]], x: torch.Tensor,
                    target: torch.Tensor | None = None, loss_fn: Callable | None = None,
                    steps: int = 2, timer: Timer | None = None) -> list[LayerTensors]:
    """Run ``layers`` forward and backward one micro-batch at a time and record every
    saved tensor (real device; gradients the layers accumulate are cleared).

    Each layer runs as its own autograd segment (as :class:`~trainwright.pipeline.stage.Stage`
    does). Times are from the last of ``steps`` steps (the first warms up).

    Args:
        layers: ``(name, module)`` in model order.
        x: one micro-batch of model input.
        target, loss_fn: the loss on the last layer (else the last output's sum).
        timer: times each layer's forward and backward (default
            :func:`~trainwright.observe.timing.device_timer` of ``x``'s device).
    """
    timer = timer or device_timer(x.device)
    out: list[LayerTensors] = []
    for _ in range(steps):
        clock = _since(time.perf_counter())
        out, segs, h = [], [], (x,)
        for i, (name, m) in enumerate(layers):
            inp = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in h)
            rec = saved_storages(_excluded(m, inp), clock)
            f0 = timer.start()
            with rec:
                y = _tuple(m(inp[0] if len(inp) == 1 else inp))
                if i == len(layers) - 1:
                    y = (loss_fn(y[0], target) if loss_fn else y[0].float().sum(),)
            fs = timer.stop(f0)
            pbytes = sum(p.numel() * p.element_size() for p in m.parameters())
            out.append(LayerTensors(i, name, fs, 0.0, _nbytes(inp), _nbytes(y), pbytes,
                                    rec.tensors))
            segs.append((inp, y, rec))
            h = tuple(t.detach() for t in y)
        grads = None
        for i in range(len(layers) - 1, -1, -1):
            inp, y, rec = segs[i]
            b0 = timer.start()
            with rec:
                torch.autograd.backward(list(y), grad_tensors=grads)
            out[i].backward_s = timer.stop(b0)
            grads = [t.grad for t in inp if t.requires_grad] or None
    for _, m in layers:
        m.zero_grad(set_to_none=True)
    return out


class _FusedAttentionOnMeta(TorchFunctionMode):
    """On the meta device ``scaled_dot_product_attention`` falls back to the math kernel,
    which saves the full ``T x T`` attention matrix; real CPU and CUDA runs use a fused
    (flash) kernel that saves q, k, v, the output and the log-sum-exp. Route meta calls to
    the fused op so the saved tensors are the ones a real run has."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta" and \
                kwargs.get("attn_mask") is None and len(args) == 3:
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                *args, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                scale=kwargs.get("scale"))
            return out
        return func(*args, **kwargs)


def profile_tensors_meta(layers: list[tuple[str, nn.Module]], x: torch.Tensor,
                         flops_per_s: float, bytes_per_s: float,
                         target: torch.Tensor | None = None,
                         loss_fn: Callable | None = None) -> list[LayerTensors]:
    """Sizes of every saved tensor with nothing allocated: layers and input on the meta device.

    Args:
        layers: ``(name, module)`` built on the meta device (``with torch.device("meta")``).
        x: a meta input of one micro-batch (token ids or activations).
        flops_per_s: device arithmetic throughput (e.g. 312e12 for A100 bf16 dense).
        bytes_per_s: device memory bandwidth.
        target, loss_fn: the loss on the last layer, as in :func:`profile_tensors`.

    Returns:
        Per layer: exact bytes; times from the cost model in the module docstring. Packed and
        unpacked times are laid out as if forward then backward ran back to back.
    """
    from torch.utils.flop_counter import FlopCounterMode

    out: list[LayerTensors] = []
    h = (x,)
    clock_now = [0.0]
    for i, (name, m) in enumerate(layers):
        inp = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in h)
        rec = saved_storages(_excluded(m, inp), lambda: clock_now[0])
        with FlopCounterMode(display=False) as fc, _FusedAttentionOnMeta(), rec:
            y = _tuple(m(inp[0] if len(inp) == 1 else inp))
            if i == len(layers) - 1:
                y = (loss_fn(y[0], target) if loss_fn else y[0].float().sum(),)
        moved = sum(t.nbytes for t in rec.tensors) + _nbytes(y)
        fs = fc.get_total_flops() / flops_per_s + moved / bytes_per_s
        for t in rec.tensors:
            t.packed_s = clock_now[0] + fs
        clock_now[0] += fs
        pbytes = sum(p.numel() * p.element_size() for p in m.parameters())
        out.append(LayerTensors(i, name, fs, 2 * fs, _nbytes(inp), _nbytes(y), pbytes,
                                rec.tensors))
        h = tuple(t.detach() for t in y)
    for lt in reversed(out):
        for t in lt.tensors:
            t.unpacked_s = clock_now[0]
        clock_now[0] += lt.backward_s
    return out
