"""One-line :class:`~trainwright.errors.ConfigError` messages from pydantic validation errors.

pydantic checks the types and per-field ranges of the configuration; its
:class:`~pydantic.ValidationError` lists every failure over several lines. Users get one
line instead, naming the key as ``section.key``, the bad value and what is allowed, and
"did you mean" for a misspelt key. Only the first failure is reported (the others usually
follow from it, and the run cannot start until it is fixed anyway).

Hand-written because no library words validation errors this way.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from trainwright.errors import ConfigError

__all__ = ["Allowed", "one_line", "unknown"]


@dataclass(frozen=True)
class Allowed:
    """``Annotated`` marker: the error message's "what is allowed" part for a range check,
    in place of the generic ``must be positive`` / ``must be >= 0``."""

    text: str


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
             "bool_type": "true or false", "list_type": "a list such as [3, 3]"}
"""pydantic error type -> the value the key expects, for "has the wrong type" messages."""


def unknown(name: str, allowed: list[str], what: str) -> str:
    """``unknown config key 'x'; did you mean 'y'? allowed: ...`` (``what``: key or section)."""
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown config {what} {name!r}; {hint}allowed: {', '.join(allowed)}"


def one_line(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> ConfigError:
    """The first failure of ``exc`` (raised validating ``model``) as a one-line ConfigError.

    Args:
        exc: pydantic's error.
        model: the model class that was validated (a section, or the whole Config).
        prefix: the section name when ``model`` is a section (keys become ``prefix.key``).

    Returns:
        The error to raise; a ConfigError raised by a cross-field rule comes back as it is.
    """
    err = exc.errors()[0]
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), ConfigError):  # a model validator's own message
        return ctx["error"]
    names = [prefix] if prefix else []
    owner, info = model, None
    for part in err["loc"]:
        if isinstance(part, int):  # an item of a list
            names[-1] += f"[{part}]"
            continue
        names.append(str(part))
        if owner is None:
            continue
        info = owner.model_fields.get(str(part))
        if info is None:
            break
        sub = info.annotation
        owner = sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
    key, value, kind = ".".join(names), err["input"], err["type"]
    if kind == "extra_forbidden":
        parent = ".".join(names[:-1])
        if not parent:
            return ConfigError(unknown(key, list(model.model_fields), "section"))
        fields = _fields_at(model, names[1:-1] if prefix else names[:-1])
        return ConfigError(unknown(key, [f"{parent}.{f}" for f in fields], "key"))
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"[{key}] must be a table of keys, got {value!r}")
    if kind == "literal_error" and choices_of(getattr(info, "annotation", None)):
        choices = list(choices_of(info.annotation))
        return ConfigError(f"{key} = {value!r} is not allowed; choose one of {choices}")
    if kind in _EXPECTED:
        return ConfigError(f"{key} = {value!r} has the wrong type ({type(value).__name__}); "
                           f"expected {_EXPECTED[kind]}")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "range"):
        return ConfigError(f"{key} = {value!r} {_range_text(info, ctx)}")
    if kind == "finite_number":
        return ConfigError(f"{key} = {value!r} is not a finite number; give a finite number")
    return ConfigError(f"{key} = {value!r}: {err['msg']}")


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """Field names of the (nested) model reached from ``model`` through ``path``."""
    for part in path:
        model = model.model_fields[part].annotation
    return list(model.model_fields)


def _range_text(info: Any, ctx: dict[str, Any]) -> str:
    """What a range check allows: the field's :class:`Allowed` text, else from the bound."""
    for m in getattr(info, "metadata", []):
        if isinstance(m, Allowed):
            return m.text
    if not ctx:  # a custom range check without an Allowed text
        return "is out of range"
    op, bound = next(iter(ctx.items()))
    if op == "gt" and bound == 0:
        return "must be positive"
    return f"must be {dict(gt='>', ge='>=', lt='<', le='<=')[op]} {bound!r}"


def choices_of(annotation: Any) -> tuple | None:
    """The allowed values of a ``Literal[...]`` annotation, else None."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None
