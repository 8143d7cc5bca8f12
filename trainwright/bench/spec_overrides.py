"""``--spec KEY=VALUE`` for every benchmark: checked against the spec's fields, one clear error."""

from __future__ import annotations

import json
from dataclasses import asdict

from trainwright.errors import ConfigError

__all__ = ["spec_overrides"]

_KINDS = {int: "an integer", float: "a number", list: "a JSON list such as [5,5]"}


def _parse(kind: type, value: str):
    if kind is list:
        got = json.loads(value)
        if not isinstance(got, list):
            raise ValueError(value)
        return got
    return kind(value)


def spec_overrides(bench: str, default, items: list[str] | None) -> dict:
    """Field values for ``bench``'s spec dataclass from ``--spec KEY=VALUE`` items.

    Only the integer, float and list fields of ``default`` (an instance of the spec) can be
    set; lists are given as JSON.

    Raises:
        ConfigError: an unknown key (the message lists the valid ones) or a value of the
            wrong kind.
    """
    fields = {k: type(v) for k, v in asdict(default).items() if type(v) in _KINDS}
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        if key not in fields:
            raise ConfigError(f"bench {bench}: --spec {item!r}: unknown key {key!r}; "
                              f"choose one of {sorted(fields)}")
        try:
            out[key] = _parse(fields[key], value)
        except ValueError:
            raise ConfigError(f"bench {bench}: --spec {item!r}: {key} must be "
                              f"{_KINDS[fields[key]]}") from None
    return out
