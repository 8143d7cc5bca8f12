"""Real data: text files tokenized into windows, and the user's torch ``Dataset``\\ s.

:class:`TokenWindows` draws random windows of ``context + 1`` tokens from a 1-D token
tensor (``data.name = "text"``: the files of ``data.path``, tokenized with
``data.tokenizer`` or as bytes; ``"stdlib"``: the standard library's source). The last
``data.val_fraction`` of the tokens is held out: :meth:`TokenWindows.eval_batch` reads
windows only from there, training windows only from before it. The corpus is read on first
use, so a rank that never needs data (a middle pipeline stage) never reads it, and
:meth:`TokenWindows.share` builds only the rows of one replica and only the half (inputs
or targets) a stage needs.

A ``data.factory`` may return a ``torch.utils.data.Dataset`` (map-style, items
``(input, target)``), an ``IterableDataset``, or a ``(train, validation)`` pair of them;
:class:`DatasetBatches` turns it into the ``batch(step, batch_size)`` protocol with
``DistributedSampler`` semantics per replica (see :func:`read_share`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, default_collate

from trainwright.config.training_rules import text_files
from trainwright.errors import ConfigError

__all__ = ["TokenWindows", "load_tokenizer", "read_text_tokens", "DatasetBatches",
           "wrap_dataset", "read_share", "check_eval_data"]

EVAL_SEED_OFFSET = 1 << 40
"""Held-out batch ``i`` draws from generator seed ``seed * 1_000_003 + OFFSET + i``."""


def load_tokenizer(spec: str) -> tuple[Callable[[str], list[int]], int, int | None]:
    """``(encode, vocab_size, eos_id)`` of a local tokenizer: a ``tokenizers`` JSON file or a
    ``transformers`` tokenizer folder (no download).

    Raises:
        ConfigError: naming ``data.tokenizer``, when it cannot be loaded.
    """
    path = Path(spec).expanduser()
    try:
        if path.is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            return (lambda text: tok.encode(text).ids), tok.get_vocab_size(), None
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return ((lambda text: hf.encode(text, add_special_tokens=False)), len(hf),
                hf.eos_token_id)
    except Exception as exc:  # any loader failure is the user's tokenizer path
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"data.tokenizer = {spec!r} cannot be loaded ({why}); give a local "
                          f"transformers tokenizer folder or a tokenizers .json file, or \"\" "
                          f"for bytes") from None


def read_text_tokens(path: str, tokenizer: str = "") -> torch.Tensor:
    """Every file of ``data.path`` (sorted), tokenized and concatenated (EOS between files
    when the tokenizer has one); bytes when ``tokenizer`` is empty."""
    files = text_files(path)
    if not files:
        raise ConfigError(f"data.path = {path!r} matches no file")
    if not tokenizer:
        blob = b"".join(f.read_bytes() for f in files)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    encode, _, eos = load_tokenizer(tokenizer)
    ids: list[int] = []
    for f in files:
        ids += encode(f.read_text(errors="replace"))
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


class TokenWindows:
    """Random windows of a token corpus: inputs ``(B, T)``, targets shifted by one.

    Args:
        load: returns the 1-D token tensor (called once, on first use).
        context: window length ``T``.
        seed: data order (the batch of a step is a pure function of ``(seed, step)``).
        val_fraction: share of tokens, at the end, held out for :meth:`eval_batch`.
    """

    def __init__(self, load: Callable[[], torch.Tensor], context: int, seed: int = 0,
                 val_fraction: float = 0.0):
        self._load, self.context, self.seed, self.val_fraction = load, context, seed, val_fraction
        self._ids: torch.Tensor | None = None
        self._split = 0

    @property
    def ids(self) -> torch.Tensor:
        """The whole token corpus (read now if not yet)."""
        if self._ids is None:
            ids = self._load().long()
            split = ids.numel() - int(ids.numel() * self.val_fraction)
            need = self.context + 2
            if split < need or (self.val_fraction and ids.numel() - split < need):
                raise ConfigError(f"the corpus has {ids.numel()} tokens: too few for windows of "
                                  f"model.context = {self.context} in both the training part "
                                  f"and the held-out data.val_fraction = {self.val_fraction}; "
                                  f"add text or shorten model.context")
            self._ids, self._split = ids, split
        return self._ids

    def _windows(self, lo: int, hi: int, seed: int, rows: slice, batch_size: int,
                 inputs: bool, targets: bool):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(lo, hi - self.context - 1, (batch_size,), generator=gen)[rows]
        offsets = torch.arange(self.context + 1)
        ids = self.ids
        x = ids[starts[:, None] + offsets[:-1]] if inputs else None
        y = ids[starts[:, None] + offsets[1:]] if targets else None
        return x, y

    def share(self, step: int, batch_size: int, index: int = 0, parts: int = 1,
              inputs: bool = True, targets: bool = True):
        """Rows ``index`` of ``parts`` of the global batch of ``step``: ``(x or None, y or
        None)``, only the halves asked for."""
        size = batch_size // parts
        self.ids  # noqa: B018 - read the corpus (sets the split)
        return self._windows(0, self._split, self.seed * 1_000_003 + step,
                             slice(index * size, (index + 1) * size), batch_size, inputs, targets)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global training batch of ``step`` (identical on every call)."""
        return self.share(step, batch_size)

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index``: windows from the last ``val_fraction`` of the corpus."""
        ids = self.ids
        lo = self._split if self.val_fraction else 0
        return self._windows(lo, ids.numel(), self.seed * 1_000_003 + EVAL_SEED_OFFSET + index,
                             slice(None), batch_size, True, True)


class DatasetBatches:
    """A torch ``Dataset`` / ``IterableDataset`` as ``batch(step, batch_size)`` batches.

    Replica ``r`` of ``parts`` takes what ``DistributedSampler(num_replicas=parts, rank=r,
    shuffle=True, seed=seed, drop_last=True)`` gives it (map-style; the epoch is
    ``set_epoch``-ed as steps go by), or every ``parts``-th item from ``r`` on (iterable).
    The global batch is the replicas' shares one after another, so the single-process
    reference trains on the same samples.
    """

    def __init__(self, train, validation=None, seed: int = 0, parts: int = 1):
        self.train, self.validation, self.seed, self.parts = train, validation, seed, parts
        self._iter: tuple[int, object] | None = None

    def _map_share(self, ds, step: int, size: int, index: int, parts: int, shuffle: bool):
        sampler = DistributedSampler(ds, num_replicas=parts, rank=index, shuffle=shuffle,
                                     seed=self.seed, drop_last=True)
        per_epoch = len(sampler)
        if per_epoch == 0:
            raise ConfigError(f"the dataset has {len(ds)} items: fewer than the {parts} "
                              f"replicas (parallel.dp)")
        pos, items = (step - 1) * size, []
        while len(items) < size:
            epoch, offset = divmod(pos, per_epoch)
            sampler.set_epoch(epoch)
            take = list(sampler)[offset : offset + size - len(items)]
            items += take
            pos += len(take)
        return default_collate([ds[i] for i in items])

    def _iter_share(self, step: int, size: int, index: int, parts: int):
        start = (step - 1) * size * parts
        if self._iter is None or self._iter[0] > start:  # (re)start and skip (resume)
            self._iter = (0, iter(self.train))
        pos, it = self._iter
        chunk = list(itertools.islice(it, start - pos, start - pos + size * parts))
        if len(chunk) < size * parts:
            raise ConfigError(f"the iterable dataset ended before step {step}; lower "
                              f"train.steps or make it longer")
        self._iter = (start + size * parts, it)
        return default_collate(chunk[index::parts])

    def share(self, step: int, batch_size: int, index: int = 0, parts: int = 1,
              inputs: bool = True, targets: bool = True):
        """Replica ``index``'s rows of the global batch of ``step``."""
        size = batch_size // parts
        if isinstance(self.train, IterableDataset):
            x, y = self._iter_share(step, size, index, parts)
        else:
            x, y = self._map_share(self.train, step, size, index, parts, True)
        return (x if inputs else None), (y if targets else None)

    def batch(self, step: int, batch_size: int):
        """The global batch: every replica's share, in replica order."""
        shares = [self.share(step, batch_size, r, self.parts) for r in range(self.parts)]
        return tuple(torch.cat([s[k] for s in shares]) for k in range(2))

    def eval_batch(self, index: int, batch_size: int):
        """Held-out batch ``index`` from the validation dataset, in order (map-style)."""
        if self.validation is None or isinstance(self.validation, IterableDataset):
            raise ConfigError("eval.every > 0 with a data.factory Dataset needs a map-style "
                              "validation set: return (train_dataset, validation_dataset)")
        n = len(self.validation)
        return default_collate([self.validation[(index * batch_size + j) % n]
                                for j in range(batch_size)])


def wrap_dataset(made, seed: int, parts: int):
    """``made`` as a batch source: torch datasets (or a ``(train, validation)`` pair of them)
    wrapped in :class:`DatasetBatches`; anything else is returned unchanged."""
    if isinstance(made, (Dataset, IterableDataset)):
        return DatasetBatches(made, None, seed, parts)
    if (isinstance(made, tuple) and len(made) == 2
            and all(isinstance(d, (Dataset, IterableDataset)) for d in made)):
        return DatasetBatches(made[0], made[1], seed, parts)
    return made


def check_eval_data(data) -> None:
    """Raise ConfigError when ``eval.every`` is set but ``data`` has no held-out batches."""
    if not callable(getattr(data, "eval_batch", None)):
        raise ConfigError(f"eval.every > 0 needs held-out data, but the data object "
                          f"{type(data).__name__} has no eval_batch(index, batch_size); use "
                          f"data.name = \"text\", \"stdlib\" or \"synthetic\", or add the method"
                          f" to your data.factory's object (or set eval.every = 0)")


def read_share(data, step: int, batch_size: int, index: int, parts: int,
               inputs: bool, targets: bool):
    """Replica ``index`` of ``parts``'s share of the batch of ``step``, only the halves asked
    for: through ``data.share`` when it has one, else sliced from ``data.batch``."""
    if not (inputs or targets):
        return None, None
    if callable(getattr(data, "share", None)):
        return data.share(step, batch_size, index, parts, inputs=inputs, targets=targets)
    from trainwright.model.data import shard

    x, y = shard(data.batch(step, batch_size), index, parts)
    return (x if inputs else None), (y if targets else None)
