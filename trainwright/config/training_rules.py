"""Cross-field rules of precision, clipping, learning-rate schedules, evaluation and text data.

:func:`check_training_extras` runs inside :meth:`Config.validate`, so a bad combination
fails before any process starts, with one line naming the key and the fix.
:func:`text_files` resolves ``data.path`` (a file, a glob or a folder) for the check and
for the reader (:mod:`trainwright.model.text_data`).
"""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path

from trainwright.errors import ConfigError

__all__ = ["check_training_extras", "text_files"]


def text_files(path: str) -> list[Path]:
    """The files ``data.path`` names, sorted: the file itself, a glob's matches, or every
    file under a folder (recursively, hidden ones skipped)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file()
                      and not any(part.startswith(".") for part in f.relative_to(p).parts))
    return sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())


def _check_text_data(cfg) -> None:
    d = cfg.data
    if d.val_fraction >= 1:
        raise ConfigError(f"data.val_fraction = {d.val_fraction} must be in [0, 1) (the share "
                          f"of tokens held out), e.g. 0.1")
    if d.name == "hf" and not d.factory:
        _check_hf_data(cfg)
    if d.name != "text" or d.factory:
        return
    if not d.path:
        raise ConfigError('data.name = "text" reads data.path; set it to a text file, a glob '
                          'such as "corpus/*.txt" or a folder')
    if not text_files(d.path):
        raise ConfigError(f"data.path = {d.path!r} matches no file; give an existing text "
                          f"file, a glob such as \"corpus/*.txt\" or a folder of text files")
    _check_tokenizer(d)


def _check_tokenizer(d) -> None:
    """``data.tokenizer`` names something that exists (or is empty: bytes)."""
    if d.tokenizer and not Path(d.tokenizer).expanduser().exists():
        raise ConfigError(f"data.tokenizer = {d.tokenizer!r} does not exist; give a local "
                          f"transformers tokenizer folder or a tokenizers .json file, or \"\" "
                          f"for bytes")


def _check_hf_data(cfg) -> None:
    d = cfg.data
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError('data.name = "hf" needs the datasets package; pip install '
                          '\'trainwright[hf-data]\'')
    if not d.dataset:
        raise ConfigError('data.name = "hf" reads data.dataset; set it to a folder written by '
                          'Dataset.save_to_disk or to .jsonl/.json/.parquet/.txt files')
    p = Path(d.dataset).expanduser()
    if not p.is_dir() and not text_files(d.dataset):
        raise ConfigError(f"data.dataset = {d.dataset!r} does not exist; give a folder written "
                          f"by Dataset.save_to_disk, or .jsonl/.json/.parquet/.txt files (a "
                          f"file, a glob or a folder)")
    if not d.text_field:
        raise ConfigError('data.text_field is empty; set it to the column that holds the '
                          'text, e.g. "text"')
    _check_tokenizer(d)


def _check_schedule(cfg) -> None:
    t = cfg.train
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}; use a value "
                          f"<= {t.lr}")
    if t.lr_schedule != "constant" and t.warmup_steps >= t.steps:
        raise ConfigError(f"train.warmup_steps = {t.warmup_steps} leaves no step for the "
                          f"{t.lr_schedule} decay of train.steps = {t.steps}; use fewer than "
                          f"{t.steps} warm-up steps")


def check_training_extras(cfg) -> None:
    """Rules of ``train.precision``, ``clip_norm``, ``lr_schedule``, ``[eval]`` and text data."""
    _check_text_data(cfg)
    _check_schedule(cfg)
    t, strategy = cfg.train, cfg.sync.strategy
    if strategy == "tokenring":
        changed = [k for k, v in (("train.precision", t.precision != "fp32"),
                                  ("train.clip_norm", t.clip_norm > 0),
                                  ("train.lr_schedule", t.lr_schedule != "constant"),
                                  ("train.warmup_steps", t.warmup_steps > 0),
                                  ("eval.every", cfg.eval.every > 0)) if v]
        if changed:
            raise ConfigError(f"{changed[0]} is not available with sync.strategy = "
                              f"\"tokenring\" (plain SGD per closed step); leave it at its "
                              f"default or use sync.strategy = \"dense\"")
    if t.precision == "fp16" and strategy == "hierarchical":
        raise ConfigError('train.precision = "fp16" needs to skip a step whose gradients '
                          'overflowed, which the sharded optimizer of sync.strategy = '
                          '"hierarchical" cannot; use train.precision = "bf16" (no loss '
                          'scaling) or sync.strategy = "dense"')
