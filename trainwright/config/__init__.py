"""The validated run configuration: TOML files plus ``--set section.key=value`` overrides.

* :mod:`~trainwright.config.sections`: one class per TOML section, a docstring per key;
* :mod:`~trainwright.config.core`: :class:`Config`, loading, validation, sizes.

May import: :mod:`trainwright.errors`, :mod:`trainwright.plan` (policy names).
"""

from trainwright.config.core import (
    CHOICES,
    POSITIVE,
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

__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "ParallelConfig", "MemoryConfig",
           "SyncConfig", "HierarchicalConfig", "TokenRingConfig", "RebalanceConfig",
           "RunConfig", "RuntimeConfig", "FaultConfig", "SECTIONS", "CHOICES", "POSITIVE",
           "load_config", "parse_bytes", "even_partition"]
