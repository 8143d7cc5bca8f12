"""Every config key with a valid range refuses an out-of-range value before any process starts.

The keys and their bounds are read from the section models (``annotated_types`` bounds on
each field, or on the items of a list field), so a key added later is walked too; a numeric
key without a bound fails :func:`test_every_numeric_key_has_a_range`.
"""

from __future__ import annotations

import math
import typing

import annotated_types as at
import pytest

from trainwright.cli import main
from trainwright.config.sections import SECTIONS

NUMBERS = (int, float)


def _bounds(metadata: list) -> list:
    """The ``Gt``/``Ge``/``Lt``/``Le`` bounds in a field's (or an item's) metadata, and
    ``0`` for a key that rejects zero (``AfterValidator(_not_zero)``)."""
    out = []
    for m in metadata:
        if isinstance(m, (at.Gt, at.Ge, at.Lt, at.Le)):
            out.append(m)
        if getattr(getattr(m, "func", None), "__name__", "") == "_not_zero":
            out.append(0)
        out.extend(_bounds(list(getattr(m, "metadata", []) or [])))  # a nested FieldInfo
    return out


def _numeric(annotation) -> tuple[type, list, bool] | None:
    """``(number type, bounds, is_list)`` of a numeric field or list-of-numbers field."""
    is_list = typing.get_origin(annotation) is list
    if is_list:
        annotation = typing.get_args(annotation)[0]
    meta: list = []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        meta.extend(extra)
    if annotation in NUMBERS:
        return annotation, meta, is_list
    return None


def _keys() -> list[tuple[str, type, list, bool]]:
    """Every numeric key: ``(section.key, type, bounds, is_list)``."""
    keys = []
    for section, model in SECTIONS.items():
        for name, info in model.model_fields.items():
            found = _numeric(info.annotation)
            if found is None:
                continue
            kind, meta, is_list = found
            bounds = _bounds(meta) + ([] if is_list else _bounds(info.metadata))
            keys.append((f"{section}.{name}", kind, bounds, is_list))
    return keys


def _outside(kind: type, bound) -> list:
    """Values just outside one bound (for an int key, the nearest integers outside)."""
    step = 1 if kind is int else 0.5
    if bound == 0:
        return [0]
    if isinstance(bound, at.Gt):
        return [bound.gt, bound.gt - step]
    if isinstance(bound, at.Ge):
        return [bound.ge - step]
    if isinstance(bound, at.Lt):
        return [bound.lt, bound.lt + step]
    return [bound.le + step]


def _cases() -> list[tuple[str, str]]:
    cases = []
    for key, kind, bounds, is_list in _keys():
        values = [v for b in bounds for v in _outside(kind, b)]
        if kind is float:
            values += [math.nan, math.inf]
        for v in values:
            text = {math.inf: "inf"}.get(v, "nan" if v != v else repr(v))
            cases.append((key, f"[{text}]" if is_list else text))
    return cases


def test_every_numeric_key_has_a_range():
    """A numeric key without a bound would let any value reach the workers."""
    keys = _keys()
    assert len(keys) > 40, keys  # the walk really finds the sections' keys
    unbounded = [key for key, _, bounds, _ in keys if not bounds]
    assert not unbounded, f"give these keys a range in config/sections.py: {unbounded}"


@pytest.mark.timeout(120)
def test_each_out_of_range_value_is_one_line_naming_the_key(tmp_path, capsys):
    """``trainwright run --set key=value`` for every bound of every key: exit 2, one line
    naming the key, no run directory."""
    cases = _cases()
    assert len(cases) > 80
    failures = []
    for key, value in cases:
        code = main(["run", "--set", f"{key}={value}", "--set", f'run.dir="{tmp_path}"'])
        err = capsys.readouterr().err.strip()
        ok = (code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {key}")
              and not any(tmp_path.iterdir()))
        if not ok:
            failures.append((key, value, code, err))
    assert not failures, failures


@pytest.mark.timeout(60)
def test_out_of_range_in_a_toml_file_and_unused_sections(tmp_path, capsys):
    """The same checks from a TOML file, for sections the run does not use (the ring's keys
    with dense sync, fault injection without a fault)."""
    for text, key in [
        ("[tokenring]\nclose_fraction = 1.5\n", "tokenring.close_fraction"),
        ("[tokenring]\nnodes = 2\nslow_node = 3\n", "tokenring.slow_node"),
        ("[tokenring]\nnodes = 2\nmin_nodes = 3\n", "tokenring.min_nodes"),
        ("[train]\nlr = nan\n", "train.lr"),
        ("[fault]\nkill_rank = 2\n", "fault.kill_rank"),  # default job: ranks 0..1
        ("[rebalance]\nmin_gain = 1.0\n", "rebalance.min_gain"),
    ]:
        path = tmp_path / "cfg.toml"
        path.write_text(text + f'[run]\ndir = "{tmp_path / "runs"}"\n')
        assert main(["run", str(path)]) == 2, text
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {key}"), (text, err)
        assert not (tmp_path / "runs").exists()
