"""Models a user brings as ``(module, example_args)``: Hugging Face ``transformers`` or not.

Output rule (:func:`output_tensor`). A captured model's forward may return a tensor, a
tuple or a mapping (a ``transformers`` ``ModelOutput`` is an ordered mapping). The pipeline
trains on one tensor, found by this rule, applied again to what it picks until a tensor
comes out:

* a tensor is used as it is;
* a mapping gives its ``"logits"`` entry when it has one, else its first value;
* a tuple or list gives its first element.

Anything else (``None``, a string, an empty tuple) is refused with a
:class:`~trainwright.errors.ConfigError` before anything is written. A forward that takes
``use_cache`` (``transformers`` causal LMs) is called with ``use_cache=False``: a training
step needs no key/value cache, and the cache object cannot cross a pipeline cut.

:func:`captured` applies the rule while ``torch.export`` captures the model: it sets, on the
instance only, a ``forward`` that calls the class's own forward and picks the tensor, and
removes it afterwards, so module paths and parameter names stay the model's own
(``transformer.h.0.attn.c_attn.weight``), which export (:mod:`trainwright.run.export`) needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainwright.errors import ConfigError

__all__ = ["output_tensor", "captured", "is_transformers_model", "save_model_dir"]


def output_tensor(out: Any) -> torch.Tensor | None:
    """The tensor the pipeline trains on, from whatever a forward returned (see the module
    docstring); None when the rule finds no tensor."""
    for _ in range(16):  # nested outputs are shallow; a bound guards against cycles
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, Mapping):
            if "logits" in out:
                out = out["logits"]
            else:
                out = next(iter(out.values()), None)
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        else:
            return None
    return None


def _describe(out: Any) -> str:
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {list(out.keys())[:6]}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} item(s)"
    return f"a {type(out).__name__}"


@contextmanager
def captured(model: nn.Module, n_args: int) -> Iterator[nn.Module]:
    """``model`` with a forward that applies the output rule, for ``torch.export``.

    Args:
        model: the user's module; its class's forward is called with ``n_args`` positional
            tensors (and ``use_cache=False`` when it takes ``use_cache``).
        n_args: how many example arguments the factory gave.

    Raises:
        ConfigError: the forward returned no tensor under the output rule.
    """
    forward = type(model).forward
    extra = {"use_cache": False} if "use_cache" in inspect.signature(forward).parameters else {}

    def picking_forward(*args):
        out = forward(model, *args, **extra)
        tensor = output_tensor(out)
        if tensor is None:
            raise ConfigError(f"model.factory: {type(model).__name__}.forward returned "
                              f"{_describe(out)}, which holds no tensor; return a tensor, a "
                              f"tuple whose first item is one, or a ModelOutput with logits")
        return tensor

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD  # export binds arguments by signature
    picking_forward.__signature__ = inspect.Signature(
        [inspect.Parameter(f"arg{i}", kind) for i in range(n_args)])
    model.forward = picking_forward
    try:
        yield model
    finally:
        del model.forward


def is_transformers_model(module: Any) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (has a config and
    ``save_pretrained``)."""
    return (isinstance(module, nn.Module) and hasattr(module, "save_pretrained")
            and hasattr(module, "config"))


def save_model_dir(module: nn.Module, out_dir: Path) -> list[Path]:
    """Write ``module``'s weights under its own parameter names as safetensors.

    A ``transformers`` model is written with ``save_pretrained`` (``config.json`` and
    ``model.safetensors``; tied weights stored once and re-tied on load), so that
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it. Any other module goes to
    ``model.safetensors`` through ``safetensors.torch.save_model``, which stores a shared
    tensor once.

    Returns:
        The files written.
    """
    if is_transformers_model(module):
        out_dir.mkdir(parents=True, exist_ok=True)
        before = set(out_dir.iterdir())
        module.save_pretrained(out_dir)
        return sorted(set(out_dir.iterdir()) - before)
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ConfigError("trainwright export writes safetensors; install it with "
                          "`pip install safetensors` (or trainwright[hf])") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(module, str(out_dir / "model.safetensors"))
    return [out_dir / "model.safetensors"]
