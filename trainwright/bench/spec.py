"""The workload every pipeline benchmark system trains, so that all of them do the same work."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from trainwright.model.data import CharCorpus, stdlib_corpus
from trainwright.model.gpt import GPTConfig, gpt_layers

__all__ = ["PipelineBenchSpec"]


@dataclass(kw_only=True)
class PipelineBenchSpec:
    """An 8-block GPT split 4 + 4 blocks over 2 stages, 8 micro-batches of 4, plain SGD."""

    n_blocks: int = 8
    d_model: int = 256
    n_heads: int = 4
    context: int = 128
    micro_batches: int = 8
    micro_batch_size: int = 4
    split: list[int] = field(default_factory=lambda: [5, 5])
    """Layers per stage over ``[embed, blocks..., head]``."""
    lr: float = 0.01
    steps: int = 6
    warmup: int = 1
    """Leading steps left out of the timing."""
    seed: int = 0
    threads_per_rank: int = 1

    @property
    def batch_size(self) -> int:
        """Samples per step (one pipeline, no data parallelism)."""
        return self.micro_batches * self.micro_batch_size

    def gpt(self) -> GPTConfig:
        """The model shape."""
        return GPTConfig(vocab=256, context=self.context, d_model=self.d_model,
                         n_heads=self.n_heads, n_blocks=self.n_blocks)

    def layers(self) -> list[nn.Module]:
        """The full model's layers, initialised identically for every system."""
        torch.manual_seed(self.seed)
        return gpt_layers(self.gpt())

    def stage_layers(self, stage: int) -> list[nn.Module]:
        """The layers of one stage under ``split``."""
        start = sum(self.split[:stage])
        return self.layers()[start : start + self.split[stage]]

    def data(self) -> CharCorpus:
        """The stdlib character corpus every system reads: ``.batch(step, batch_size)`` with
        ``step`` counted from 1, as trainwright's runtime does."""
        return CharCorpus(stdlib_corpus(1_000_000), self.context, seed=self.seed)

    def to_dict(self) -> dict:
        """JSON-ready description for the benchmark output."""
        return asdict(self)
