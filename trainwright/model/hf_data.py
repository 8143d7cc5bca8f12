"""Hugging Face ``datasets`` as packed token windows (``data.name = "hf"``).

``data.dataset`` names a folder written by ``Dataset.save_to_disk`` (read with
``load_from_disk``, memory-mapped) or ``.json`` / ``.jsonl`` / ``.parquet`` / ``.txt``
files (a file, a glob or a folder, read with ``load_dataset(builder, data_files=...,
streaming=True)``; a text file gives one document per paragraph). Either way the documents
are read as a stream (``IterableDataset``), never loaded whole, so a data set larger than
memory trains.

Each document's ``data.text_field`` is tokenized with the run's tokenizer
(``data.tokenizer``, or bytes), followed by the tokenizer's end-of-sequence id when it has
one, and the tokens are packed, in order, into windows of ``model.context + 1``: inputs are
a window's first ``context`` tokens, targets its last ``context`` (as torchtitan packs).

Replica ``r`` of ``parts`` reads its own part, ``datasets.distributed.split_dataset_by_node``
(its own files or ``save_to_disk`` shards when their number divides by ``parts``; otherwise
it skips the other replicas' documents without tokenizing them). A step's global batch is
the replicas' shares one after another, so the one-process reference, which reads every
share, trains on the same windows. At the end of the data a replica starts again from its
first document (the next epoch, same order).

The held-out documents (``data.val_fraction`` of them, chosen by a CRC-32 of the text, so
the choice is the same however the data set is split or streamed) are never trained on;
:meth:`HFWindows.eval_batch` packs them the same way.

The data position is in the checkpoint: :meth:`HFWindows.state_dict` holds, per replica
stream, the step it reached, the ``IterableDataset.state_dict()`` and the tokens left over
from the last document, so a resume continues where it stopped without re-reading what came
before. A stream with no saved position (resumed at another ``parallel.dp``) is re-read from
its start up to the step.
"""

from __future__ import annotations

import importlib.util
import logging
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from trainwright.config.training_rules import text_files
from trainwright.errors import ConfigError

__all__ = ["HFWindows", "require_datasets", "open_documents", "check_text_field",
           "FILE_BUILDERS", "HF_EXTRA"]

log = logging.getLogger(__name__)

HF_EXTRA = "pip install 'trainwright[hf-data]'"
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
                 ".text": "text", ".md": "text"}
"""File suffix -> the ``datasets`` builder that reads it."""


def require_datasets():
    """The ``datasets`` module, or a ConfigError naming the extra that installs it."""
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f'data.name = "hf" needs the datasets package; {HF_EXTRA}')
    import datasets

    return datasets


def _is_saved_folder(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def open_documents(spec: str, index: int = 0, parts: int = 1):
    """Replica ``index`` of ``parts``'s part of ``data.dataset``, as an ``IterableDataset``.

    Raises:
        ConfigError: the path does not exist, holds no readable file, mixes formats, or is a
            ``DatasetDict`` without a ``"train"`` split.
    """
    datasets = require_datasets()
    from datasets.distributed import split_dataset_by_node

    p = Path(spec).expanduser()
    if _is_saved_folder(p):
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ConfigError(f"data.dataset = {spec!r} holds the splits {list(ds)} but no "
                                  f"\"train\"; point data.dataset at one split's folder")
            ds = ds["train"]
        stream = ds.to_iterable_dataset(num_shards=parts if len(ds) >= parts else 1)
    else:
        files = text_files(spec)
        if not files:
            raise ConfigError(f"data.dataset = {spec!r} does not exist; give a folder written "
                              f"by Dataset.save_to_disk, or .jsonl/.json/.parquet/.txt files "
                              f"(a file, a glob or a folder)")
        builders = {FILE_BUILDERS.get(f.suffix.lower()) for f in files}
        if None in builders or len(builders) != 1:
            kinds = sorted({f.suffix or f.name for f in files})
            raise ConfigError(f"data.dataset = {spec!r} holds {', '.join(kinds)} files; give "
                              f"files of one kind: .jsonl/.json, .parquet or .txt")
        builder = builders.pop()
        extra = {"sample_by": "paragraph"} if builder == "text" else {}
        stream = datasets.load_dataset(builder, data_files=[str(f) for f in files],
                                       split="train", streaming=True, **extra)
    return split_dataset_by_node(stream, rank=index, world_size=parts) if parts > 1 else stream


def check_text_field(spec: str, field: str) -> None:
    """Read the first document of ``data.dataset``; raise ConfigError when it has no text
    under ``field``."""
    first = next(iter(open_documents(spec)), None)
    if first is None:
        raise ConfigError(f"data.dataset = {spec!r} holds no document; add some")
    if field not in first:
        raise ConfigError(f"data.text_field = {field!r} is not a column of data.dataset = "
                          f"{spec!r} (columns: {', '.join(first)}); set data.text_field to "
                          f"the column that holds the text")
    if not isinstance(first[field], str):
        raise ConfigError(f"data.text_field = {field!r} of data.dataset = {spec!r} holds "
                          f"{type(first[field]).__name__}, not text; set data.text_field to "
                          f"the column that holds the text")


def _held_out(text, fraction: float) -> bool:
    text = text if isinstance(text, str) else ""
    return zlib.crc32(text.encode("utf-8")) < fraction * 2**32


class _Stream:
    """One replica's windows, in order: its documents, tokenized and packed."""

    def __init__(self, src: HFWindows, index: int, parts: int, held: bool):
        self.src, self.index, self.parts, self.held = src, index, parts, held
        self.epoch, self.buffer, self.documents = 0, [], 0
        self.next_step, self.last = 1, None  # the first step not yet read; (step, windows)
        self.dataset = self.it = None
        self.yielded = 0  # windows this epoch (an epoch that yields none: too little text)

    def _open(self, state: dict | None = None) -> None:
        f, field = self.src.val_fraction, self.src.text_field
        ds = open_documents(self.src.spec, self.index, self.parts)
        if f > 0:
            ds = ds.filter(lambda ex: _held_out(ex[field], f) == self.held)
        if state is not None:
            ds.load_state_dict(state)
        self.dataset, self.it = ds, iter(ds)

    def windows(self, n: int) -> list[list[int]]:
        """The next ``n`` windows of ``context + 1`` tokens."""
        if self.it is None:
            self._open()
        width, out = self.src.context + 1, []
        while len(out) < n:
            while len(self.buffer) < width:
                try:
                    doc = next(self.it)
                except StopIteration:
                    if not self.yielded:
                        raise ConfigError(self.src.too_little(self.held)) from None
                    self.epoch, self.yielded = self.epoch + 1, 0
                    self._open()
                    continue
                self.documents += 1
                text = doc[self.src.text_field]
                if text is None:  # a missing value: no document
                    continue
                if not isinstance(text, str):
                    raise ConfigError(f"data.text_field = {self.src.text_field!r} of "
                                      f"data.dataset = {self.src.spec!r} holds "
                                      f"{type(text).__name__} in a document; set it to a "
                                      f"column of text")
                self.buffer += self.src.encode(text)
                if self.src.eos is not None:
                    self.buffer.append(self.src.eos)
            out.append(self.buffer[:width])
            del self.buffer[:width]
            self.yielded += 1
        return out

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "epoch": self.epoch, "yielded": self.yielded,
                "buffer": list(self.buffer), "size": len(self.last[1]) if self.last else 0,
                "dataset": self.dataset.state_dict() if self.dataset is not None else None}

    def restore(self, state: dict) -> None:
        self.next_step, self.epoch, self.yielded = (state["next_step"], state["epoch"],
                                                    state["yielded"])
        self.buffer = list(state["buffer"])
        if state["dataset"] is not None:
            self._open(state["dataset"])


class HFWindows:
    """A Hugging Face data set as ``share`` / ``batch`` / ``eval_batch`` of packed windows.

    Args:
        spec: ``data.dataset`` (a ``save_to_disk`` folder, or json/parquet/text files).
        text_field: the column that holds each document's text.
        encode: text -> token ids (the run's tokenizer).
        eos: the id appended after each document, or None.
        context: ``model.context`` (windows hold ``context + 1`` tokens).
        parts: data-parallel replicas (``batch`` concatenates their shares).
        val_fraction: share of documents held out for :meth:`eval_batch`.
    """

    def __init__(self, spec: str, text_field: str, encode: Callable[[str], list[int]],
                 eos: int | None, context: int, parts: int = 1, val_fraction: float = 0.0):
        self.spec, self.text_field, self.encode, self.eos = spec, text_field, encode, eos
        self.context, self.parts, self.val_fraction = context, parts, val_fraction
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._saved: dict[str, dict] = {}  # loaded positions not yet taken up by a stream
        self._held: _Stream | None = None
        self._eval: list[list[int]] = []

    def too_little(self, held: bool) -> str:
        part = "held-out documents (data.val_fraction)" if held else "training documents"
        return (f"data.dataset = {self.spec!r} has too few {part} for one window of "
                f"model.context + 1 = {self.context + 1} tokens per replica; add text, "
                f"shorten model.context or change data.val_fraction")

    def _stream(self, index: int, parts: int, step: int, size: int) -> _Stream:
        key = (index, parts)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = _Stream(self, index, parts, held=False)
            saved = self._saved.pop(f"{index}/{parts}", None)
            if saved is not None and saved["next_step"] == step and saved["size"] == size:
                s.restore(saved)
            elif saved is not None or step > 1:
                log.info("data stream %d/%d: no saved position for step %d; re-reading from "
                         "its start", index, parts, step)
        if s.last is not None and s.last[0] == step:
            return s
        if step < s.next_step:  # asked for an earlier step: read again from the start
            s = self._streams[key] = _Stream(self, index, parts, held=False)
        if step > s.next_step:
            s.windows((step - s.next_step) * size)
        s.last, s.next_step = (step, torch.tensor(s.windows(size), dtype=torch.long)), step + 1
        return s

    def share(self, step: int, batch_size: int, index: int = 0, parts: int = 1,
              inputs: bool = True, targets: bool = True):
        """Replica ``index`` of ``parts``'s rows of the batch of ``step``: ``(x or None,
        y or None)``, each ``(batch_size // parts, context)``."""
        size = batch_size // parts
        w = self._stream(index, parts, step, size).last[1]
        return (w[:, :-1] if inputs else None), (w[:, 1:] if targets else None)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: every replica's share, in replica order."""
        shares = [self.share(step, batch_size, r, self.parts) for r in range(self.parts)]
        return torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch ``index``: the held-out documents' windows, in order (starting
        over from the first held-out document when they run out)."""
        if self._held is None:
            self._held = _Stream(self, 0, 1, held=self.val_fraction > 0)
        want = (index + 1) * batch_size
        while len(self._eval) < want:  # cached: every evaluation reads the same windows
            self._eval += self._held.windows(want - len(self._eval))
        w = torch.tensor(self._eval[index * batch_size : want], dtype=torch.long)
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict:
        """Every stream's position: step reached, data set state, left-over tokens."""
        state = dict(self._saved)
        state.update({f"{i}/{p}": s.state_dict() for (i, p), s in self._streams.items()
                      if s.last is not None})
        return {"streams": state}

    def load_state_dict(self, state: dict) -> None:
        """Positions to continue from: each stream takes its own up on its first read."""
        self._streams.clear()
        self._saved = dict(state.get("streams", {}))
