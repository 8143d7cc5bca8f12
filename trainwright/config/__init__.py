"""The validated run configuration: TOML files plus ``--set section.key=value`` overrides.

* :mod:`~trainwright.config.sections`: one pydantic model per TOML section, a docstring per
  key; types and per-field ranges;
* :mod:`~trainwright.config.core`: :class:`Config`, loading, cross-field rules, sizes;
* :mod:`~trainwright.config.training_rules`, :mod:`~trainwright.config.interleaved_rules`:
  cross-field rules of training settings and of ``parallel.virtual_stages``;
* :mod:`~trainwright.config.combinations`: valid configurations that still cannot start;
* :mod:`~trainwright.config.messages`: pydantic's errors as one-line ConfigErrors.

May import: :mod:`trainwright.errors`, :mod:`trainwright.plan` (policy names).
"""

from trainwright.config.core import (
    Config,
    even_partition,
    load_config,
    parse_bytes,
)
from trainwright.config.sections import (
    SECTIONS,
    DataConfig,
    FaultConfig,
    HierarchicalConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    RebalanceConfig,
    RunConfig,
    RuntimeConfig,
    SyncConfig,
    TokenRingConfig,
    TrainConfig,
)
from trainwright.errors import ConfigError

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "MemoryConfig",
           "SyncConfig", "HierarchicalConfig", "TokenRingConfig", "RebalanceConfig",
           "RunConfig", "RuntimeConfig", "FaultConfig", "SECTIONS",
           "load_config", "parse_bytes", "even_partition", "ConfigError"]
