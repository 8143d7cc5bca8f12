"""Error types raised to users. Messages say what was expected, what was found, and the fix."""

from __future__ import annotations

__all__ = ["TrainwrightError", "ConfigError", "PlanError", "PeerLost", "CommError"]


class TrainwrightError(Exception):
    """Base class of every error trainwright raises on purpose."""


class ConfigError(TrainwrightError, ValueError):
    """A configuration key, value or combination is invalid. The CLI exits with code 2."""


class PlanError(TrainwrightError, ValueError):
    """A partition or schedule cannot be built from the given model and topology."""


class CommError(TrainwrightError, RuntimeError):
    """A point-to-point or collective operation failed or missed its deadline."""


class PeerLost(CommError):
    """Another rank of the job stopped responding or exited.

    Attributes:
        rank: the global rank that was lost (``-1`` when unknown).
    """

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        super().__init__(detail)
