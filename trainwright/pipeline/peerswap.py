"""Runtime peer swap: saved tensors go, in chunks, to other ranks' memory.

The activation store's pack hook (:meth:`ActivationStore.capture`) hands every saved
storage to :meth:`PeerSwap.pack`. If the plan names it (by layer and by the order of first
pack within the layer's forward, the key of :mod:`trainwright.observe.tensor_profile`), its bytes
are split into the planned chunks and sent with ``torch.distributed.isend`` to the peer
ranks (gloo here, NCCL over NVLink on CUDA), and autograd keeps only a
:class:`PeerHandle`. Peers hold the chunks in a peer store until they send them back; the
owner receives them into one buffer per tensor before the layer's backward, and
:meth:`PeerSwap.unpack` rebuilds each saved view on it.

Every transfer is an action of both ranks' schedules
(:func:`~trainwright.schedule.peer.with_peer_swap`: ``PEER_SEND``,
``PEER_FETCH``, ``PEER_WAIT`` on the owner; ``PEER_RECV``, ``PEER_RETURN``,
``PEER_SETTLE`` on the peer),
which the runtime executes through :meth:`PeerSwap.extensions` and the simulator replays.
Transfers use their own process group, so they never match a pipeline send by mistake.

Metadata table (per tensor): chunk count, chunk sizes, target ranks
(:class:`TensorMeta`). A tensor may also have host chunks (target :data:`HOST`, where the
planner found no peer with room or a fast enough link for that piece): those bytes are
copied to host memory at pack time and back into the tensor's buffer when it is fetched.
Per-device usage: every byte this rank holds for backward or for
a peer is added to its store's ``bytes`` (and so to its measured peak): chunks being
sent during the forward, chunks held for owners, buffers fetched back for backward.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainwright.dist import collective as coll
from trainwright.errors import CommError
from trainwright.schedule.actions import Action, ActionKind

__all__ = ["HOST", "ChunkMeta", "TensorMeta", "PeerHandle", "PeerSwap", "metadata_table"]

HOST = -1
"""Chunk rank meaning host memory (the plan's target ``-1``)."""


@dataclass(frozen=True)
class ChunkMeta:
    """One chunk: the rank holding it (:data:`HOST`: host memory) and its bytes."""

    rank: int
    nbytes: int


@dataclass(frozen=True)
class TensorMeta:
    """The metadata table's row for one peer-swapped tensor (per micro-batch)."""

    layer: int
    index: int
    nbytes: int
    chunks: tuple[ChunkMeta, ...]

    @property
    def n_chunks(self) -> int:
        """Chunk count."""
        return len(self.chunks)


def metadata_table(tensors: list[dict], rank_of_stage: dict[int, int]) -> list[TensorMeta]:
    """Rows for one owner from a plan's per-tensor entries (``trainwright plan`` JSON form:
    ``{"layer", "index", "bytes", "policy", "chunks": [[peer stage, bytes], ...]}``); a
    chunk with target -1 stays in host memory (:data:`HOST`). Tensors without a peer chunk
    are the swap policy's, not peer swap, and are left out."""
    rows = []
    for t in tensors:
        chunks = tuple(ChunkMeta(rank_of_stage[s] if s >= 0 else HOST, n)
                       for s, n in t["chunks"] if n)
        if t["policy"] == "peer" and any(c.rank != HOST for c in chunks):
            if sum(c.nbytes for c in chunks) != t["bytes"]:
                raise ValueError(f"layer {t['layer']} tensor {t['index']}: chunks "
                                 f"{[c.nbytes for c in chunks]} do not add up to "
                                 f"{t['bytes']} bytes")
            rows.append(TensorMeta(t["layer"], t["index"], t["bytes"], chunks))
    return sorted(rows, key=lambda r: (r.layer, r.index))


@dataclass
class PeerHandle:
    """What autograd keeps for a peer-swapped tensor: how to rebuild the view."""

    layer: int
    mb: int
    index: int
    dtype: torch.dtype
    offset: int
    size: tuple
    stride: tuple


@dataclass
class _Outgoing:
    works: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    nbytes: int = 0


class PeerSwap:
    """One rank's side of peer swap, as owner of its tables and as peer of other owners.

    Args:
        rank: this rank (global).
        table: this rank's own metadata rows (what it sends out).
        tables: every owner rank's rows (to know what to receive and hold for it).
        store: this rank's activation store (byte accounting).
        group: the process group for peer transfers (all ranks; see :meth:`new_group`).
        rank_of_stage: stage -> rank (schedules name peers by stage).
        timeout_s: deadline of every wait.
    """

    def __init__(self, rank: int, table: list[TensorMeta], tables: dict[int, list[TensorMeta]],
                 store, group, rank_of_stage: dict[int, int], timeout_s: float = 60.0):
        self.rank, self.store, self.group = rank, store, group
        self.rank_of_stage = dict(rank_of_stage)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.table = {(r.layer, r.index): r for r in table}
        self.tables = tables
        self._index: dict[tuple[int, int], dict] = {}  # (layer, mb) -> storage -> (i, storage)
        self._sent: dict[tuple[int, int], _Outgoing] = {}  # (mb, peer) -> pending sends
        self._fetch: dict[int, dict[tuple[int, int], torch.Tensor]] = {}  # mb -> buffers
        self._fetch_works: dict[tuple[int, int], list] = {}  # (mb, peer) -> works
        self._held: dict[tuple[int, int], tuple[list, list]] = {}  # (owner, mb) -> works, bufs
        self._returning: dict[tuple[int, int], tuple[list, list]] = {}  # sends back, bufs
        self._host: dict[tuple[int, int, int], list] = {}  # (mb, layer, index) -> host chunks
        self.sent_bytes = 0
        self.held_bytes = 0
        """Bytes this rank holds for other ranks now."""
        self.peak_held_bytes = 0

    @staticmethod
    def new_group():
        """A process group for peer transfers (collective: every rank calls it)."""
        return dist.new_group()

    # ---- owner side: pack / unpack (inside autograd's hooks) -------------------------

    def owns(self, x) -> bool:
        """Whether ``x`` is one of this swap's handles."""
        return isinstance(x, PeerHandle)

    def pack(self, t: torch.Tensor, layer: int, mb: int) -> PeerHandle | None:
        """Send ``t``'s storage to its peers if the plan names it; else None (keep it)."""
        seen = self._index.setdefault((layer, mb), {})
        storage = t.untyped_storage()
        sid = storage.data_ptr()
        first = sid not in seen
        if first:
            # hold the storage until the layer's forward ends (end_forward): a swapped-out
            # tensor's freed address could otherwise come back for a later tensor of the
            # same forward, which would then look "seen" and shift every later index
            seen[sid] = (len(seen), storage)
        index = seen[sid][0]
        meta = self.table.get((layer, index))
        if meta is None:
            return None
        if first:
            self._send(t, meta, mb)
        return PeerHandle(layer, mb, index, t.dtype, t.storage_offset(), tuple(t.shape),
                          tuple(t.stride()))

    def end_forward(self, layer: int, mb: int) -> None:
        """The forward of ``layer`` on micro-batch ``mb`` is over: forget its storages."""
        self._index.pop((layer, mb), None)

    def _send(self, t: torch.Tensor, meta: TensorMeta, mb: int) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() != meta.nbytes:
            raise CommError(f"rank {self.rank}: layer {meta.layer} tensor {meta.index} has "
                            f"{storage.nbytes()} bytes but the peer-swap plan says "
                            f"{meta.nbytes}; re-plan with this batch shape")
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        start, sent = 0, 0
        for c in meta.chunks:
            piece = flat[start : start + c.nbytes]
            if c.rank == HOST:
                self._host.setdefault((mb, meta.layer, meta.index), []).append(
                    (start, piece.to("cpu", copy=True)))
                start += c.nbytes
                continue
            start += c.nbytes
            out = self._sent.setdefault((mb, c.rank), _Outgoing())
            out.works.append(coll.isend(piece, dst=c.rank, group=self.group))
            out.buffers.append(piece)
            out.nbytes += c.nbytes
            sent += c.nbytes
        self.sent_bytes += sent
        self.store.add_bytes(sent)  # held until PEER_SEND confirms delivery

    def unpack(self, h: PeerHandle) -> torch.Tensor:
        """The saved view rebuilt on the buffer fetched back (``PEER_WAIT`` has run)."""
        try:
            buf = self._fetch[h.mb][(h.layer, h.index)]
        except KeyError:
            raise CommError(f"rank {self.rank}: layer {h.layer} tensor {h.index} of "
                            f"micro-batch {h.mb} was not fetched back before its backward; "
                            f"the schedule lacks PEER_FETCH/PEER_WAIT") from None
        return torch.empty(0, dtype=h.dtype, device=buf.device).set_(
            buf.untyped_storage(), h.offset, h.size, h.stride)

    # ---- schedule actions ------------------------------------------------------------

    def _wait(self, works: list, what: str) -> None:
        for w in works:
            try:
                w.wait(timeout=self.timeout)
            except Exception as exc:
                raise CommError(f"rank {self.rank}: peer swap {what} failed: "
                                f"{str(exc).splitlines()[0][:200]}") from exc

    def peer_send(self, a: Action) -> None:
        """Owner, after ``F(m)``: wait until the chunks for ``a.peer`` were delivered."""
        out = self._sent.pop((a.mb, self._peer_rank(a)), None)
        if out is not None:
            self._wait(out.works, f"send of micro-batch {a.mb} to rank {self._peer_rank(a)}")
            self.store.add_bytes(-out.nbytes)

    def peer_fetch(self, a: Action) -> None:
        """Owner, before ``RECV_B(m)``: post the receives of the chunks coming back."""
        peer = self._peer_rank(a)
        bufs = self._fetch.setdefault(a.mb, {})
        works = []
        for meta in self.table.values():
            key = (meta.layer, meta.index)
            if key not in bufs:
                bufs[key] = torch.empty(meta.nbytes, dtype=torch.uint8, device=self._device())
                self.store.add_bytes(meta.nbytes)
                for offset, piece in self._host.pop((a.mb, *key), []):  # host chunks back
                    bufs[key][offset : offset + piece.numel()].copy_(piece)
            start = 0
            for c in meta.chunks:
                if c.rank == peer:
                    works.append(coll.irecv(bufs[key][start : start + c.nbytes], src=peer,
                                            group=self.group))
                start += c.nbytes
        self._fetch_works[(a.mb, peer)] = works

    def peer_wait(self, a: Action) -> None:
        """Owner, right before ``B(m)``: wait for the chunks from ``a.peer``."""
        works = self._fetch_works.pop((a.mb, self._peer_rank(a)), [])
        self._wait(works, f"fetch of micro-batch {a.mb} from rank {self._peer_rank(a)}")

    def after(self, a: Action) -> None:
        """After every action: release the buffers fetched back once ``B(m)`` is done."""
        if a.kind == ActionKind.B and a.mb in self._fetch:
            self.store.add_bytes(-sum(b.numel() for b in self._fetch.pop(a.mb).values()))
        if a.kind == ActionKind.SYNC:
            self._index.clear()  # forwards that raised never reached end_forward

    def peer_recv(self, a: Action) -> None:
        """Peer: post the receives of owner ``a.peer``'s chunks of micro-batch ``a.mb``."""
        owner = self._peer_rank(a)
        works, bufs = [], []
        for meta in self.tables.get(owner, []):
            for c in meta.chunks:
                if c.rank == self.rank:
                    b = torch.empty(c.nbytes, dtype=torch.uint8, device=self._device())
                    works.append(coll.irecv(b, src=owner, group=self.group))
                    bufs.append(b)
        nbytes = sum(b.numel() for b in bufs)
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.store.add_bytes(nbytes)
        self._held[(owner, a.mb)] = (works, bufs)

    def peer_return(self, a: Action) -> None:
        """Peer: wait for the owner's chunks of ``a.mb`` and post their sends back."""
        owner = self._peer_rank(a)
        works, bufs = self._held.pop((owner, a.mb))
        self._wait(works, f"receive of micro-batch {a.mb} from rank {owner}")
        sends = [coll.isend(b, dst=owner, group=self.group) for b in bufs]
        self._returning[(owner, a.mb)] = (sends, bufs)

    def peer_settle(self, a: Action) -> None:
        """Peer: wait until ``a.mb``'s chunks were delivered back, and free them (gloo
        reports a send complete only through ``wait``)."""
        owner = self._peer_rank(a)
        sends, bufs = self._returning.pop((owner, a.mb))
        self._wait(sends, f"return of micro-batch {a.mb} to rank {owner}")
        nbytes = sum(b.numel() for b in bufs)
        self.held_bytes -= nbytes
        self.store.add_bytes(-nbytes)

    def extensions(self) -> dict[ActionKind, Callable[[Action], None]]:
        """Extensions of :class:`~trainwright.pipeline.runtime.PipelineRuntime`: the
        dispatch table of the peer-swap kinds (one handler per kind of
        :data:`~trainwright.schedule.base.PEER_KINDS`); :meth:`after` runs after every
        action."""
        return {ActionKind.PEER_SEND: self.peer_send, ActionKind.PEER_FETCH: self.peer_fetch,
                ActionKind.PEER_WAIT: self.peer_wait, ActionKind.PEER_RECV: self.peer_recv,
                ActionKind.PEER_RETURN: self.peer_return,
                ActionKind.PEER_SETTLE: self.peer_settle}

    def _peer_rank(self, a: Action) -> int:
        return self.rank_of_stage[a.peer]

    def _device(self) -> torch.device:
        return self.store.swap.device
