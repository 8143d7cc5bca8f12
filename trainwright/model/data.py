"""Built-in data: a byte-level corpus from the standard library's own source, and synthetic sets.

Every dataset is a pure function of ``(step, batch_size)``: the global batch of a step is
the same on every rank and after a resume, so there is no loader state to checkpoint and
each rank just slices its share.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["stdlib_corpus", "CharCorpus", "SyntheticTokens", "SyntheticRegression", "shard"]


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """Read the Python standard library's ``.py`` files (sorted, so the order is stable).

    Args:
        max_bytes: stop once this many bytes are read.

    Returns:
        A 1-D ``uint8`` tensor of source text, present on every machine with no download.

    Raises:
        FileNotFoundError: the standard library sources are not installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(
            f"no .py files under {root}; install the Python sources or use data.name='synthetic'"
        )
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class CharCorpus:
    """Random windows of a byte corpus: inputs ``(B, T)`` ids, targets shifted by one."""

    def __init__(self, corpus: torch.Tensor, context: int, seed: int = 0):
        if corpus.numel() <= context + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is shorter than context {context}")
        self.corpus = corpus.long()
        self.context = context
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the global batch of ``step`` (identical on every call)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.corpus.numel() - self.context - 1
        starts = torch.randint(0, high, (batch_size,), generator=gen)
        offsets = torch.arange(self.context + 1)
        windows = self.corpus[starts[:, None] + offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class SyntheticTokens:
    """Uniform random token ids with targets from a fixed random permutation of the vocabulary."""

    def __init__(self, vocab: int, context: int, seed: int = 0):
        self.vocab, self.context, self.seed = vocab, context, seed
        self.perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the global batch of ``step`` (identical on every call)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        ids = torch.randint(0, self.vocab, (batch_size, self.context), generator=gen)
        return ids, self.perm[ids]

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index``: fresh draws, from seeds no training step uses."""
        return self.batch(-1 - index, batch_size)


class SyntheticRegression:
    """Gaussian inputs labelled by a fixed random linear teacher (classification targets)."""

    def __init__(self, d_in: int, n_classes: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(d_in, n_classes, generator=gen)
        self.d_in, self.seed = d_in, seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the global batch of ``step`` (identical on every call)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(batch_size, self.d_in, generator=gen)
        return x, (x @ self.teacher).argmax(dim=1)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index``: fresh draws, from seeds no training step uses."""
        return self.batch(-1 - index, batch_size)


def shard(batch: tuple[torch.Tensor, ...], index: int, parts: int) -> tuple[torch.Tensor, ...]:
    """Take contiguous share ``index`` of ``parts`` along dimension 0 of every tensor."""
    n = batch[0].shape[0]
    if n % parts:
        raise ValueError(f"batch of {n} does not split into {parts} equal parts")
    size = n // parts
    return tuple(t[index * size : (index + 1) * size] for t in batch)
