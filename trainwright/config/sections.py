"""The sections of the run configuration: one pydantic model per TOML section, a docstring
under every field (pydantic keeps it as the field's description, and
docs/configuration.md's table is generated from it by ``tools/config_table.py``).

Types and per-field ranges are checked here (an int is accepted where a float is expected;
a bool is not an int and a string is not a number); rules that involve several keys live
on :class:`~trainwright.config.Config`. Every failure is raised as a one-line
:class:`~trainwright.errors.ConfigError` naming ``section.key``, the value and what is allowed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from trainwright.config.messages import Allowed, one_line
from trainwright.errors import ConfigError

__all__ = ["Section", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig",
           "MemoryConfig", "SyncConfig", "HierarchicalConfig", "TokenRingConfig",
           "RebalanceConfig", "EvalConfig", "RunConfig", "ObserveConfig", "RuntimeConfig",
           "FaultConfig",
           "SECTIONS"]

MEASURED = Allowed("must be >= 0 (0 = measure at start)")


def _not_zero(value: int) -> int:
    """Reject 0 for keys whose "off" value is -1 and whose steps count from 1."""
    if value == 0:
        raise PydanticCustomError("range", "0 is not a step")
    return value


NEVER_OR_STEP = Annotated[int, Field(ge=-1), AfterValidator(_not_zero),
                          Allowed("must be -1 (never) or a step >= 1")]
"""A step number counted from 1, or -1 for never (fault injection)."""
UNIT = Annotated[float, Field(ge=0, le=1)]
"""A fraction in [0, 1]."""


class Section(BaseModel):
    """Base of the section models: unknown keys and loose types are errors, assignments are
    checked too, and a failure is raised as a one-line ConfigError."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True,
                              use_attribute_docstrings=True, allow_inf_nan=False)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise one_line(exc, type(self), _name(type(self))) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise one_line(exc, type(self), _name(type(self))) from None


def _name(cls: type) -> str:
    """The TOML section name of a section class."""
    return next((name for name, c in SECTIONS.items() if c is cls), cls.__name__)


class ModelConfig(Section):
    """``[model]``: the model to train, built in or from a factory."""

    name: Literal["gpt", "mlp"] = "gpt"
    """Built-in model: ``"gpt"`` (embedding, blocks, head) or ``"mlp"``."""
    factory: str = ""
    """Your own model, ``"package.module:function"``; the function (given the Config if it
    takes an argument) returns an
    ``nn.Sequential``, a list of layers, or ``(module, example_args)`` to capture with
    ``torch.export`` and cut into layers. Overrides ``name``."""
    n_blocks: PositiveInt = 4
    """GPT: transformer blocks. MLP: hidden layers."""
    d_model: PositiveInt = 128
    """GPT: residual width. MLP: hidden width."""
    n_heads: PositiveInt = 4
    """GPT: attention heads (must divide d_model)."""
    context: PositiveInt = 64
    """GPT: sequence length."""
    d_in: PositiveInt = 32
    """MLP: input features."""
    n_classes: PositiveInt = 10
    """MLP: output classes."""
    group_by: Literal["auto", "top", "blocks"] = "auto"
    """How a captured ``(module, example_args)`` factory model is cut into layers:
    ``"auto"`` opens the module holding the block list (Hugging Face ``transformer.h``,
    ``model.layers``): ``embed``, one layer per block, ``head``; ``"top"``: one layer per
    top-level child (and per item of a top-level ``ModuleList``); ``"blocks"``: also opens
    every module that holds a ``ModuleList`` (finest). See docs/models.md."""

    @property
    def n_layers(self) -> int | None:
        """Layers the pipeline partitions: GPT = blocks + embedding + head, MLP = hidden + 1;
        None for a factory model (known once it is built)."""
        if self.factory:
            return None
        return self.n_blocks + (2 if self.name == "gpt" else 1)


class DataConfig(Section):
    """``[data]``: where the batches come from."""

    name: Literal["stdlib", "synthetic", "text", "hf"] = "stdlib"
    """``"stdlib"`` (byte-level text of Python's own sources), ``"synthetic"``, ``"text"``
    (your text files, ``path``) or ``"hf"`` (a Hugging Face data set, ``dataset``; needs
    ``pip install 'trainwright[hf-data]'``)."""
    factory: str = ""
    """Your own data, ``"package.module:function"`` called with the Config; returns an
    object with ``batch(step, batch_size) -> (inputs, targets)`` (same on every rank), or a
    ``torch.utils.data.Dataset`` / ``IterableDataset`` of ``(input, target)`` items (or a
    ``(train, validation)`` pair), sharded per replica as ``DistributedSampler`` does."""
    max_bytes: PositiveInt = 2_000_000
    """stdlib corpus: bytes to read."""
    path: str = ""
    """``name = "text"``: a text file, a glob (``"corpus/*.txt"``) or a folder (every file
    under it, recursively), read in sorted order."""
    dataset: str = ""
    """``name = "hf"``: a folder written by ``Dataset.save_to_disk``, or ``.jsonl`` /
    ``.json`` / ``.parquet`` / ``.txt`` files (a file, a glob or a folder; a text file gives
    one document per paragraph), streamed, documents packed into windows of
    ``model.context + 1`` tokens, each data-parallel replica reading its own part."""
    text_field: str = "text"
    """``name = "hf"``: the column that holds each document's text."""
    tokenizer: str = ""
    """``name = "text"`` or ``"hf"``: a local ``transformers`` tokenizer folder
    (``AutoTokenizer``) or a ``tokenizers`` JSON file; empty = bytes (vocabulary 256)."""
    val_fraction: Annotated[NonNegativeFloat, Allowed("must be in [0, 1)")] = 0.1
    """``name = "text"`` (and ``"stdlib"`` when ``eval.every`` > 0): share of the tokens, at
    the end of the corpus, held out for evaluation; ``name = "hf"``: share of the documents
    (chosen by a hash of their text)."""


class TrainConfig(Section):
    """``[train]``: steps, batches, loss, schedule and optimizer."""

    steps: PositiveInt = 120
    """Optimizer steps to run (a resumed run continues up to this number)."""
    batch_size: PositiveInt = 32
    """Global samples per step, over all data-parallel replicas."""
    micro_batches: PositiveInt = 4
    """Micro-batches per step per replica; must divide batch_size / dp."""
    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    """``"cross_entropy"`` (logits ``(..., C)``, class targets) or ``"mse"``."""
    schedule: Literal["1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v"] = "1f1b"
    """Pipeline schedule: ``"1f1b"``, ``"gpipe"``, or zero bubble (backward split into input
    and weight gradients): ``"zb-h1"`` (1F1B's peak memory, less bubble) or ``"zb-h2"``
    (more micro-batches in flight, least bubble), or several model chunks per rank:
    ``"interleaved-1f1b"`` (``parallel.virtual_stages >= 2``) or ``"zb-v"`` (zero bubble,
    two chunks per rank in a V, ``parallel.virtual_stages = 2``). See docs/schedules.md."""
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    """``"sgd"``, ``"adam"`` or ``"adamw"``."""
    lr: PositiveFloat = 3e-3
    """Learning rate (the peak, with ``lr_schedule`` and ``warmup_steps``)."""
    momentum: Annotated[float, Field(ge=0, lt=1), Allowed("must be in [0, 1)")] = 0.0
    """SGD momentum."""
    weight_decay: NonNegativeFloat = 0.0
    """Weight decay of the optimizer."""
    seed: Annotated[int, Field(ge=0, lt=2**32), Allowed("must be in 0 .. 2**32 - 1")] = 0
    """Seed for model initialisation and data order."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``"fp32"``, or autocast of every layer's forward (recompute included) to ``"bf16"``
    or ``"fp16"`` (with a loss scaler whose overflow check all ranks agree on); weights and
    optimizer state stay fp32."""
    clip_norm: NonNegativeFloat = 0.0
    """Clip gradients to this global norm over every stage and replica (as
    ``torch.nn.utils.clip_grad_norm_``); 0 = no clipping."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """After warm-up: ``"constant"``, ``"cosine"`` (to ``min_lr`` at the last step) or
    ``"linear"`` (to ``min_lr``), through ``torch.optim.lr_scheduler``."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up: step ``k <= warmup_steps`` uses ``lr * k / warmup_steps``."""
    min_lr: NonNegativeFloat = 0.0
    """Learning rate reached at the last step by the ``cosine`` and ``linear`` schedules."""
    carry_weight_grads: bool = True
    """``zb-v``: a rank leaves its last weight-gradient passes and its optimizer step to the
    start of the next step, where it would otherwise wait for the stages before it (same
    numbers, shorter steps; see docs/schedules.md). Only between two fused steps of
    ``fit`` with dense sync, no tied weights, no clipping, no fp16 and no checkpoint or
    evaluation between them; elsewhere the step runs whole."""


class ParallelConfig(Section):
    """``[parallel]``: pipeline stages, data-parallel replicas, backend."""

    pp: PositiveInt = 2
    """Pipeline stages."""
    dp: PositiveInt = 1
    """Data-parallel replicas of each stage."""
    partition: list[PositiveInt] = []
    """Layers per stage, e.g. ``[3, 3]`` (``pp * virtual_stages`` entries, in model order,
    when interleaving); empty = as even as possible."""
    mapping: list[NonNegativeInt] = []
    """Stage-to-rank mapping inside each replica's block of ``pp`` ranks: stage ``s`` runs
    on rank ``replica * pp + mapping[s]`` (a permutation, as ``trainwright plan`` chooses
    it; send/receive peers and data-parallel groups follow it); empty = the identity."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``"auto"`` (NCCL with CUDA, else gloo), ``"gloo"`` or ``"nccl"``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each rank's layers live: ``"auto"`` (CUDA with the NCCL backend, else the CPU),
    ``"cpu"`` or ``"cuda"`` (local rank ``r`` on CUDA device ``r`` mod the devices visible).
    ``"cuda"`` with ``backend = "gloo"`` runs several ranks on one GPU (NCCL refuses two
    ranks on one device): gloo moves their tensors through host memory."""
    threads_per_rank: NonNegativeInt = 0
    """Intra-op threads per rank; 0 = cores / local ranks (at least 1)."""
    bucket_mb: PositiveFloat = 25.0
    """Size of the data-parallel all-reduce buckets, MiB."""
    virtual_stages: Annotated[int, Field(ge=1, le=64), Allowed("must be in 1 .. 64")] = 1
    """Model chunks per pipeline rank (``train.schedule = "interleaved-1f1b"``, which needs
    at least 2, or ``"zb-v"``, exactly 2): the model is cut into ``pp * virtual_stages``
    stages, rank ``r`` holding stages ``r, r + pp, ...`` (ZB-V: ``r`` and ``2 pp - 1 - r``).
    1 = one stage per rank."""


class MemoryConfig(Section):
    """``[memory]``: activation limits and how to keep within them."""

    limit: Any = ""  # a size, "auto", or a list: checked by Config.stage_limits
    """Activation bytes each stage may hold: ``"512MB"``, ``536870912``, a list with one
    value per stage, ``"auto"`` (CUDA: device memory minus ``reserve``), or ``""`` for none.
    With several chunks per rank (``parallel.virtual_stages``): per rank, all its chunks."""
    planner: Literal["greedy", "optimal"] = "greedy"
    """``"greedy"`` (the adaptive pipeline's rule) or ``"optimal"`` (MILP, scipy HiGHS)."""
    policies: list[str] = []
    """Fixed per-layer policies (``"keep"``, ``"swap"``, ``"recompute"``), one per layer of
    the model, or one value for all; empty = planned from the limit."""
    host_bandwidth: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """Device-to-host copy bandwidth in bytes/s for the planner; 0 = measure at start."""
    reserve: str = "2GiB"
    """With ``limit = "auto"`` on CUDA: device memory left for parameters, optimizer state
    and workspace."""
    peer_swap: bool = False
    """Peer swap: plan every saved tensor at start (``trainwright plan``'s planner) and move
    those of stages over their ``limit`` to the spare memory of other stages, in chunks over
    point-to-point links, before recomputing or swapping to the host. Needs a ``limit``."""
    peer_bandwidth: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """With ``peer_swap``: bytes/s between stages for the planner; 0 = measure at start."""


class SyncConfig(Section):
    """``[sync]``: how data-parallel replicas agree on gradients."""

    strategy: Literal["dense", "hierarchical", "tokenring"] = "dense"
    """How data-parallel replicas agree on gradients: ``"dense"`` (bucketed all-reduce),
    ``"hierarchical"`` (hierarchical sharded sync, slices sized by memory) or ``"tokenring"``
    (the token ring, plain data parallel without a barrier)."""
    sparse: bool = False
    """Send sparse (embedding) gradients as rows + height + values."""
    sparse_path: Literal["auto", "allgather", "broadcast", "dense"] = "auto"
    """With ``sparse``: ``"auto"`` (the cost model picks per parameter and step), or always
    ``"allgather"`` (padded to the largest count), ``"broadcast"`` (one per rank with rows)
    or ``"dense"`` (all-reduce of the full table)."""
    sparse_latency_s: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """Cost model: seconds per collective call; 0 = measure at start."""
    sparse_bandwidth: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """Cost model: bytes/s a rank sends in an all-gather or broadcast; 0 = measure at start."""
    sparse_allreduce_bandwidth: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """Cost model: bytes/s of ring all-reduce traffic per rank; 0 = measure at start."""
    sparse_merge_rate: Annotated[NonNegativeFloat, MEASURED] = 0.0
    """Cost model: bytes/s of local scatter-add of gathered rows; 0 = measure at start."""
    sparse_explore: Annotated[NonNegativeFloat, Allowed(
        "must be >= 0 (0 = never try a path the cost model did not pick)")] = 2.0
    """Take a path never measured at the current transfer size once, when its estimate is
    within this factor of the cheapest, so the model learns its real cost; 0 = never."""


class HierarchicalConfig(Section):
    """``[hierarchical]``: hierarchical sharded sync over nodes."""

    ranks_per_node: Annotated[NonNegativeInt, Allowed(
        "must be 0 (ranks on one host form a node) or positive")] = 0
    """Ranks forming one node; 0 = ranks of one torchrun agent (``GROUP_RANK``), else ranks
    on the same host (set it to emulate nodes)."""
    weights: Any = "memory"  # a name or a list: checked by Config.check_hierarchical
    """How each node cuts the gradient into one slice per local rank: ``"memory"`` (in
    proportion to free device memory), ``"memory_speed"`` (free memory times a measured
    matmul speed), ``"equal"``, or a list with one positive weight per local rank. Slice
    ``j`` is the same on every node: its weight is the smallest over the nodes' rank ``j``."""
    available_memory: Any = ""  # a size or a list: checked by Config.check_hierarchical
    """CPU ranks: free memory per rank for ``weights = "memory"``: ``""`` (measured:
    MemAvailable / local ranks), a size such as ``"8GiB"``, or one size per local rank.
    CUDA ranks use ``torch.cuda.mem_get_info``."""
    align: PositiveInt = 64
    """Slice boundaries fall on multiples of this many elements (the last slice ends at the
    gradient's end)."""
    chunks: PositiveInt = 4
    """Pieces per slice, pipelined so the inter-node all-reduce of one piece overlaps the
    intra-node reduce-scatter of the next."""


class TokenRingConfig(Section):
    """``[tokenring]``: barrier-free data parallel over a token ring."""

    close_fraction: Annotated[float, Field(gt=0, le=1), Allowed("must be in (0, 1]")] = 0.9
    """A step closes once the contributions taken cover this fraction of its samples."""
    nodes: PositiveInt = 4
    """Nodes the local launcher starts (under torchrun: ``WORLD_SIZE``, one per process);
    also the number of data shards (a node trains on shard ``index`` of every global batch,
    so ``train.batch_size`` must split into it)."""
    min_nodes: PositiveInt = 2
    """When fewer members remain, the ring stops, the first node saves the model and the
    run exits non-zero."""
    rendezvous: str = ""
    """``tcp://host:port`` where nodes meet (like torchrun's ``--rdzv-endpoint``); the first
    node (under torchrun: ``RANK`` 0, so an address of its host) binds it and hosts
    formation. Empty = 127.0.0.1 on a free port (local launcher), or under torchrun a free
    port on rank 0's host published through torchrun's store as ``MASTER_ADDR:port``."""
    formation_quiet_s: PositiveFloat = 2.0
    """Formation closes after this long without a new join (or once ``nodes`` joined)."""
    token_timeout_s: PositiveFloat = 2.0
    """Quiet time after which every member sends on, once, the last token message it sent
    or received."""
    succession_s: PositiveFloat = 1.0
    """T: the k-th successor of a silent holder declares it lost after
    ``token_timeout_s + k * T`` of silence (staggered, so one node announces)."""
    idle_hold_s: PositiveFloat = 0.02
    """No longer used by the protocol (kept so existing configs load): a holder with
    nobody else ready now keeps the token for ``token_timeout_s / 4``, and nodes whose
    gradient is ready say so (*want*), so the token goes straight to them."""
    close_timeout_s: PositiveFloat = 120.0
    """Deadline for a step to close and for the gradients of a closed step to arrive."""
    batch_steps: PositiveInt = 10
    """Steps per batch boundary: after each, the first node admits standby nodes."""
    standby_timeout_s: PositiveFloat = 120.0
    """How long a standby node waits to be admitted before giving up."""
    slow_node: Annotated[int, Field(ge=-1), Allowed("must be -1 (none) or a node index")] = -1
    """Fault injection: this node index is slowed by ``slow_factor``: before each step it
    idles ``(slow_factor - 1)`` times its recent compute time (abandoning the step if the
    ring closes it meanwhile), so it also takes as little CPU as a slower machine."""
    slow_factor: PositiveFloat = 1.0
    """Fault injection: slowdown of ``slow_node``."""
    pace_s: Annotated[NonNegativeFloat, Allowed("must be >= 0 (0 = no pacing)")] = 0.0
    """Emulation (benchmarks): pad every node's forward+backward to this many seconds (the
    slow node's to ``slow_factor`` times it) by idling between forward and backward, as if
    each node had its own device; 0 = off. On a shared CPU a sleeping straggler frees cores
    for the others, which hides the straggler; pacing removes that artefact."""
    kill_nodes: list[NonNegativeInt] = []
    """Fault injection: node indices that send themselves ``kill_signal`` in step
    ``kill_step``, after computing their gradient (the ``[fault]`` section is for the
    pipeline runner)."""
    kill_step: NEVER_OR_STEP = -1
    """Fault injection: the step (1-based) in which ``kill_nodes`` die."""
    kill_signal: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL"
    """Fault injection: what ``kill_nodes`` do in ``kill_step``: ``"SIGKILL"`` (die) or
    ``"SIGSTOP"`` (freeze without dying, as a hung host: the ring drops them and the local
    launcher ends them once the ring has finished)."""
    restart_killed: bool = False
    """Fault injection: the local launcher restarts killed nodes once, as standby nodes
    that rejoin at the next batch boundary."""
    record_hashes: bool = True
    """Record a SHA-256 of the parameters after every step in ``node<i>.json`` (to check
    that replicas are bit-identical; costs a pass over the weights per step)."""
    close_grace_s: Annotated[NonNegativeFloat,
                             Allowed("must be >= 0 (0 = close at the fraction at once)")] = 0.05
    """The longest grace: a step closes as soon as every member contributed; once the
    contributions meet ``close_fraction`` it waits for the rest twice the on-time nodes'
    measured arrival spread (median of recent steps), at most this many seconds, and never
    cuts off a node that said its gradient is ready (0 = close at the fraction at once, the
    token ring's plain rule). Before any step's spread is recorded the grace is twice the
    spread of the arrivals so far. No grace for a member that missed each of the last 3
    closes by more than this (known late)."""
    slow_probability: Annotated[UNIT, Allowed("must be in [0, 1] (0 = no transient "
                                              "stragglers)")] = 0.0
    """Emulation (benchmarks): in every step every node is independently ``slow_factor``
    times slower with this probability (transient stragglers), from a pattern seeded by
    ``slow_seed`` (:func:`trainwright.tokenring.exchange.transient_slow`)."""
    slow_seed: Annotated[int, Field(ge=0, lt=2**32), Allowed("must be in 0 .. 2**32 - 1")] = 0
    """Seed of the transient-straggler pattern (the same for every system compared)."""
    record_weights: bool = False
    """Benchmarks: the first node also saves the parameters after every step
    (``weights_per_step.pt``), to measure accuracy curves without pausing training."""

    @model_validator(mode="after")
    def _node_indices(self) -> TokenRingConfig:
        """Node counts and indices agree with ``nodes``, whether or not the ring is used."""
        if self.close_grace_s > self.close_timeout_s:
            raise ConfigError(f"tokenring.close_grace_s = {self.close_grace_s} is more than "
                              f"tokenring.close_timeout_s = {self.close_timeout_s}; use a grace "
                              f"of a small share of a step's time")
        if self.min_nodes > self.nodes:
            raise ConfigError(f"tokenring.min_nodes = {self.min_nodes} is more than "
                              f"tokenring.nodes = {self.nodes}; use at most {self.nodes}")
        for key, nodes in (("slow_node", [self.slow_node]), ("kill_nodes", self.kill_nodes)):
            bad = [i for i in nodes if i >= self.nodes]
            if bad:
                raise ConfigError(f"tokenring.{key} names node {bad[0]}; node indices are "
                                  f"0..{self.nodes - 1} (tokenring.nodes = {self.nodes})")
        return self


class RebalanceConfig(Section):
    """``[rebalance]``: the adaptive pipeline's live layer migration."""

    enabled: bool = False
    """Detect unbalanced stages and migrate layers live."""
    check_every: PositiveInt = 5
    """Steps between imbalance checks (each gathers the per-layer times on the last stage)."""
    threshold_rel: UNIT = 0.1
    """Stages are balanced when ``(max - min) / max`` of their times is at most this."""
    threshold_s: NonNegativeFloat = 0.0
    """...and when ``max - min`` is at most this many seconds per micro-batch (0: unchecked)."""
    patience: PositiveInt = 2
    """Consecutive unbalanced checks before a re-partition (hysteresis against noise)."""
    cooldown: NonNegativeInt = 2
    """Checks ignored after a re-partition, while the new stage times settle."""
    smoothing: Annotated[float, Field(gt=0, le=1), Allowed("must be in (0, 1]")] = 0.5
    """Weight of the newest check in the moving average of stage times."""
    min_gain: Annotated[float, Field(ge=0, lt=1), Allowed("must be in [0, 1)")] = 0.05
    """Re-partition only when the new plan's largest stage time is at least this fraction
    below the current one (a move must pay for itself)."""
    link_bandwidth: PositiveFloat = 1e9
    """Bytes/s between neighbouring stages: prices a cut among balanced partitions."""
    switch_mb: NonNegativeInt = 0
    """Micro-batch after whose forward the moving layers change stage (0 .. micro_batches-2)."""
    at_step: Annotated[NonNegativeInt, Allowed("must be >= 0 (0: never)")] = 0
    """Manual re-partition: move to ``to`` during this step (0: never)."""
    to: list[PositiveInt] = []
    """Manual re-partition target, layers per stage (with ``at_step``)."""
    edits: str = ""
    """Dynamic model hook ``"module:function"``: ``function(step)`` returns the layers to
    insert or remove before that step (see ``trainwright.rebalance.edits``)."""


class EvalConfig(Section):
    """``[eval]``: forward-only evaluation on held-out data."""

    every: NonNegativeInt = 0
    """Evaluate after every N training steps (and after the last one); 0 = never."""
    batches: PositiveInt = 4
    """Held-out global batches (of ``train.batch_size``) per evaluation."""


class RunConfig(Section):
    """``[run]``: the run directory and what is written to it."""

    dir: str = "runs"
    """Parent folder of run directories."""
    name: str = ""
    """Run directory name; empty = ``<model>-<timestamp>``."""
    checkpoint_every: Annotated[NonNegativeInt, Allowed("must be >= 0 (0 = only at the end)")] = 50
    """Write a checkpoint every N steps (0 = only at the end)."""
    async_checkpoint: bool = False
    """Save checkpoints in the background: the step copies the state into host buffers kept
    between saves and goes on while a low-priority thread writes it (``dcp.save``); a save
    waits for the one before it, and the run for the last one before it ends."""
    profile_every: PositiveInt = 10
    """Every N-th step runs its first micro-batch unfused, measures each layer on it and
    writes the per-layer profile to the metrics (a run with no such step after its first
    also profiles its last)."""
    trace_steps: NonNegativeInt = 20
    """Record the actions of the first N steps in trace.json (0 = none)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    report: bool = True
    """Write report.html at the end."""


def _installed_loggers(kinds: list[str]) -> list[str]:
    """Each asked-for logger's package must be importable here (checked before any rank
    starts, so a run never stops half-way for it)."""
    import importlib.util
    for kind in kinds:
        if importlib.util.find_spec(kind) is None:
            raise PydanticCustomError(
                "extra", "{kind} is not installed; install it with "
                "`pip install 'trainwright[{kind}]'` or remove it from the list",
                {"kind": kind})
    if len(set(kinds)) != len(kinds):
        raise PydanticCustomError("unique", "lists a logger twice")
    return kinds


class ObserveConfig(Section):
    """``[observe]``: throughput figures and where rank 0's scalars go besides
    metrics.jsonl."""

    loggers: Annotated[list[Literal["tensorboard", "wandb"]],
                       AfterValidator(_installed_loggers)] = []
    """Log the ``step`` and ``eval`` rows' figures to TensorBoard (``RUN_DIR/tensorboard``)
    and/or Weights & Biases (``RUN_DIR/wandb``; offline unless ``WANDB_MODE`` says otherwise
    or an API key is known). Each needs its extra: ``pip install 'trainwright[tensorboard]'``."""
    mfu: bool = True
    """Count the model's FLOPs per step (one forward and backward on the ``meta`` device)
    and the devices' peak (a GPU table; on a CPU a matmul calibration of about 0.3 s
    at start), so every ``step`` row carries ``mfu``."""


class RuntimeConfig(Section):
    """``[runtime]``: deadlines of communication and liveness checks."""

    p2p_timeout_s: PositiveFloat = 300.0
    """Deadline of one pipeline send or receive."""
    peer_timeout_s: PositiveFloat = 10.0
    """A rank whose heartbeat is silent this long is declared lost."""
    collective_timeout_s: PositiveFloat = 300.0
    """Process-group timeout for collectives."""


class FaultConfig(Section):
    """``[fault]``: fault injection for tests of the pipeline runner."""

    kill_rank: Annotated[int, Field(ge=-1), Allowed("must be -1 (none) or a rank")] = -1
    """Testing: this rank SIGKILLs itself in the middle of step ``kill_step``."""
    kill_step: NEVER_OR_STEP = -1
    """Testing: the step (1-based) in which ``kill_rank`` dies."""
    kill_before: str = ""
    """Testing: die just before the first action of this kind (e.g. ``"MIG_RECV"``) instead
    of in the middle of the step; ``"SAVE"``: in the step's checkpoint save, after this
    rank's files are written and before the checkpoint is completed."""


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig, "data": DataConfig, "train": TrainConfig, "eval": EvalConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig, "sync": SyncConfig, "hierarchical": HierarchicalConfig,
    "tokenring": TokenRingConfig, "rebalance": RebalanceConfig, "run": RunConfig,
    "observe": ObserveConfig, "runtime": RuntimeConfig, "fault": FaultConfig,
}
