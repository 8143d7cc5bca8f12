"""Build the model layers, optimizer, loss and data a configuration describes.

The distributed worker and the single-process reference both build through here, so the
two start from identical weights and read identical batches.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainwright.config import Config
from trainwright.errors import ConfigError, PlanError
from trainwright.model.data import CharCorpus, SyntheticRegression, SyntheticTokens, stdlib_corpus
from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.model.graph import layers_from_export, layers_from_sequential
from trainwright.model.mlp import mlp_layers

__all__ = ["build_layers", "build_optimizer", "build_data", "loss_fn", "split_microbatches",
           "load_factory", "cross_entropy"]


def load_factory(spec: str, key: str) -> Callable:
    """Import ``"package.module:function"`` named by config ``key``.

    Raises:
        ConfigError: the module or the function cannot be found.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key} = {spec!r} cannot be loaded ({exc}); check that the module "
                          f"is importable from the working directory or installed") from None


def _factory_layers(cfg: Config) -> list[tuple[str, nn.Module]]:
    factory = load_factory(cfg.model.factory, "model.factory")
    takes_cfg = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    for p in inspect.signature(factory).parameters.values())
    made = factory(cfg) if takes_cfg else factory()
    if isinstance(made, tuple):  # (module, example_args): capture and cut with torch.export
        model, example_args = made
        try:
            layers = layers_from_export(model, tuple(example_args), dynamic_batch=True)
        except PlanError as exc:
            raise ConfigError(f"model.factory = {cfg.model.factory!r}: {exc}") from None
    else:
        layers = layers_from_sequential(made)
    return [(getattr(m, "name", None) or f"{i}.{type(m).__name__}", m)
            for i, m in enumerate(layers)]


def build_layers(cfg: Config) -> list[tuple[str, nn.Module]]:
    """The whole model as ``(name, layer)`` pairs, initialised from ``train.seed``."""
    m = cfg.model
    torch.manual_seed(cfg.train.seed)
    if m.factory:
        return _factory_layers(cfg)
    if m.name == "gpt":
        layers = gpt_layers(GPTConfig(vocab=256, context=m.context, d_model=m.d_model,
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


def build_data(cfg: Config):
    """The dataset: an object with ``batch(step, batch_size) -> (inputs, targets)``."""
    m, seed = cfg.model, cfg.train.seed
    if cfg.data.factory:
        return load_factory(cfg.data.factory, "data.factory")(cfg)
    if m.name == "mlp":
        return SyntheticRegression(m.d_in, m.n_classes, seed=seed)
    if cfg.data.name == "synthetic":
        return SyntheticTokens(256, m.context, seed=seed)
    return CharCorpus(stdlib_corpus(cfg.data.max_bytes), m.context, seed=seed)


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
