"""Per-tensor memory policies with peer-device swap, and the stage-to-device mapping.

Pure: numbers in, plans out (no torch). Units: bytes, seconds, bytes/s.

**Tensors.** A :class:`TensorInfo` is one storage a layer saves for backward (parameters
and the layer's input excluded, views of one storage counted once), with its bytes and its
*live interval*: seconds from the forward that packs it to the backward that unpacks it,
from the liveness analysis over the schedule (:func:`trainwright.plan.simulate.liveness`).

**Policies** (per tensor): ``keep``; ``peer`` (split into chunks held by other devices over
direct links: device-to-device swap); ``host`` (swap to host memory); ``recompute`` (a whole
layer: its forward runs again before its backward, so every tensor of the layer is freed).

**Rules** (:class:`Rules`), in this order:

1. ``interval < short_s`` -> peer swap; ``interval > long_s`` -> host swap; in between, peer
   if it can be placed, else host. Defaults (None) are per tensor: ``short_s`` = the
   host round trip ``2 * bytes / host_bandwidth`` (host swap could not hide inside the
   interval), ``long_s`` = twice that (host swap hides with 2x slack).
2. A peer tensor is split over its candidate peers in proportion to the bandwidth of the
   links to them (:func:`split_by_bandwidth`: integer bytes, summing exactly to the
   tensor). Candidates of stage ``s`` are devices running later stages (``t > s``: their
   schedules have a point after the owner's forward and before its backward, see
   :mod:`trainwright.pipeline.peerswap`), joined to ``s``'s device by a link with
   ``bandwidth > 0``, with spare memory left.
3. A chunk that does not fit its peer's spare memory (it is held for
   :attr:`StageMem.peer_slots` micro-batches), or whose round trip
   ``2 * chunk / link_bandwidth`` exceeds the interval, goes to recompute or host swap,
   whichever adds less time: recompute adds the layer's ``forward_s`` (nothing if the
   layer is recomputed already), host swap adds ``max(0, 2 * chunk / host_bandwidth -
   interval)``; recompute wins only when strictly cheaper.
4. A stage is processed only while over its budget; tensors are taken short-interval class
   first, then largest first.

**Memory of a stage** under a plan (per micro-batch ``held`` = layer inputs + kept tensors;
``peer_mb`` = bytes it sends to peers per micro-batch; ``transient`` = the largest
host/recompute bytes of one layer): ``required = in_flight * held + peer_mb + transient``
(a rank of several model chunks: ``held`` per chunk, weighted by each chunk's own
micro-batches in flight, :func:`trainwright.plan.memory.held_peak`; under a split
backward, plus the host/recompute bytes of the micro-batches waiting for their ``W``)
(one micro-batch's peer chunks are on the device while they are sent, or fetched back for
backward). A peer device holds ``peer_slots(owner) * chunk`` for each chunk; a plan never
puts on a device more than ``budget - its own required`` (:func:`place`).

**Mapping score** (:func:`mapping_score`): for stage-to-device mapping ``pi``,
``score = sum over heavy s, light t > s of min(excess_s, spare_t) * bw(pi(s), pi(t)) / 1e9``
(GB/s times bytes the pair can exchange: D2D bandwidth between heavy and light stages,
weighted by the memory it can free). :func:`search_mappings` enumerates injective mappings
with symmetry pruning (one mapping per orbit of the topology's automorphism group, the
lexicographically smallest) and returns them best first; ties go to the smallest mapping.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from trainwright.errors import PlanError
from trainwright.plan.memory import held_peak

__all__ = ["HOST", "TensorInfo", "StageMem", "Rules", "Chunk", "TensorPlan", "StagePlacement",
           "Placement", "split_by_bandwidth", "classify", "stage_required", "place",
           "mapping_score", "search_mappings", "brute_force_mappings", "FAMILIES"]

HOST = -1
"""Chunk target meaning host memory."""
FAMILIES = ("peer", "host", "recompute")


@dataclass(frozen=True)
class TensorInfo:
    """One saved storage of one layer, per micro-batch."""

    layer: int
    index: int
    """Order of first pack within the layer's forward (the runtime's key)."""
    nbytes: int
    interval_s: float
    """Live interval: from pack (forward) to unpack (backward)."""


@dataclass
class StageMem:
    """What the placement needs of one stage."""

    stage: int
    in_flight: int
    """Micro-batches held at the peak."""
    layers: list
    """:class:`trainwright.plan.memory.LayerMem` rows (``input_bytes`` includes the stage's
    last output on the last layer, as :func:`trainwright.pipeline.budget.layer_mems`)."""
    tensors: list[TensorInfo]
    budget: int | None
    """Activation bytes allowed on the stage's device (None: unlimited)."""
    n_micro: int = 0
    """Micro-batches per step (0: same as ``in_flight``)."""

    @property
    def peer_slots(self) -> int:
        """Micro-batches of this stage's chunks a peer holds at once: ``in_flight``, and up
        to as many more being returned when more micro-batches follow (see
        :mod:`trainwright.schedule.peer`)."""
        if self.n_micro > self.in_flight:
            return min(2 * self.in_flight, self.n_micro)
        return self.in_flight


@dataclass(frozen=True)
class Rules:
    """Thresholds of the placement (see the module); None = derived per tensor."""

    short_s: float | None = None
    long_s: float | None = None
    families: tuple = FAMILIES
    """Policy families allowed (benchmarks use one at a time)."""
    scale: float = 1.0
    """Multiplies the derived (per-tensor) thresholds; the planner tries larger ones when
    the simulated host link turns out busier than the per-tensor rule assumes."""


@dataclass(frozen=True)
class Chunk:
    """A piece of a tensor held elsewhere: ``target`` device (``HOST`` = host memory)."""

    target: int
    nbytes: int


@dataclass
class TensorPlan:
    """The policy of one tensor."""

    layer: int
    index: int
    nbytes: int
    policy: str
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class StagePlacement:
    """Every tensor's policy on one stage, and what the stage then needs."""

    stage: int
    device: int
    tensors: list[TensorPlan]
    required_bytes: int
    keep_bytes: int
    """Required bytes with every tensor kept."""
    added_s: float
    """Estimated time added per micro-batch (recompute + unhidden host swap)."""
    fits: bool

    def policy_counts(self) -> dict[str, int]:
        """How many tensors have each policy."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.policy] = out.get(t.policy, 0) + 1
        return out


@dataclass
class Placement:
    """The whole plan: a stage-to-device mapping and each stage's tensor policies."""

    mapping: list[int]
    stages: list[StagePlacement]
    peer_held: dict[int, int]
    """Device -> peak bytes it holds for other devices."""
    spare: dict[int, int]
    """Device -> spare bytes before peer chunks were placed."""
    score: float = 0.0

    def to_dict(self) -> dict:
        """Plain dict (JSON)."""
        return asdict(self)


def split_by_bandwidth(nbytes: int, bandwidths: list[float]) -> list[int]:
    """Split ``nbytes`` into integer chunks proportional to ``bandwidths``, summing exactly.

    Largest-remainder rounding: each chunk is ``floor(nbytes * b / sum(b))`` and the bytes
    left go one at a time to the largest fractional parts (ties to the earlier link).

    Raises:
        ValueError: no positive bandwidth, or negative inputs.
    """
    total = float(sum(bandwidths))
    if nbytes < 0 or any(b < 0 for b in bandwidths) or total <= 0:
        raise ValueError(f"need nbytes >= 0 and bandwidths >= 0 with a positive sum; got "
                         f"{nbytes}, {bandwidths}")
    exact = [nbytes * b / total for b in bandwidths]
    out = [int(x) for x in exact]
    rest = nbytes - sum(out)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:rest]:
        out[i] += 1
    return out


def classify(t: TensorInfo, host_bandwidth: float, rules: Rules) -> str:
    """``"short"`` (peer), ``"long"`` (host) or ``"middle"`` for a tensor's live interval."""
    round_trip = 2 * t.nbytes / host_bandwidth * rules.scale
    short = rules.short_s if rules.short_s is not None else round_trip
    long = rules.long_s if rules.long_s is not None else 2 * round_trip
    if t.interval_s < short:
        return "short"
    if t.interval_s > long:
        return "long"
    return "middle"


def stage_required(st: StageMem, plans: dict[tuple[int, int], TensorPlan]) -> int:
    """Required bytes of a stage under per-tensor plans (missing tensors are kept)."""
    chunk_of = {x.layer: getattr(x, "chunk", 0) for x in st.layers}
    held: dict[int, int] = {}  # per model chunk (one, with one stage per rank)
    for x in st.layers:
        held[chunk_of[x.layer]] = held.get(chunk_of[x.layer], 0) + x.input_bytes
    peer_mb = 0
    nonkeep: dict[int, int] = {}
    for t in st.tensors:
        p = plans.get((t.layer, t.index))
        pol = p.policy if p else "keep"
        if pol == "keep":
            c = chunk_of.get(t.layer, 0)
            held[c] = held.get(c, 0) + t.nbytes
            continue
        if pol == "recompute":
            nonkeep[t.layer] = nonkeep.get(t.layer, 0) + t.nbytes
            continue
        for c in p.chunks:
            if c.target == HOST:
                nonkeep[t.layer] = nonkeep.get(t.layer, 0) + c.nbytes
            else:
                peer_mb += c.nbytes
    back: dict[int, int] = {}  # split backward: brought back at B, held until W
    for layer, n in nonkeep.items():
        back[chunk_of.get(layer, 0)] = back.get(chunk_of.get(layer, 0), 0) + n
    return (held_peak(st.in_flight, held, back) + peer_mb
            + max(nonkeep.values(), default=0))


def _host_cost(nbytes: int, interval: float, host_bandwidth: float) -> float:
    return max(0.0, 2 * nbytes / host_bandwidth - interval)


def _added(st: StageMem, plans: dict, host_bandwidth: float) -> float:
    fwd = {x.layer: x.forward_s for x in st.layers}
    recomputed = {p.layer for p in plans.values() if p.policy == "recompute"}
    by_t = {(t.layer, t.index): t for t in st.tensors}
    host = sum(_host_cost(c.nbytes, by_t[k].interval_s, host_bandwidth)
               for k, p in plans.items() for c in p.chunks if c.target == HOST)
    return sum(fwd.get(layer, 0.0) for layer in recomputed) + host


def place(stages: list[StageMem], mapping: list[int], bandwidth: list[list[float]],
          host_bandwidth: float, rules: Rules = Rules()) -> Placement:
    """Choose every tensor's policy for a given stage-to-device mapping (the rules above).

    Args:
        stages: one :class:`StageMem` per stage, in stage order.
        mapping: ``mapping[s]`` = device of stage ``s`` (distinct devices).
        bandwidth: ``bandwidth[i][j]`` bytes/s between devices.
        host_bandwidth: device-host bytes/s.
        rules: thresholds and allowed families.

    Returns:
        The placement; ``fits`` per stage says whether its budget is met (a stage that
        cannot be made to fit keeps its best effort: check ``fits``).
    """
    if len(set(mapping)) != len(mapping) or len(mapping) != len(stages):
        raise PlanError(f"mapping {mapping} must give each of the {len(stages)} stages its own "
                        f"device")
    keep = {st.stage: stage_required(st, {}) for st in stages}
    spare = {mapping[i]: (max(0, st.budget - keep[st.stage]) if st.budget is not None else 0)
             for i, st in enumerate(stages)}
    free = dict(spare)
    held_for: dict[int, int] = {d: 0 for d in spare}
    results: list[StagePlacement] = []
    plans_by_stage: dict[int, dict] = {}
    order = sorted(range(len(stages)), key=lambda i: -(keep[stages[i].stage] -
                                                       (stages[i].budget or keep[stages[i].stage])))
    for i in order:
        st = stages[i]
        if st.budget is None or keep[st.stage] <= st.budget:
            plans_by_stage[i] = {}
            continue
        dev = mapping[i]
        peers = [mapping[j] for j in range(i + 1, len(stages)) if bandwidth[dev][mapping[j]] > 0]
        plans_by_stage[i] = _place_stage(st, dev, peers, free, held_for, bandwidth,
                                         host_bandwidth, rules)
    for i, st in enumerate(stages):
        plans = plans_by_stage.get(i, {})
        need = stage_required(st, plans)
        full = [plans.get((t.layer, t.index)) or TensorPlan(t.layer, t.index, t.nbytes, "keep")
                for t in st.tensors]
        results.append(StagePlacement(st.stage, mapping[i], full, need, keep[st.stage],
                                      _added(st, plans, host_bandwidth),
                                      st.budget is None or need <= st.budget))
    return Placement(list(mapping), results, held_for, spare)



def _place_stage(st: StageMem, dev: int, peers: list[int], free: dict[int, int],
                 held_for: dict[int, int], bandwidth: list[list[float]], host_bandwidth: float,
                 rules: Rules) -> dict[tuple[int, int], TensorPlan]:
    """The rules on one over-budget stage; updates ``free`` and ``held_for``."""
    placer = _StagePlacer(st, dev, peers, free, held_for, bandwidth, host_bandwidth, rules)
    return placer.run()


class _StagePlacer:
    """The state of :func:`_place_stage`: the stage's plans so far and the peers' free bytes."""

    def __init__(self, st: StageMem, dev: int, peers: list[int], free: dict[int, int],
                 held_for: dict[int, int], bandwidth: list[list[float]],
                 host_bandwidth: float, rules: Rules) -> None:
        self.st, self.dev, self.peers = st, dev, peers
        self.free, self.held_for = free, held_for
        self.bandwidth, self.host_bandwidth, self.rules = bandwidth, host_bandwidth, rules
        self.plans: dict[tuple[int, int], TensorPlan] = {}
        self.fwd = {x.layer: x.forward_s for x in st.layers}

    def run(self) -> dict[tuple[int, int], TensorPlan]:
        """Give tensors a policy, short class first then largest, until the stage fits."""
        st, rules = self.st, self.rules
        cls = {(t.layer, t.index): classify(t, self.host_bandwidth, rules) for t in st.tensors}
        rank = {"short": 0, "middle": 1, "long": 2}
        todo = sorted(st.tensors, key=lambda t: (rank[cls[(t.layer, t.index)]], -t.nbytes,
                                                 t.layer, t.index))
        for t in todo:
            if stage_required(st, self.plans) <= st.budget:
                break
            key = (t.layer, t.index)
            if key in self.plans or t.nbytes == 0:
                continue
            klass = cls[key]
            if "peer" in rules.families and klass != "long":
                self._to_peers(t)
            elif klass == "long" and "host" in rules.families:
                self.plans[key] = TensorPlan(t.layer, t.index, t.nbytes, "host",
                                             [Chunk(HOST, t.nbytes)])
            else:
                self._fallback_whole(t)
        return self.plans

    def _to_peers(self, t: TensorInfo) -> None:
        """Split ``t`` over the peers with spare memory (rules 2 and 3)."""
        cands = [p for p in self.peers if self.free[p] > 0]
        if not cands:
            self._fallback_whole(t)
            return
        chunks, gone = self._peer_chunks(t, cands)
        # gone: the layer is recomputed, so this tensor's chunks are moot; a -2 chunk: no
        # allowed fallback, so the tensor stays kept
        if gone or any(c.target == -2 for c in chunks):
            self._unreserve(chunks)
            return
        policy = "peer" if any(c.target >= 0 for c in chunks) else "host"
        self.plans[(t.layer, t.index)] = TensorPlan(t.layer, t.index, t.nbytes, policy, chunks)

    def _peer_chunks(self, t: TensorInfo, cands: list[int]) -> tuple[list[Chunk], bool]:
        """``t``'s chunks, peer chunks reserved; ``True`` once a fallback recomputes the layer
        (the chunks made so far are returned, still reserved)."""
        free, held_for, slots = self.free, self.held_for, self.st.peer_slots
        sizes = split_by_bandwidth(t.nbytes, [self.bandwidth[self.dev][p] for p in cands])
        chunks: list[Chunk] = []
        for p, n in zip(cands, sizes, strict=True):
            if n == 0:
                continue
            fits = n * slots <= free[p]
            fast = 2 * n / self.bandwidth[self.dev][p] <= t.interval_s
            if fits and fast:
                chunks.append(Chunk(p, n))
                free[p] -= n * slots
                held_for[p] += n * slots
                continue
            c = self._fallback(t, n)
            if c is None:
                return chunks, True
            chunks.append(c)
        return chunks, False

    def _unreserve(self, chunks: list[Chunk]) -> None:
        """Give the peers back the memory ``chunks`` reserved on them."""
        for c in chunks:
            if c.target >= 0:
                self.free[c.target] += c.nbytes * self.st.peer_slots
                self.held_for[c.target] -= c.nbytes * self.st.peer_slots

    def _recompute_layer(self, layer: int) -> None:
        """Recompute every tensor of ``layer``, releasing the peer memory they held."""
        for t in self.st.tensors:
            if t.layer == layer:
                old = self.plans.get((t.layer, t.index))
                if old is not None:
                    self._unreserve(old.chunks)
                self.plans[(t.layer, t.index)] = TensorPlan(t.layer, t.index, t.nbytes,
                                                            "recompute")

    def _fallback(self, t: TensorInfo, nbytes: int) -> Chunk | None:
        """Host chunk, or None after making the layer recompute (``Chunk(-2)``: neither
        family is allowed)."""
        recomputed = any(p.policy == "recompute" and p.layer == t.layer
                         for p in self.plans.values())
        r_cost = 0.0 if recomputed else self.fwd.get(t.layer, 0.0)
        h_cost = _host_cost(nbytes, t.interval_s, self.host_bandwidth)
        can_r, can_h = "recompute" in self.rules.families, "host" in self.rules.families
        if can_r and (not can_h or r_cost < h_cost):
            self._recompute_layer(t.layer)
            return None
        return Chunk(HOST, nbytes) if can_h else Chunk(-2, nbytes)

    def _fallback_whole(self, t: TensorInfo) -> None:
        """:meth:`_fallback` for all of ``t``: a host plan, or the layer recomputed."""
        c = self._fallback(t, t.nbytes)
        if c is not None and c.target == HOST:
            self.plans[(t.layer, t.index)] = TensorPlan(t.layer, t.index, t.nbytes, "host", [c])


def _excess_spare(stages: list[StageMem]) -> tuple[list[int], list[int]]:
    keep = [stage_required(st, {}) for st in stages]
    excess = [max(0, k - st.budget) if st.budget is not None else 0
              for k, st in zip(keep, stages, strict=True)]
    spare = [max(0, st.budget - k) if st.budget is not None else 0
             for k, st in zip(keep, stages, strict=True)]
    return excess, spare


def mapping_score(mapping: tuple[int, ...] | list[int], excess: list[int], spare: list[int],
                  bandwidth: list[list[float]]) -> float:
    """The planner's score of a stage-to-device mapping (see the module); higher is better."""
    n = len(mapping)
    total = 0.0
    for s in range(n):
        if excess[s] <= 0:
            continue
        for t in range(s + 1, n):
            if spare[t] > 0:
                total += min(excess[s], spare[t]) * bandwidth[mapping[s]][mapping[t]] / 1e9
    return total


def _orbits(devices: list[int], group: list[tuple[int, ...]]) -> list[int]:
    """The smallest device of each orbit of ``group`` on ``devices``."""
    seen: set[int] = set()
    reps = []
    for d in sorted(devices):
        if d in seen:
            continue
        reps.append(d)
        seen.update(g[d] for g in group)
    return reps


def search_mappings(stages: list[StageMem], bandwidth: list[list[float]],
                    automorphisms: list[tuple[int, ...]] | None = None,
                    top: int = 1) -> list[tuple[float, tuple[int, ...]]]:
    """Best ``top`` stage-to-device mappings by :func:`mapping_score`, with symmetry pruning.

    One mapping is scored per orbit of ``automorphisms`` (device permutations under which
    the bandwidth matrix and the memories are unchanged, e.g.
    :meth:`~trainwright.plan.devices.DeviceTopology.automorphisms`): at each stage the candidate
    devices are the smallest of each orbit of the subgroup fixing the devices already
    chosen, which yields exactly the lexicographically smallest mapping of every orbit.

    Returns:
        ``(score, mapping)`` pairs, best first, ties by smallest mapping.
    """
    n_dev, n_st = len(bandwidth), len(stages)
    if n_st > n_dev:
        raise PlanError(f"{n_st} stages cannot each get their own device among {n_dev}")
    group = automorphisms or [tuple(range(n_dev))]
    excess, spare = _excess_spare(stages)
    found: list[tuple[float, tuple[int, ...]]] = []

    def go(prefix: list[int], sub: list[tuple[int, ...]]) -> None:
        if len(prefix) == n_st:
            m = tuple(prefix)
            found.append((mapping_score(m, excess, spare, bandwidth), m))
            return
        rest = [d for d in range(n_dev) if d not in prefix]
        for d in _orbits(rest, sub):
            go(prefix + [d], [g for g in sub if g[d] == d])

    go([], list(group))
    found.sort(key=lambda x: (-x[0], x[1]))
    return found[:top]


def brute_force_mappings(stages: list[StageMem],
                         bandwidth: list[list[float]]) -> tuple[float, tuple[int, ...]]:
    """Reference for tests: the best mapping over every injective mapping (no pruning)."""
    excess, spare = _excess_spare(stages)
    best = None
    for m in itertools.permutations(range(len(bandwidth)), len(stages)):
        cand = (mapping_score(m, excess, spare, bandwidth), m)
        if best is None or (-cand[0], cand[1]) < (-best[0], best[1]):
            best = cand
    return best
