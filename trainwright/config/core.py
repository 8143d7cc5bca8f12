"""Validated run configuration: a TOML file plus ``--set section.key=value`` overrides.

Every field lives in a section model with a docstring under it
(:mod:`trainwright.config.sections`); pydantic checks types and per-field ranges there.
:class:`Config` holds the sections and checks the rules that involve several keys. Validation
runs before any process starts and raises :class:`~trainwright.errors.ConfigError` with one
line naming the key, the bad value and what is allowed. Files are read with ``tomllib`` and
written with ``tomli_w``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from trainwright.config.combinations import check_ring
from trainwright.config.interleaved_rules import check_virtual_stages
from trainwright.config.messages import one_line
from trainwright.config.sections import (
    SECTIONS,
    DataConfig,
    EvalConfig,
    FaultConfig,
    HierarchicalConfig,
    MemoryConfig,
    ModelConfig,
    ObserveConfig,
    ParallelConfig,
    RebalanceConfig,
    RunConfig,
    RuntimeConfig,
    SyncConfig,
    TokenRingConfig,
    TrainConfig,
)
from trainwright.config.training_rules import check_training_extras
from trainwright.errors import ConfigError
from trainwright.plan.memory import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "MemoryConfig",
           "SyncConfig", "HierarchicalConfig", "TokenRingConfig", "RebalanceConfig",
           "RunConfig", "RuntimeConfig", "FaultConfig", "load_config", "read_config",
           "parse_bytes"]


class Config(BaseModel):
    """The whole run configuration, one attribute per TOML section.

    ``Config(train=TrainConfig(steps=3))`` or ``Config(train={"steps": 3})``; sections left
    out take their defaults. The cross-field rules run once the sections are valid; they do
    not run again when a field is assigned later: build a changed copy with
    ``Config.from_dict(d)`` from an edited ``cfg.to_dict()``, or call :meth:`validate`.
    """

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    hierarchical: HierarchicalConfig = Field(default_factory=HierarchicalConfig)
    tokenring: TokenRingConfig = Field(default_factory=TokenRingConfig)
    rebalance: RebalanceConfig = Field(default_factory=RebalanceConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def __init__(self, **sections: Any) -> None:
        try:
            super().__init__(**sections)
        except ValidationError as exc:
            raise one_line(exc, type(self)) from None

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        self.validate()
        return self

    @property
    def world_size(self) -> int:
        """Ranks the run needs: ``pp * dp``."""
        return self.parallel.pp * self.parallel.dp

    @property
    def n_stages(self) -> int:
        """Model stages: ``parallel.pp * parallel.virtual_stages`` (interleaved: several
        per rank)."""
        return self.parallel.pp * self.parallel.virtual_stages

    def partition(self, n_layers: int | None = None) -> list[int]:
        """Layers per stage: the configured one, or as even as possible (extra to early stages).

        Args:
            n_layers: the model's layer count (needed for factory models).
        """
        if self.parallel.partition:
            return list(self.parallel.partition)
        return even_partition(n_layers or self.model.n_layers, self.n_stages)

    def validate(self) -> None:
        """Check the rules that involve several keys; raise ConfigError on the first problem.

        Types, choices and per-field ranges are the sections' (checked on construction and
        assignment).
        """
        m, par = self.model, self.parallel
        if m.name == "gpt" and m.d_model % m.n_heads:
            raise ConfigError(f"model.n_heads = {m.n_heads} does not divide model.d_model = "
                              f"{m.d_model}; pick a divisor of {m.d_model}")
        check_virtual_stages(self)
        self._validate_peer_swap()
        self._validate_schedule()
        check_training_extras(self)
        if self.fault.kill_rank >= self.world_size:
            raise ConfigError(f"fault.kill_rank = {self.fault.kill_rank} is not a rank of this "
                              f"job; ranks are 0..{self.world_size - 1} (parallel.pp * dp)")
        if par.mapping and sorted(par.mapping) != list(range(par.pp)):
            raise ConfigError(f"parallel.mapping = {par.mapping} is not a permutation of "
                              f"0..{par.pp - 1}; give each of the parallel.pp = {par.pp} stages "
                              f"its own rank, or leave it empty (the identity)")
        bad = [x for x in self.memory.policies if x not in POLICIES]
        if bad:
            raise ConfigError(f"memory.policies has {bad[0]!r}; allowed: {', '.join(POLICIES)}")
        if m.n_layers is not None:
            self.check_layers(m.n_layers)
        self.check_hierarchical()
        self.stage_limits()  # parses every limit now, so a typo fails before any process
        try:
            parse_bytes(self.memory.reserve)
        except ConfigError as exc:
            raise ConfigError(f"memory.reserve: {exc}") from None
        if self.sync.sparse and self.sync.strategy != "dense":
            raise ConfigError(f"sync.sparse = true works with sync.strategy = \"dense\", not "
                              f"{self.sync.strategy!r}; set sync.sparse = false or use \"dense\"")
        t = self.train
        if self.sync.strategy == "tokenring":
            check_ring(self)
            self.validate_tokenring()
            return
        if t.batch_size % par.dp:
            raise ConfigError(f"train.batch_size = {t.batch_size} does not split over "
                              f"parallel.dp = {par.dp} replicas; use a multiple of {par.dp}")
        per_replica = t.batch_size // par.dp
        self._validate_rebalance()
        if per_replica % t.micro_batches:
            divisors = [d for d in range(1, per_replica + 1) if per_replica % d == 0]
            raise ConfigError(f"train.micro_batches = {t.micro_batches} does not divide the "
                              f"per-replica batch {per_replica} (train.batch_size / parallel.dp)"
                              f"; allowed: {divisors}")

    def _validate_peer_swap(self) -> None:
        mem = self.memory
        if not mem.peer_swap:
            return
        if all(v is None for v in self.stage_limits()):
            raise ConfigError("memory.peer_swap = true plans against memory.limit; set a limit "
                              "(e.g. memory.limit = \"64MB\", or one per stage)")
        if mem.policies:
            raise ConfigError("memory.peer_swap = true plans the policies itself; remove "
                              "memory.policies")
        if self.rebalance.enabled or self.rebalance.at_step or self.rebalance.edits:
            raise ConfigError("memory.peer_swap = true fixes which stage holds which tensor "
                              "at start, so layers cannot migrate; set rebalance.enabled = "
                              "false (and no rebalance.at_step / edits)")

    def _validate_schedule(self) -> None:
        """Live migration and peer swap weave their actions into GPipe and 1F1B only."""
        sch, rb = self.train.schedule, self.rebalance
        if sch in ("1f1b", "gpipe"):
            return
        if self.memory.peer_swap:
            raise ConfigError(f"memory.peer_swap = true works with train.schedule = \"1f1b\" "
                              f"or \"gpipe\", not {sch!r}; pick one of those or turn it off")
        if rb.enabled or rb.at_step or rb.edits:
            raise ConfigError(f"live migration (rebalance.enabled / at_step / edits) works "
                              f"with train.schedule = \"1f1b\" or \"gpipe\", not {sch!r}; "
                              f"pick one of those or turn rebalancing off")

    def _validate_rebalance(self) -> None:
        rb, m = self.rebalance, self.train.micro_batches
        if (rb.enabled or rb.at_step) and not 0 <= rb.switch_mb <= max(m - 2, 0):
            raise ConfigError(f"rebalance.switch_mb = {rb.switch_mb} must be in 0..{m - 2} (a "
                              f"forward must follow it); with train.micro_batches = {m}"
                              + (" use at least 2 micro-batches" if m < 2 else ""))
        if (rb.enabled or rb.at_step) and m < 2:
            raise ConfigError("rebalancing moves layers between micro-batches and needs "
                              "train.micro_batches >= 2")
        if bool(rb.at_step) != bool(rb.to):
            raise ConfigError("rebalance.at_step and rebalance.to go together: give both (a "
                              "step and the layers per stage to move to) or neither")
        if rb.to and len(rb.to) != self.parallel.pp:
            raise ConfigError(f"rebalance.to = {rb.to} must be {self.parallel.pp} positive "
                              f"integers (layers per stage)")
        if rb.edits and ":" not in rb.edits:
            raise ConfigError(f"rebalance.edits = {rb.edits!r} must be \"module:function\"")

    def check_hierarchical(self) -> None:
        """Check the ``[hierarchical]`` section (slice weights, memory sizes, node size)."""
        h = self.hierarchical
        w = h.weights
        if isinstance(w, list):
            if not w or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                and x > 0 for x in w):
                raise ConfigError(f"hierarchical.weights = {w!r} must be positive numbers, one "
                                  f"per local rank, e.g. [2, 1]")
        elif w not in ("memory", "memory_speed", "equal"):
            raise ConfigError(f"hierarchical.weights = {w!r} is not allowed; choose one of "
                              f"['memory', 'memory_speed', 'equal'] or a list such as [2, 1]")
        mem = h.available_memory
        for v in mem if isinstance(mem, list) else [mem]:
            if v == "" and not isinstance(mem, list):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, str)) or parse_bytes(v) <= 0:
                raise ConfigError(f"hierarchical.available_memory = {mem!r}: write a size such "
                                  f"as \"8GiB\", or a list with one size per local rank")

    def validate_tokenring(self) -> None:
        """Rules of ``sync.strategy = "tokenring"`` (plain data parallel over ring nodes)."""
        r, t = self.tokenring, self.train
        if t.batch_size % r.nodes:
            raise ConfigError(f"train.batch_size = {t.batch_size} does not split into "
                              f"tokenring.nodes = {r.nodes} shards; use a multiple of {r.nodes}")

    def stage_limits(self) -> list[int | str | None]:
        """``memory.limit`` per stage: bytes, ``"auto"``, or None (no limit).

        Raises:
            ConfigError: unparsable sizes, or a list whose length is not ``parallel.pp``.
        """
        limit, p = self.memory.limit, self.parallel.pp
        values = limit if isinstance(limit, list) else [limit] * p
        if len(values) != p:
            raise ConfigError(f"memory.limit has {len(values)} values; give one, or one per "
                              f"stage ({p})")
        out: list[int | str | None] = []
        for v in values:
            if v in ("", None, 0):
                out.append(None)
            elif v == "auto":
                out.append("auto")
            elif isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ConfigError(f"memory.limit = {v!r} is not a size; write e.g. \"512MB\"")
            else:
                try:
                    n = parse_bytes(v)
                except ConfigError as exc:
                    raise ConfigError(f"memory.limit: {exc}") from None
                if n <= 0:
                    raise ConfigError(f"memory.limit = {v!r} must be positive")
                out.append(n)
        return out

    def layer_policies(self, n_layers: int) -> dict[int, str] | None:
        """Fixed policies from ``memory.policies`` (None when they are to be planned)."""
        pol = self.memory.policies
        if not pol:
            return None
        if len(pol) == 1:
            pol = pol * n_layers
        if len(pol) != n_layers:
            raise ConfigError(f"memory.policies has {len(pol)} entries; give one, or one per "
                              f"layer of the model ({n_layers})")
        return dict(enumerate(pol))

    def check_layers(self, n_layers: int) -> None:
        """Check ``parallel.pp`` and ``parallel.partition`` against a model of ``n_layers``."""
        p, parts = self.n_stages, self.parallel.partition
        if self.parallel.virtual_stages > 1 and p > n_layers:
            raise ConfigError(f"parallel.pp * parallel.virtual_stages = {p} stages is more than "
                              f"the model's {n_layers} layers; lower virtual_stages or use a "
                              f"deeper model")
        if p > n_layers:
            raise ConfigError(f"parallel.pp = {p} is larger than the model's {n_layers} layers; "
                              f"use parallel.pp <= {n_layers} or a deeper model")
        if parts and (len(parts) != p or not all(isinstance(x, int) and x > 0 for x in parts)
                      or sum(parts) != n_layers):
            raise ConfigError(f"parallel.partition = {parts} must be {p} positive integers "
                              f"summing to the model's {n_layers} layers")
        to = self.rebalance.to
        if to and sum(to) != n_layers and not self.rebalance.edits:
            raise ConfigError(f"rebalance.to = {to} must sum to the model's {n_layers} layers")
        self.layer_policies(n_layers)

    def get(self, key: str) -> Any:
        """Value of a dotted key such as ``"train.steps"``."""
        section, name = key.split(".", 1)
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict, section -> key -> value (a copy: editing it leaves ``self``)."""
        return {name: getattr(self, name).model_dump() for name in SECTIONS}

    def to_toml(self) -> str:
        """Serialise as TOML that :func:`load_config` reads back to an equal Config."""
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from a nested dict (section -> key -> value), checking every key and type."""
        return cls(**data)


def even_partition(n_layers: int, stages: int) -> list[int]:
    """Split ``n_layers`` into ``stages`` contiguous counts, the extra ones to early stages."""
    return [n_layers // stages + (1 if s < n_layers % stages else 0) for s in range(stages)]


def _parse_override(item: str) -> tuple[str, Any]:
    """``"section.key=value"`` -> ``("section.key", value)``, the value parsed as TOML.

    Hand-written (tomllib parses the value): a lone value is not a TOML document, and bare
    words such as ``gpipe`` are taken as strings rather than rejected.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not of the form section.key=value "
                          f"(e.g. --set train.steps=10)")
    key, raw = (s.strip() for s in item.split("=", 1))
    if key.count(".") != 1:
        raise ConfigError(f"--set key {key!r} must be section.key, e.g. parallel.pp")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set train.schedule=gpipe
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (optional) and apply ``section.key=value`` overrides.

    Args:
        path: a TOML file with the sections of :class:`Config`, or None for the defaults.
        overrides: ``"section.key=value"`` strings; values are parsed as TOML, else as text.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type, or an invalid combination.
    """
    return Config.from_dict(read_config(path, overrides))


def read_config(path: str | Path | None = None,
                overrides: list[str] | None = None) -> dict[str, Any]:
    """The sections of a TOML file (optional) with the overrides applied, not yet validated
    (:func:`load_config` validates them; a torchrun job edits them first).

    Raises:
        ConfigError: unreadable file, or a malformed override.
    """
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    for item in overrides or []:
        key, value = _parse_override(item)
        section, name = key.split(".")
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"[{section}] must be a table of keys")
        data[section][name] = value
    return data


def parse_bytes(text: str | int) -> int:
    """Parse ``"512MB"``, ``"1.5GiB"`` or a plain integer into bytes (pydantic's ByteSize)."""
    if isinstance(text, int):
        return text
    try:
        return int(_BYTES.validate_python(text))
    except ValidationError:
        raise ConfigError(f"{text!r} is not a size; write e.g. 512MB, 2GiB or 1048576") from None


_BYTES = TypeAdapter(ByteSize)
