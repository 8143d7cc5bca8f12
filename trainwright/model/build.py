"""Build the model layers, optimizer, loss and data a configuration describes.

The distributed worker and the single-process reference both build through here, so the
two start from identical weights and read identical batches.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainwright.config import Config
from trainwright.errors import ConfigError, PlanError
from trainwright.model.data import CharCorpus, SyntheticRegression, SyntheticTokens, stdlib_corpus
from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.model.graph import layers_from_export, layers_from_sequential
from trainwright.model.hf import captured
from trainwright.model.hf_data import HFWindows, check_text_field
from trainwright.model.mlp import mlp_layers
from trainwright.model.text_data import (
    TokenWindows,
    check_eval_data,
    load_tokenizer,
    read_text_tokens,
    wrap_dataset,
)

__all__ = ["build_layers", "build_model", "build_optimizer", "build_data", "loss_fn",
           "split_microbatches", "load_factory", "cross_entropy", "vocab_size", "check_data"]


def load_factory(spec: str, key: str) -> Callable:
    """Import ``"package.module:function"`` named by config ``key``.

    Raises:
        ConfigError: the module or the function cannot be found.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r} must look like 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        # as under `python -m`: the installed `trainwright` script does not put the working
        # directory on the path, and the docs promise modules importable from it
        sys.path.append(cwd)
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key} = {spec!r} cannot be loaded ({exc}); check that the module "
                          f"is importable from the working directory or installed") from None


def _factory_layers(cfg: Config) -> tuple[list[tuple[str, nn.Module]], nn.Module]:
    factory = load_factory(cfg.model.factory, "model.factory")
    takes_cfg = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    for p in inspect.signature(factory).parameters.values())
    made = factory(cfg) if takes_cfg else factory()
    if isinstance(made, tuple):  # (module, example_args): capture and cut with torch.export
        model, example_args = made
        args = (example_args,) if isinstance(example_args, torch.Tensor) else tuple(example_args)
        try:
            with captured(model, len(args)):
                layers = layers_from_export(model, args, group_by=cfg.model.group_by,
                                            dynamic_batch=True)
        except PlanError as exc:
            raise ConfigError(f"model.factory = {cfg.model.factory!r}: {exc}") from None
    else:
        layers = layers_from_sequential(made)
        model = made if isinstance(made, nn.Module) else nn.Sequential(*layers)
    return [(getattr(m, "name", None) or f"{i}.{type(m).__name__}", m)
            for i, m in enumerate(layers)], model


def build_model(cfg: Config) -> tuple[list[tuple[str, nn.Module]], nn.Module]:
    """The layers (as :func:`build_layers`) and the module they come from.

    The layers share the module's parameter and buffer objects, so loading trained weights
    into the layers trains the module too: for a factory model the module is the user's
    own (an ``nn.Sequential`` of the layers when the factory returned a list); for a
    built-in model it is ``nn.Sequential`` of the layers.
    """
    torch.manual_seed(cfg.train.seed)
    if cfg.model.factory:
        return _factory_layers(cfg)
    named = build_layers(cfg)
    return named, nn.Sequential(*(m for _, m in named))


def build_layers(cfg: Config) -> list[tuple[str, nn.Module]]:
    """The whole model as ``(name, layer)`` pairs, initialised from ``train.seed``."""
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    if m.factory:
        return _factory_layers(cfg)[0]
    if m.name == "gpt":
        layers = gpt_layers(GPTConfig(vocab=vocab_size(cfg), context=m.context, d_model=m.d_model,
                                      n_heads=m.n_heads, n_blocks=m.n_blocks))
        names = ["embed", *(f"block{i}" for i in range(m.n_blocks)), "head"]
    else:
        layers = mlp_layers(m.d_in, m.d_model, m.n_classes, m.n_blocks)
        names = [*(f"hidden{i}" for i in range(m.n_blocks)), "out"]
    return list(zip(names, layers, strict=True))


def build_optimizer(cfg: Config, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """The configured optimizer over ``params`` (None when there are no parameters)."""
    if not params:
        return None
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)


def vocab_size(cfg: Config) -> int:
    """Token ids the built-in GPT embeds: the tokenizer's vocabulary, else 256 (bytes)."""
    d = cfg.data
    if d.name in ("text", "hf") and d.tokenizer and not d.factory:
        return load_tokenizer(d.tokenizer)[1]
    return 256


def build_data(cfg: Config):
    """The dataset: an object with ``batch(step, batch_size) -> (inputs, targets)`` (and
    ``eval_batch(index, batch_size)`` for held-out data; ``share`` to read one replica's
    part)."""
    m, d, seed = cfg.model, cfg.data, cfg.train.seed
    if d.factory:
        return wrap_dataset(load_factory(d.factory, "data.factory")(cfg), seed,
                            cfg.parallel.dp)
    if m.name == "mlp":
        return SyntheticRegression(m.d_in, m.n_classes, seed=seed)
    if d.name == "synthetic":
        return SyntheticTokens(256, m.context, seed=seed)
    if d.name == "text":
        return TokenWindows(lambda: read_text_tokens(d.path, d.tokenizer), m.context, seed,
                            d.val_fraction)
    if d.name == "hf":
        encode, _, eos = (load_tokenizer(d.tokenizer) if d.tokenizer
                          else (lambda text: list(text.encode("utf-8")), 256, None))
        return HFWindows(d.dataset, d.text_field, encode, eos, m.context, cfg.parallel.dp,
                         d.val_fraction)
    if cfg.eval.every:  # held-out windows from the end of the corpus
        return TokenWindows(lambda: stdlib_corpus(d.max_bytes), m.context, seed,
                            d.val_fraction)
    return CharCorpus(stdlib_corpus(d.max_bytes), m.context, seed=seed)


def check_data(cfg: Config) -> None:
    """Checks of the data that need it opened: the tokenizer loads, held-out batches exist
    when ``eval.every`` is set. Raises ConfigError (before any process starts)."""
    d = cfg.data
    if d.name in ("text", "hf") and d.tokenizer and not d.factory:
        load_tokenizer(d.tokenizer)
    if d.name == "hf" and not d.factory:
        check_text_field(d.dataset, d.text_field)
        data, dp = build_data(cfg), cfg.parallel.dp
        for r in range(dp):  # every replica has text for a first step (and held-out text)
            data.share(1, cfg.train.batch_size, r, dp, targets=False)
        if cfg.eval.every:
            data.eval_batch(0, cfg.train.batch_size)
    if cfg.eval.every:
        check_eval_data(build_data(cfg))


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits ``(..., C)``, targets ``(...)``."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())


LOSSES: dict[str, Callable] = {"cross_entropy": cross_entropy, "mse": F.mse_loss}


def loss_fn(cfg: Config) -> Callable:
    """The configured loss ``(output, target) -> scalar mean``."""
    return LOSSES[cfg.train.loss]


def split_microbatches(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Split along dimension 0 into ``n`` equal contiguous micro-batches."""
    return [c.contiguous() for c in t.chunk(n)]
