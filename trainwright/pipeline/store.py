"""The activation store: every held layer segment, its storage policy, and byte accounting.

A *segment* is one layer's forward for one micro-batch: its detached input, its output
(which owns the autograd graph) and what autograd saved for backward. Each layer has a
policy (chosen by :mod:`trainwright.pipeline.budget`):

- ``keep``: the saved tensors stay on the device;
- ``swap``: ``saved_tensors_hooks`` copy them to host memory during forward
  (:mod:`trainwright.pipeline.swap`) and hand them back during the layer's backward;
- ``recompute``: the forward runs without a graph and only the input is kept; the graph is
  rebuilt (same RNG state) right before the layer's backward.

Bytes are counted by unique storage, so a tensor that is one layer's output and the next
layer's input is counted once, and parameters (which autograd also saves) never are.
``bytes`` is what the device holds for backward now; a swapped or recomputed layer's
activations are added as *transient* bytes while its backward runs; ``host_bytes`` is what
swap keeps on the host.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from trainwright.pipeline.swap import HostSwap, Swapped
from trainwright.plan.memory import POLICIES

__all__ = ["Segment", "Capture", "ActivationStore", "POLICIES", "as_tuple", "storage_key"]



def as_tuple(x) -> tuple:
    """A layer value as a tuple of tensors (a bare tensor becomes a 1-tuple)."""
    return x if isinstance(x, tuple) else (x,)


def storage_key(t: torch.Tensor) -> tuple[int, bool]:
    """Identity of the storage behind ``t`` (shared by all its views).

    A stage computes on one device, so the address and whether it is a CUDA one suffice;
    ``str(t.device)`` would cost a string per saved tensor (half of the store's overhead).
    """
    return (t.untyped_storage().data_ptr(), t.is_cuda)


def _tensor_storages(values) -> dict:
    return {storage_key(t): t.untyped_storage().nbytes()
            for t in values or () if isinstance(t, torch.Tensor)}


@dataclass
class Capture:
    """What autograd saved during one layer's forward."""

    saved: dict = field(default_factory=dict)
    """storage key -> bytes kept on the device (the layer's inputs included)."""
    swapped: list = field(default_factory=list)
    """:class:`Swapped` tensors sent to the host."""
    input_keys: set = field(default_factory=set)
    copies: dict = field(default_factory=dict)
    """Memory copied to the host in this forward (:meth:`HostSwap.pack`'s table)."""

    @property
    def activation_bytes(self) -> int:
        """Bytes saved for backward, not counting the layer's input: what a policy can move."""
        own = sum(n for k, n in self.saved.items() if k not in self.input_keys)
        return own + sum(s.nbytes for s in self.swapped)


@dataclass
class Segment:
    """One layer's forward on one micro-batch, held until its backward."""

    layer: int
    mb: int
    inputs: tuple
    """Detached inputs (floating ones require grad, so their ``.grad`` is the result)."""
    outputs: tuple | None
    """Outputs holding the graph (the loss on the last layer); None when recomputing."""
    storages: dict = field(default_factory=dict)
    """storage key -> bytes this segment keeps alive on the device."""
    policy: str = "keep"
    swapped: list = field(default_factory=list)
    rng_state: tuple | None = None
    """RNG state at forward, restored for the recomputation."""
    target: torch.Tensor | None = None
    """Loss target (last layer of the last stage, recompute only)."""
    span: tuple = ()
    """Layers run as this one segment (consecutive ``keep`` layers fused on a fast step);
    empty: ``layer`` alone."""
    stash: object = None
    """Its deferred linear layers' :class:`~trainwright.pipeline.deferred_linear.WeightStash`
    (a split backward's W adds their weight gradients from it), or None."""


class ActivationStore:
    """Holds segments between forward and backward and accounts their bytes.

    Args:
        exclude: storage keys never counted (parameters and buffers).
        device: the stage's device (for host swap).
    """

    def __init__(self, exclude: set | None = None, device: torch.device | None = None):
        self.exclude = set(exclude or ())
        self._param_keys: set = set()
        self.swap = HostSwap(device or torch.device("cpu"))
        self.policies: dict[int, str] = {}
        self._segments: dict[tuple[int, int], Segment] = {}
        self._refs: dict = defaultdict(int)
        self._sizes: dict = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.peak_microbatches = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.peer = None
        """Peer swap (:class:`~trainwright.pipeline.peerswap.PeerSwap`), or None."""
        self.chunk_of: dict[int, int] = {}
        """Layer -> model chunk, with several chunks per rank: the micro-batch peak then
        counts ``(chunk, micro-batch)`` pairs, each a chunk's own activations."""

    def policy(self, layer: int) -> str:
        """The storage policy of ``layer`` (default ``keep``)."""
        return self.policies.get(layer, "keep")

    def set_policies(self, policies: dict[int, str]) -> None:
        """Use these policies for forwards from now on (held segments keep theirs)."""
        bad = {k: v for k, v in policies.items() if v not in POLICIES}
        if bad:
            raise ValueError(f"unknown memory policies {bad}; use one of {POLICIES}")
        self.policies = dict(policies)

    def exclude_params(self, modules) -> None:
        """Never count the storages of these modules' parameters and buffers."""
        for m in modules:
            for t in [*m.parameters(), *m.buffers()]:
                self.exclude.add(storage_key(t))
                self._param_keys.add(storage_key(t))

    def follow_params(self, modules) -> None:
        """Exclude exactly the storages these modules' parameters and buffers have now: a
        gradient sync may move them into one flat buffer after the stage was built
        (``sync.strategy = "hierarchical"``), and weights must not be saved as activations."""
        keys = {storage_key(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
        if keys != self._param_keys:
            self.exclude = (self.exclude - self._param_keys) | keys
            self._param_keys = keys

    @contextmanager
    def capture(self, inputs: tuple, swap: bool = False, segment: tuple | None = None):
        """Record (and with ``swap``, move to the host) what autograd saves in the body.

        Tensors sharing a storage with the layer's inputs are never swapped: the segment
        holds its inputs anyway. ``segment`` = ``(layer, mb)`` lets a peer swap
        (:attr:`peer`) claim the tensors its plan names.
        """
        cap = Capture(input_keys=set(_tensor_storages(inputs)))
        peer = self.peer if segment is not None else None

        # pack returns t.detach(), never t: a saved output of an op packed as itself holds its
        # own grad_fn, a cycle through C++ autograd nodes that Python's GC cannot free. A
        # split backward (B, then W over the weights only) never releases the nodes W does
        # not reach, so each run leaked its graphs and this store (~150 MB per trainer).
        def pack(t: torch.Tensor):
            key = storage_key(t)
            if key in self.exclude:
                return t.detach()
            if peer is not None and key not in cap.input_keys:
                handle = peer.pack(t, *segment)
                if handle is not None:
                    return handle
            if swap and key not in cap.input_keys:
                s = self.swap.pack(t, cap.copies)
                cap.swapped.append(s)
                return s
            cap.saved[key] = t.untyped_storage().nbytes()
            return t.detach()

        def unpack(x):
            if isinstance(x, Swapped):
                return self.swap.unpack(x)
            return peer.unpack(x) if peer is not None and peer.owns(x) else x

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield cap
        finally:
            if peer is not None:
                peer.end_forward(*segment)

    def put(self, seg: Segment) -> None:
        """Hold a segment: its saved storages, its inputs and its outputs count as held."""
        key = (seg.layer, seg.mb)
        if key in self._segments:
            raise RuntimeError(f"layer {seg.layer} micro-batch {seg.mb} is already held")
        for k, n in {**_tensor_storages(seg.inputs), **_tensor_storages(seg.outputs)}.items():
            if k not in self.exclude:
                seg.storages[k] = n
        self._segments[key] = seg
        for k, n in seg.storages.items():
            if self._refs[k] == 0:
                self.bytes += n
                self._sizes[k] = n
            self._refs[k] += 1
        self.host_bytes += sum(s.nbytes for s in seg.swapped)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_microbatches = max(self.peak_microbatches, self.held_units())

    def pop(self, layer: int, mb: int) -> Segment:
        """Release and return the segment of ``layer`` on micro-batch ``mb``."""
        try:
            seg = self._segments.pop((layer, mb))
        except KeyError:
            raise RuntimeError(f"no activations held for layer {layer} micro-batch {mb}; "
                               f"backward without forward") from None
        for k in seg.storages:
            self._refs[k] -= 1
            if self._refs[k] == 0:
                self.bytes -= self._sizes.pop(k)
                del self._refs[k]
        self.host_bytes -= sum(s.nbytes for s in seg.swapped)
        return seg

    def peek(self, layer: int, mb: int) -> Segment:
        """The segment of ``layer`` on micro-batch ``mb``, still held."""
        try:
            return self._segments[(layer, mb)]
        except KeyError:
            raise RuntimeError(f"no activations held for layer {layer} micro-batch {mb}; "
                               f"backward without forward") from None

    def prefetch(self, layer: int, mb: int) -> None:
        """Start bringing a swapped segment back to the device before its backward."""
        seg = self._segments.get((layer, mb))
        if seg is not None:
            for s in seg.swapped:
                self.swap.prefetch(s)

    def add_bytes(self, nbytes: int) -> None:
        """Count (negative: release) bytes the device holds outside segments (peer swap)."""
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    @contextmanager
    def transient(self, nbytes: int):
        """Count ``nbytes`` as held while the body runs (activations brought back)."""
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        try:
            yield
        finally:
            self.bytes -= nbytes

    def microbatches(self) -> set[int]:
        """Micro-batches with at least one segment held."""
        return {mb for _, mb in self._segments}

    def held_units(self) -> int:
        """Micro-batches held, counted per chunk when :attr:`chunk_of` is set (a micro-batch
        held by two chunks of this rank counts twice: each holds its own activations)."""
        if not self.chunk_of:
            return len(self.microbatches())
        return len({(self.chunk_of.get(layer, -1), mb) for layer, mb in self._segments})

    def held(self) -> list[tuple[int, int]]:
        """``(layer, mb)`` of every held segment."""
        return list(self._segments)

    def reset_peaks(self) -> None:
        """Start a new accounting window (each step)."""
        self.peak_bytes = self.bytes
        self.peak_host_bytes = self.host_bytes
        self.peak_microbatches = self.held_units()
