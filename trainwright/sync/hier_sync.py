"""The hierarchical sync itself: :class:`HierarchicalSync`, the intra-node reduce-scatter,
inter-node all-reduce, sharded update and intra-node all-gather over flat buffers.

The method and its front ends
(:class:`~trainwright.sync.hierarchical.HierarchicalDataParallel`, the pipeline's
``sync.strategy = "hierarchical"``) are described in :mod:`trainwright.sync.hierarchical`;
nodes, groups and slice sizes live in :mod:`trainwright.sync.hier_layout`.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from trainwright.config import HierarchicalConfig
from trainwright.dist import collective as coll
from trainwright.errors import CommError, ConfigError
from trainwright.sync.base import GradShard, GradSync, LayerOptimizers, WeightUpdate
from trainwright.sync.hier_layout import (
    HierGroups,
    _pieces,
    resolve_weights,
    slice_bounds,
)
from trainwright.sync.hier_shards import read_overlap, slice_state, write_shard
from trainwright.sync.hier_state import (
    clear_layer_state,
    export_layer_state,
    import_layer_state,
    sub_shards,
)

__all__ = ["HierarchicalSync", "ShardedUpdate", "OptimizerFactory"]

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


# ----------------------------------------------------------------------------- the sync

class HierarchicalSync(GradSync):
    """Hierarchical sync as a :class:`GradSync`: ``sync`` reduce-scatters inside the node and
    all-reduces each slice between nodes; ``step`` updates the owned slice with a sharded
    optimizer and all-gathers the slices inside the node.

    Args:
        groups: this rank's layout and groups (:func:`create_groups`).
        make_optimizer: builds the optimizer over a list with one flat parameter.
        cfg: the ``[hierarchical]`` section (weights, align, chunks).
        timeout_s: deadline of every wait.
        intra: ``"p2p"`` (isend/irecv, default) or ``"reduce"`` (one ``dist.reduce`` per
            slice) for the intra-node reduce-scatter.
    """

    def __init__(self, groups: HierGroups, make_optimizer: OptimizerFactory,
                 cfg: HierarchicalConfig | None = None, timeout_s: float = 300.0,
                 intra: str = "p2p"):
        if intra not in ("p2p", "reduce"):
            raise ValueError(f"intra = {intra!r}; choose 'p2p' or 'reduce'")
        self.groups, self.make_optimizer = groups, make_optimizer
        self.cfg = cfg or HierarchicalConfig()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.intra = intra
        self.params: list[nn.Parameter] = []
        self.bounds: list[tuple[int, int]] = []
        self.weights: list[float] = []
        self.flat_param: torch.Tensor | None = None
        self.flat_grad: torch.Tensor | None = None
        self.pieces: list[list[tuple[int, int]]] = []
        """Per slice, its ``chunks`` pieces ``[a, b)`` (the unit of overlap)."""
        self.offsets: list[int] = []
        """Start of each parameter in the flat vector."""
        self.shards: list[nn.Parameter] = []
        """The owned slice cut at piece and parameter boundaries (sub-shards), as parameters
        aliasing ``flat_param``; ``shard_map`` says where each one lies."""
        self.shard_map: list[tuple[int, int, int, int]] = []
        self._import_pending = False
        self._pending: list | None = None
        self._averaged = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.timings: dict[str, float] = {}

    # --- set-up -------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Ranks of the whole sync group."""
        return len(self.groups.layout.order)

    @property
    def owned(self) -> tuple[int, int]:
        """``[lo, hi)`` of the flat parameter vector this rank owns."""
        return self.bounds[self.groups.local]

    def setup(self, params: list[nn.Parameter], weights: Sequence[float] | None = None) -> None:
        """Move ``params`` (and their gradients) into flat buffers and build the sharded
        optimizer. Collective within the sync group (the weights are agreed)."""
        params = list(params)
        if not params:
            raise ValueError("hierarchical sync needs at least one parameter")
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) != 1:
            raise ConfigError(f"hierarchical sync needs one dtype and device for all parameters "
                              f"of a stage, found {sorted(map(str, dtypes))}")
        device = params[0].device
        if weights is not None:
            self.weights = list(weights)
        elif not self.weights:  # agreed once; a change of layers re-cuts the same proportions
            self.weights = resolve_weights(self.cfg, self.groups, device)
        numel = sum(p.numel() for p in params)
        self.bounds = slice_bounds(numel, self.weights, self.cfg.align)
        with torch.no_grad():
            self.flat_param = torch.cat([p.detach().reshape(-1) for p in params])
            self.flat_grad = torch.zeros_like(self.flat_param)
            off = 0
            for p in params:
                n = p.numel()
                if p.grad is not None:
                    self.flat_grad[off : off + n].copy_(p.grad.reshape(-1))
                p.data = self.flat_param[off : off + n].view_as(p)
                p.grad = self.flat_grad[off : off + n].view_as(p)
                off += n
        self.params = params
        sizes = [p.numel() for p in params]
        self.offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self.pieces = [_pieces(lo, hi, self.cfg.chunks) for lo, hi in self.bounds]
        # sub-shards alias the flat buffer: a piece can be updated (and its all-gather
        # started) as soon as its inter-node all-reduce is done; cutting at parameter
        # boundaries too gives every parameter's share its own optimizer state
        self.shard_map = sub_shards(self.pieces[self.groups.local], self.offsets, sizes)
        self.shards = [nn.Parameter(self.flat_param[a:b]) for _, _, a, b in self.shard_map]
        self.optimizer = self.make_optimizer(self.shards) if self.shards else None
        self._import_pending = True

    # --- following the stage's layers -------------------------------------------------
    def attach(self, modules: list) -> None:
        """The stage's layers; when they differ from the flat buffers' (a migration or a
        model edit), the buffers and slices are rebuilt at the next :meth:`sync`."""
        params = [p for m in modules for p in m.parameters()]
        if self.flat_param is None or [id(p) for p in params] == [id(p) for p in self.params]:
            return
        if self.optimizer is not None and self.optimizer.state:
            raise RuntimeError("the stage's layers changed while the sharded optimizer still "
                               "holds their state; call layers_changing(slots) before the "
                               "change")
        self.flat_param = self.flat_grad = None

    def layers_changing(self, slots: list) -> None:
        """The stage's layers are about to change: hand every parameter's optimizer state
        back to its layer's own optimizer (so it can migrate with the layer) and rebuild the
        slices at the next :meth:`sync`. Collective within the sync group."""
        if self.flat_param is None:
            return
        export_layer_state(self, slots)
        self.optimizer = None
        self.flat_param = self.flat_grad = None
        self.shards, self.shard_map = [], []

    @contextlib.contextmanager
    def full_state(self, slots: list) -> Iterator[None]:
        """Inside: every layer's own optimizer holds its full state (gathered from the
        node), e.g. for a checkpoint; afterwards the sharded copy is again the only one.
        Collective within the sync group."""
        if self.flat_param is None or self._import_pending:
            yield  # nothing sharded yet: the layers' optimizers already hold the state
            return
        export_layer_state(self, slots)
        try:
            yield
        finally:
            clear_layer_state(slots)

    def _gather_grads(self) -> None:
        """Make every parameter's gradient the view into ``flat_grad`` (copy if replaced)."""
        off = 0
        for p in self.params:
            n = p.numel()
            view = self.flat_grad[off : off + n]
            if p.grad is None:
                view.zero_()
                p.grad = view.view_as(p)
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)
            off += n

    # --- communication -------------------------------------------------------------
    def _wait(self, work, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise CommError(f"rank {self.groups.rank}: {what} failed: {exc}") from exc
        if ok is False:
            raise CommError(f"rank {self.groups.rank}: {what} missed its "
                            f"{self.timeout.total_seconds():.0f} s deadline")

    def _reduce_scatter_p2p(self) -> list:
        """Post every piece's sends and receives, then sum and all-reduce piece by piece."""
        g, me = self.groups, self.groups.local
        chunks, ranks, pieces = self.cfg.chunks, self.groups.intra_ranks, self.pieces
        sends, recvs = [], [[] for _ in range(chunks)]
        for c in range(chunks):
            for j, peer in enumerate(ranks):
                if j == me:
                    continue
                a, b = pieces[j][c]
                if b > a:
                    sends.append(coll.isend(self.flat_grad[a:b], dst=peer, group=g.intra_group,
                                            tag=c))
                a, b = pieces[me][c]
                if b > a:
                    buf = torch.empty(b - a, dtype=self.flat_grad.dtype,
                                      device=self.flat_grad.device)
                    recvs[c].append((coll.irecv(buf, src=peer, group=g.intra_group, tag=c), buf))
        reduces = []
        for c in range(chunks):
            a, b = pieces[me][c]
            for work, buf in recvs[c]:
                self._wait(work, "intra-node receive")
                self.flat_grad[a:b].add_(buf)
            recvs[c] = []
            if b > a:
                reduces.append((c, a, b, self._all_reduce(a, b)))
        for work in sends:
            self._wait(work, "intra-node send")
        return reduces

    def _reduce_scatter_reduce(self) -> list:
        """One ``dist.reduce`` per slice piece to its owner, then the inter-node all-reduce."""
        g, me = self.groups, self.groups.local
        ranks, pieces = g.intra_ranks, self.pieces
        reduces = []
        for c in range(self.cfg.chunks):
            works = []
            for j, owner in enumerate(ranks):
                a, b = pieces[j][c]
                if b > a:  # non-owners' buffers are scratch: their slices are cleared at step
                    works.append(coll.reduce(self.flat_grad[a:b], dst=owner,
                                             group=g.intra_group, async_op=True))
            for work in works:
                self._wait(work, "intra-node reduce")
            a, b = pieces[me][c]
            if b > a:
                reduces.append((c, a, b, self._all_reduce(a, b)))
        return reduces

    def _all_reduce(self, a: int, b: int):
        """Start the inter-node all-reduce of ``flat_grad[a:b]`` (None with one node)."""
        if self.groups.layout.nodes == 1:
            return None
        return coll.all_reduce(self.flat_grad[a:b], group=self.groups.inter_group,
                               async_op=True)

    def sync(self, params: list[nn.Parameter]) -> None:
        """Reduce-scatter inside the node and *start* the inter-node all-reduce of every
        piece of the owned slice. :meth:`step` finishes each piece as it arrives (so the
        update and all-gather of one piece overlap the all-reduce of the next); call
        :meth:`wait_sync` first if you need the averaged slice before ``step``."""
        t0 = time.perf_counter()
        if self.flat_param is None:
            self.setup(list(params))
        elif [id(p) for p in params] != [id(p) for p in self.params]:
            raise RuntimeError("HierarchicalSync.sync() got other parameters than its flat "
                               "buffers hold; call attach(modules) when the layers change")
        self._gather_grads()
        if self.groups.layout.ranks_per_node > 1:
            self._pending = (self._reduce_scatter_p2p() if self.intra == "p2p"
                             else self._reduce_scatter_reduce())
        else:  # one rank per node: the whole gradient is the slice
            self._pending = [(c, a, b, self._all_reduce(a, b))
                             for c, (a, b) in enumerate(self.pieces[0]) if b > a]
        self._averaged = False
        self.timings["sync_s"] = time.perf_counter() - t0

    def _finish_piece(self, a: int, b: int, work) -> None:
        if work is not None:
            self._wait(work, "inter-node all-reduce")
        self.flat_grad[a:b].div_(self.world)

    def wait_sync(self) -> None:
        """Wait for every pending all-reduce: ``flat_grad[lo:hi]`` then holds the mean
        gradient of the owned slice (the rest of ``flat_grad`` is scratch)."""
        if self._pending is None or self._averaged:
            return
        for _, a, b, work in self._pending:
            self._finish_piece(a, b, work)
        self._averaged = True

    def weight_update(self, stage) -> WeightUpdate:
        """The sharded optimizer step (:meth:`sharded_step`) over the stage's layers."""
        return ShardedUpdate(self, stage)

    def grad_shard(self) -> GradShard:
        """The owned slice of ``flat_grad``, averaged (waits for the sync), shared with the
        node's other ranks."""
        self.wait_sync()
        lo, hi = self.owned
        group = self.groups.intra_group if self.groups.layout.ranks_per_node > 1 else None
        return GradShard(self.flat_grad, lo, hi, group)

    def sharded_step(self, slots: list | None = None) -> None:
        """Per piece of the owned slice: wait for its all-reduce, update it (optimizer state
        for the owned slice only), send it to the node's other ranks; then wait for theirs
        and clear the gradients. ``slots`` (the pipeline's layers): the first step after
        the slices were (re)built takes the state their own optimizers hold (a resumed
        checkpoint, layers that migrated here) into the shards."""
        if self._pending is None:
            raise RuntimeError("HierarchicalSync.sharded_step() without sync(): call sync() "
                               "after backward")
        if self._import_pending and self.optimizer is not None and slots:
            import_layer_state(self, slots)
        self._import_pending = False
        t0 = time.perf_counter()
        g, me, update_s = self.groups, self.groups.local, 0.0
        works = []
        peers = [r for j, r in enumerate(g.intra_ranks) if j != me]
        for j, peer in enumerate(g.intra_ranks):  # post every all-gather receive up front
            if j != me:
                for c, (a, b) in enumerate(self.pieces[j]):
                    if b > a:
                        works.append(coll.irecv(self.flat_param[a:b], src=peer,
                                                group=g.intra_group, tag=c))
        for c, a, b, work in self._pending:
            if not self._averaged:
                self._finish_piece(a, b, work)
            u0 = time.perf_counter()
            mine = [(shard, sa, sb) for shard, (sc, _, sa, sb)
                    in zip(self.shards, self.shard_map, strict=True) if sc == c]
            with torch.no_grad():
                for shard, sa, sb in mine:
                    shard.grad = self.flat_grad[sa:sb]
                self.optimizer.step()  # the sub-shards of other pieces have no .grad
                for shard, _, _ in mine:
                    shard.grad = None
            update_s += time.perf_counter() - u0
            for peer in peers:
                works.append(coll.isend(self.flat_param[a:b], dst=peer, group=g.intra_group,
                                        tag=c))
        for work in works:
            self._wait(work, "intra-node all-gather")
        self.flat_grad.zero_()
        self._pending, self._averaged = None, False
        self.timings["update_s"] = update_s
        self.timings["step_s"] = time.perf_counter() - t0
        self.timings["all_gather_s"] = self.timings["step_s"] - update_s

    def all_gather(self) -> None:
        """Intra-node all-gather of the whole slices, straight into ``flat_param``."""
        g, me = self.groups, self.groups.local
        if g.layout.ranks_per_node == 1:
            return
        lo, hi = self.owned
        works = []
        for j, peer in enumerate(g.intra_ranks):
            if j == me:
                continue
            a, b = self.bounds[j]
            if hi > lo:
                works.append(coll.isend(self.flat_param[lo:hi], dst=peer, group=g.intra_group))
            if b > a:
                works.append(coll.irecv(self.flat_param[a:b], src=peer, group=g.intra_group))
        for work in works:
            self._wait(work, "intra-node all-gather")

    # --- accounting and checkpoints --------------------------------------------------
    def optimizer_state_bytes(self, per_element_only: bool = False) -> int:
        """Bytes of the sharded optimizer's state on this rank (``per_element_only``: only
        tensors shaped like the shard, e.g. Adam's moments, not its step counter)."""
        if self.optimizer is None:
            return 0
        total = 0
        for param, state in self.optimizer.state.items():
            for t in state.values():
                if isinstance(t, torch.Tensor) and (
                        not per_element_only or t.shape == param.shape):
                    total += t.numel() * t.element_size()
        return total

    def save_shard(self, directory: str | Path) -> Path:
        """Write this rank's parameter slice and its optimizer state to
        ``directory/shard_RANK.pt`` (plus a small ``.json`` index), atomically."""
        lo, hi = self.owned
        g = self.groups
        meta = {"rank": g.rank, "node": g.node, "local": g.local, "lo": lo, "hi": hi,
                "numel": self.flat_param.numel()}
        return write_shard(directory, meta, self.flat_param[lo:hi],
                           slice_state(self.optimizer, len(self.shards)))

    def load_shards(self, directory: str | Path, params: list[nn.Parameter]) -> None:
        """Start-up from shards: read the parts of ``directory``'s shards that overlap this
        rank's slice (parameters and optimizer state; any number of ranks may have written
        them), then all-gather the slices inside the node to assemble the full model.
        Collective within the sync group."""
        if self.flat_param is None:
            self.setup(list(params))
        lo, hi = self.owned
        new_state, groups_state = read_overlap(directory, self.flat_param, lo, hi)
        if groups_state and new_state and self.optimizer is not None:
            mine = [(a - lo, b - lo) for _, _, a, b in self.shard_map]
            # clone everything: torch optimizers update state in place (Adam's step too)
            state = {i: {k: (v[a:b] if v.shape == (hi - lo,) else v).clone()
                         if isinstance(v, torch.Tensor) else v for k, v in new_state.items()}
                     for i, (a, b) in enumerate(mine)}
            groups = [{**groups_state[0], "params": list(range(len(mine)))}]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
            self._import_pending = False
        self.all_gather()


class ShardedUpdate(WeightUpdate):
    """The update of ``sync.strategy = "hierarchical"``: the sharded optimizer steps the
    owned slice and the node all-gathers the slices (:meth:`HierarchicalSync.sharded_step`).

    Args:
        hsync: the exchange whose sync ran this step.
        stage: the rank's stage (its layers' own optimizers take the state back when the
            layers change).
    """

    def __init__(self, hsync: HierarchicalSync, stage):
        self.hsync, self.stage = hsync, stage
        self._layers = LayerOptimizers(stage)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The sharded optimizer (the layers' own while no slice is owned here)."""
        sharded = self.hsync.optimizer
        return [sharded] if sharded is not None else self._layers.optimizers()

    def step(self) -> None:
        """Update the owned slice, all-gather the node's slices, clear the gradients."""
        self.hsync.sharded_step(self.stage.slots)

    def skip(self) -> None:
        """Drop every gradient of the stage."""
        self._layers.skip()
