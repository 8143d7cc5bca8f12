"""An activation meter that works under anyone's saved-tensor hooks, and the bench model.

:class:`SavedTensorMeter` (``meter.py``) installs its own ``saved_tensors_hooks``; those do
not nest (only the innermost pair applies), so it cannot watch trainwright's activation
store or ``torch.utils.checkpoint``, which install theirs. :class:`LiveStorageMeter` sits
one level lower, as a ``TorchDispatchMode`` entered around every layer's forward
(:class:`Metered`): it records every storage that a layer's forward *creates or receives
as input* (parameters and buffers excluded) and counts it until the storage is freed (a
finalizer on the storage, so the peak is exact). In the benchmarks' training steps
(:func:`bench_data`) the mode covers the whole step instead: whatever runs outside
backward with grad enabled (the loss, received stage inputs) counts as well, gradients
and the optimizer step do not.
Whatever holds the tensor (autograd's saved variables, the pipeline's store, a
checkpoint's boundary) it is counted while it lives; recomputation inside backward runs a
forward again and is counted too; what is allocated only in backward (gradients) is not.
On a CPU a host "swap" copy lives in the same RAM and is counted as well.

One meter per process (:func:`meter`): each pipeline rank measures its own stage.

:func:`bench_gpt` is the ``model.factory`` the memory and planner benchmarks train; the
environment picks its cut and wrapping (so the same factory serves spawned ranks and
``trainwright run`` subprocesses):

- ``TW_BENCH_SPLIT=1``: attention and MLP as separate layers (:mod:`~trainwright.model.gpt_split`);
- ``TW_BENCH_CHECKPOINT=1,4,7``: wrap these layer indices in ``torch.utils.checkpoint``
  (``TW_BENCH_CHECKPOINT_IMPL=deepspeed``: in DeepSpeed's, :class:`DeepSpeedCheckpointed`);
- ``TW_BENCH_METER=1``: wrap every layer in :class:`Metered`;
- ``TW_BENCH_METER_DIR=DIR``: also write ``DIR/rank{RANK}.json`` whenever the peak rises;
- ``TW_BENCH_METER_STEPS=N``: with :func:`bench_data` as ``data.factory``, meter steps 2
  to ``N`` only (step 1 when ``N`` is 1), so the steps after them (the timed ones) run at
  full speed. Ranks that read data switch at the step's batch; every rank (a middle
  pipeline stage reads none) also switches after each step's optimizer steps. With
  ``N = 1`` a middle stage cannot tell step 1 from the set-up, so use ``N >= 2``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from trainwright.dist.mailbox import Mailbox
from trainwright.errors import ConfigError
from trainwright.pipeline.swap import HostSwap

__all__ = ["LiveStorageMeter", "Metered", "Checkpointed", "DeepSpeedCheckpointed", "meter",
           "reset_meter", "bench_gpt", "bench_data"]


_HOST_COPY_CODES = {HostSwap.pack.__code__}
"""Where host-swap copies are allocated: a storage created while one of these functions is
on the Python stack is a host copy (on a CPU it lives in the same RAM as the device's)."""
_TELEMETRY_CODES = {Mailbox._send.__code__, Mailbox._post.__code__}
"""Where the telemetry mailbox allocates its host-side message slots (64 KiB each, CPU
tensors on any device): what a rank sends, and the receive rank 0 keeps posted per other
rank. Neither activations nor device memory, so not counted."""


def _allocation_site() -> str:
    """``"host"``, ``"telemetry"`` or ``"device"``: who the op being dispatched was called
    from (a walk up the Python stack)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in _HOST_COPY_CODES:
            return "host"
        if f.f_code in _TELEMETRY_CODES:
            return "telemetry"
        f = f.f_back
    return "device"


class LiveStorageMeter:
    """Bytes of live storages created or received by metered forwards, and their peak.

    Device-resident bytes (``bytes``, ``peak_bytes``) and host copies (``host_bytes``,
    ``peak_host_bytes``) are told apart by where a storage was allocated: inside a host-swap
    copy (:data:`_HOST_COPY_CODES` on the stack) or anywhere else; the store is never asked.
    The telemetry mailbox's host-side slots (:data:`_TELEMETRY_CODES`) are not counted.
    With ``detail`` (env ``TW_BENCH_METER_DETAIL=1``) :attr:`at_peak` holds, at the device
    peak, the live bytes per creating op; at level 2 (``TW_BENCH_METER_DETAIL=2``)
    :attr:`live_at_peak` also lists every live device storage then: its op, the metered
    layer it was made in, its bytes and when (``time.time()``, the clock of the run's
    trace events, so ``tools/meter_at_peak.py`` names the action that made it).
    """

    def __init__(self, detail: int = 0):
        self._live: dict[int, int] = {}
        self._host: set[int] = set()
        self._op: dict[int, str] = {}
        self._made: dict[int, tuple[str, float]] = {}
        """Level 2: storage -> (metered layer it was made in, ``time.time()`` then)."""
        self.detail = int(detail) or int(os.environ.get("TW_BENCH_METER_DETAIL") or 0)
        self.at_peak: dict[str, int] = {}
        self.live_at_peak: list[dict] = []
        self.layer = ""
        """The metered layer running now (:class:`Metered`'s label; "" outside one)."""
        self.bytes = 0
        self.peak_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.exclude: dict[int, StorageWeakRef] = {}
        """Parameters' and buffers' storages by address, never counted while they live (a
        freed one's address is counted again: the memory of the layers a pipeline rank
        drops goes to its activations)."""
        self.active = True
        """Whether metered forwards count (the bench data switches it off after warm-up)."""
        self.out_path: Path | None = None
        self._written: tuple = ()
        self.in_layer = 0
        self._whole: _Mode | None = None
        self.metered_model = False
        """Whether a metered model was built with ``TW_BENCH_METER_STEPS`` set."""
        self.optimizer_steps: dict[int, int] = {}
        """Steps taken per optimizer (by id) since this meter was made."""

    def counting(self) -> bool:
        """Inside a metered layer's forward, or outside backward with grad enabled (the
        loss, received stage inputs): what the whole-step mode counts."""
        return bool(self.in_layer) or (torch.is_grad_enabled()
                                       and torch._C._current_graph_task_id() == -1)

    def start_steps(self) -> None:
        """Meter everything the training steps run (not only layer forwards) from now on:
        the loss and the received inputs too, never gradients or the optimizer."""
        if self._whole is None:
            self._whole = _Mode(self, whole=True)
            self._whole.__enter__()
        self.active = True

    def stop_steps(self) -> None:
        """Stop metering (the timed steps run at full speed)."""
        if self._whole is not None:
            self._whole.__exit__(None, None, None)
            self._whole = None
        self.active = False
        self.flush()

    def _release(self, key: int) -> None:
        n = self._live.pop(key, 0)
        self._op.pop(key, None)
        self._made.pop(key, None)
        if key in self._host:
            self._host.discard(key)
            self.host_bytes -= n
        else:
            self.bytes -= n

    def add(self, t, op: str = "input") -> None:
        """Count ``t``'s storage if it is new (views and in-place results are not)."""
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0 or key in self._live or self._excluded(key):
            return
        site = _allocation_site()
        if site == "telemetry":
            return
        self._live[key] = nbytes
        # torch keeps one Python object per storage, so this fires when the storage is freed
        weakref.finalize(st, self._release, key)
        if site == "host":
            self._host.add(key)
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            return
        self.bytes += nbytes
        if self.detail:
            self._op[key] = op
        if self.detail >= 2:
            self._made[key] = (self.layer, time.time())
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes
            if self.detail:
                at: dict[str, int] = {}
                for k, o in self._op.items():
                    at[o] = at.get(o, 0) + self._live.get(k, 0)
                self.at_peak = at
            if self.detail >= 2:
                self.live_at_peak = [
                    {"op": self._op[k], "layer": layer, "bytes": self._live[k], "time": t}
                    for k, (layer, t) in self._made.items() if k in self._live]

    def exclude_module(self, module: nn.Module) -> None:
        """Never count ``module``'s parameters and buffers while they live."""
        for t in [*module.parameters(), *module.buffers()]:
            st = t.untyped_storage()
            self.exclude[st.data_ptr()] = StorageWeakRef(st)

    def _excluded(self, key: int) -> bool:
        """Whether the storage at address ``key`` is a live excluded one (an expired
        exclusion is dropped: its address now holds something else)."""
        ref = self.exclude.get(key)
        if ref is not None and ref.expired():
            del self.exclude[key]
            return False
        return ref is not None

    def flush(self) -> None:
        """Write the peak to :attr:`out_path` when it rose since the last write."""
        now = (self.peak_bytes, self.peak_host_bytes)
        if self.out_path is not None and now != self._written:
            self.out_path.write_text(json.dumps({"peak_bytes": self.peak_bytes,
                                                 "host_peak_bytes": self.peak_host_bytes,
                                                 **({"at_peak": self.at_peak}
                                                    if self.detail else {}),
                                                 **({"live_at_peak": self.live_at_peak}
                                                    if self.detail >= 2 else {})}))
            self._written = now


def _host_copy_outside_layers() -> bool:
    """Whether the op being dispatched is a host swap's copy made outside backward with grad
    mode off: autograd runs pack hooks so, and the loss's saved tensors are packed outside
    any metered layer, where :meth:`LiveStorageMeter.counting` alone would miss them."""
    return (not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and _allocation_site() == "host")


class _Mode(TorchDispatchMode):
    def __init__(self, m: LiveStorageMeter, whole: bool = False):
        super().__init__()
        self.m, self.whole = m, whole

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.whole or self.m.counting() or _host_copy_outside_layers():
            for t in tree_leaves(out):
                self.m.add(t, f"{func}{'/layer' if self.m.in_layer else ''}")
        return out


_METER: LiveStorageMeter | None = None


def reset_meter() -> LiveStorageMeter:
    """Start a new meter for this process (before building the next run's model)."""
    global _METER
    if _METER is not None:
        _METER.stop_steps()
    _METER = LiveStorageMeter()
    return _METER


def meter() -> LiveStorageMeter:
    """This process's meter (created on first use)."""
    global _METER
    if _METER is None:
        _METER = LiveStorageMeter()
    return _METER


class Metered(nn.Module):
    """A layer whose forward (inputs included) is counted by this process's meter."""

    def __init__(self, layer: nn.Module, label: str = ""):
        super().__init__()
        self.layer = layer
        self.label = label or type(layer).__name__
        """What the meter's level-2 detail names it by (``bench_gpt``: ``"3:Block"``)."""
        meter().exclude_module(layer)

    def forward(self, *args):
        m = meter()
        if not m.active:
            return self.layer(*args)
        for t in tree_leaves(args):
            m.add(t)
        m.in_layer += 1
        outer, m.layer = m.layer, self.label
        try:
            if m._whole is not None:
                out = self.layer(*args)
            else:
                with _Mode(m):
                    out = self.layer(*args)
        finally:
            m.in_layer -= 1
            m.layer = outer
        m.flush()
        return out


class Checkpointed(nn.Module):
    """A layer whose forward runs under ``torch.utils.checkpoint`` (recomputed in backward)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return checkpoint(self.layer, x, use_reentrant=False)


class DeepSpeedCheckpointed(nn.Module):
    """A layer whose forward runs under ``deepspeed.checkpointing.checkpoint``.

    That is DeepSpeed's activation checkpointing, the function ``PipelineModule`` applies
    to each ``activation_checkpoint_interval`` group (reentrant: the inputs are saved, the
    forward runs without grad and is recomputed in backward). It is configured once per
    process with ``deepspeed.checkpointing.configure`` (no activation partitioning, no CPU
    checkpointing: one stage per rank, no model parallelism to partition over), after
    DeepSpeed's communication adopts the process group that is already initialised.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        _configure_deepspeed_checkpointing()

    def forward(self, x):
        import deepspeed

        return deepspeed.checkpointing.checkpoint(self.layer, x)


def _configure_deepspeed_checkpointing() -> None:
    from trainwright.bench import deepspeed_peer

    deepspeed_peer.deepspeed_comm()
    from deepspeed.runtime.activation_checkpointing import checkpointing

    if not checkpointing.is_configured():
        checkpointing.configure(None, partition_activations=False,
                                contiguous_checkpointing=False, checkpoint_in_cpu=False,
                                synchronize=False, profile=False)


def _env_indices(name: str) -> set[int]:
    raw = os.environ.get(name, "").strip()
    return {int(x) for x in raw.split(",") if x.strip()} if raw else set()


def bench_gpt(cfg) -> list[nn.Module]:
    """Model factory of the benchmarks: the built-in GPT, cut and wrapped per the environment
    (see the module docstring); weights equal the unwrapped model's for the same seed."""
    from trainwright.model.gpt import GPTConfig, gpt_layers
    from trainwright.model.gpt_split import split_gpt_layers

    m = cfg.model
    gcfg = GPTConfig(vocab=256, context=m.context, d_model=m.d_model, n_heads=m.n_heads,
                     n_blocks=m.n_blocks)
    if os.environ.get("TW_BENCH_SPLIT") == "1":
        layers = [layer for _, layer in split_gpt_layers(gcfg)]
    else:
        layers = gpt_layers(gcfg)
    ckpt = _env_indices("TW_BENCH_CHECKPOINT")
    metered = os.environ.get("TW_BENCH_METER") == "1" or "TW_BENCH_METER_DIR" in os.environ
    out_dir = os.environ.get("TW_BENCH_METER_DIR")
    if out_dir and "RANK" in os.environ:
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # one line on every rank, not a traceback from each
            raise ConfigError(f"TW_BENCH_METER_DIR={out_dir}: cannot create it "
                              f"({exc.strerror or exc}); set it to a folder you can write") \
                from None
        meter().out_path = Path(out_dir) / f"rank{os.environ['RANK']}.json"
    if metered and os.environ.get("TW_BENCH_METER_STEPS", "0") not in ("", "0"):
        meter().active = False  # set-up (plan profiling) is not counted; see bench_data
        meter().metered_model = True
        _hook_optimizer_steps()  # middle stages read no data: switch on optimizer steps
    wrap = (DeepSpeedCheckpointed if os.environ.get("TW_BENCH_CHECKPOINT_IMPL") == "deepspeed"
            else Checkpointed)
    wrapped = []
    for i, layer in enumerate(layers):
        if metered:
            layer = Metered(layer, f"{i}:{type(layer).__name__}")
        wrapped.append(wrap(layer) if i in ckpt else layer)
    return wrapped


def _metered_range(last: int) -> range:
    """The steps the meter counts when ``TW_BENCH_METER_STEPS`` is ``last``."""
    return range(min(2, last), last + 1)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """Global optimizer post-hook: switch the meter for the next step on every rank.

    A middle pipeline stage reads no data, so :class:`_MeteredSteps` never hears of its
    steps; the optimizer steps at the end of every step on every rank do. Optimizers are
    per layer, so the steps done are the most steps any one optimizer has taken.
    """
    m = meter()
    last = int(os.environ.get("TW_BENCH_METER_STEPS", "0") or 0)
    if not last or not m.metered_model:
        return
    m.optimizer_steps[id(optimizer)] = m.optimizer_steps.get(id(optimizer), 0) + 1
    if max(m.optimizer_steps.values()) + 1 in _metered_range(last):
        m.start_steps()
    else:
        m.stop_steps()


_HOOKED = False


def _hook_optimizer_steps() -> None:
    global _HOOKED
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_after_optimizer_step)
        _HOOKED = True


class _MeteredSteps:
    """The stdlib corpus, switching the meter off from step ``last + 1`` on."""

    def __init__(self, data, last: int):
        self.data, self.last = data, last

    def batch(self, step: int, batch_size: int):
        """The corpus's batch; the meter counts steps 2 to ``last`` whole (step 1 only when
        ``last`` is 1): not the set-up, nor the one-off work of step 1 (a memory planner
        profiles the whole model there), nor the timed steps after ``last``."""
        if self.last:
            if step in _metered_range(self.last):
                meter().start_steps()
            else:
                meter().stop_steps()
        return self.data.batch(step, batch_size)


def bench_data(cfg):
    """Data factory of the benchmarks: the built-in stdlib corpus (same batches as
    ``data.name = "stdlib"``), metering only the first ``TW_BENCH_METER_STEPS`` steps."""
    from trainwright.model.data import CharCorpus, stdlib_corpus

    data = CharCorpus(stdlib_corpus(cfg.data.max_bytes), cfg.model.context, seed=cfg.train.seed)
    return _MeteredSteps(data, int(os.environ.get("TW_BENCH_METER_STEPS", "0") or 0))
