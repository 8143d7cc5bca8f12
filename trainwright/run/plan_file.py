"""``trainwright run --plan PLAN``: the run configuration a plan chose, checked against the
model and the machine before anything starts.

``trainwright plan --model SPEC --json PLAN.json`` writes the pick's run configuration in
the JSON (``top``: the best candidates, each with its ``config``) and as ``PLAN.toml`` (the
configuration sections and a ``[plan]`` table, the fingerprint). Either file runs here with
exactly the plan's pipeline depth, schedule, micro-batches, partition, per-layer policies
and stage-to-rank mapping (``parallel.mapping``). A plan is refused in one line when the
model this configuration builds has other layers or parameters than the plan's, or when
the plan was made for another kind of device (GPUs) than this machine has.
"""

from __future__ import annotations

import json
from pathlib import Path

import tomllib
import torch

from trainwright.config import Config
from trainwright.config.core import read_config
from trainwright.errors import ConfigError

__all__ = ["load_plan_config", "check_plan_model"]


def _read(path: Path, candidate: int) -> tuple[dict, dict]:
    """``(configuration sections, fingerprint)`` of a plan file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--plan {path}: no such file; write one with `trainwright plan "
                          f"--model SPEC --json PLAN.json`") from None
    try:
        if path.suffix == ".toml":
            doc = tomllib.loads(text)
            if candidate != 1:
                raise ConfigError(f"--candidate {candidate}: the TOML holds the pick only; "
                                  f"pass the plan's JSON to run another candidate")
            return {k: v for k, v in doc.items() if k != "plan"}, doc["plan"]
        doc = json.loads(text)
        top = doc["top"]
        if not 1 <= candidate <= len(top):
            raise ConfigError(f"--candidate {candidate}: {path} holds {len(top)} candidates "
                              f"(1..{len(top)}); plan again with --top N for more")
        return top[candidate - 1]["config"], doc["fingerprint"]
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"--plan {path}: not a plan written by `trainwright plan --model SPEC "
                          f"--json` ({type(exc).__name__}: {exc})") from None


def load_plan_config(path: str | Path, overrides: list[str] | tuple = (),
                     candidate: int = 1, cuda: bool | None = None) -> Config:
    """The run configuration of a plan (its ``candidate``-th best), with ``overrides``.

    Args:
        path: the plan's JSON or TOML.
        overrides: ``section.key=value`` strings applied on top (a model key that changes
            the model makes the plan refuse: :func:`check_plan_model`).
        candidate: 1 = the pick; 2.. the next candidates the JSON holds (``plan --top``).
        cuda: whether this machine has CUDA devices (default: ask torch).

    Raises:
        ConfigError: unreadable plan, a plan for other devices or another model.
    """
    path = Path(path)
    sections, fp = _read(path, candidate)
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    kind = fp.get("device_kind", "cuda")
    if kind == "cuda" and not has_cuda:
        raise ConfigError(f"--plan {path} was made for {fp.get('devices')} GPUs "
                          f"({fp.get('topology')}) and this machine has none; plan for it "
                          f"with `trainwright plan --topology cpu --devices N`")
    if kind == "cpu" and has_cuda:
        raise ConfigError(f"--plan {path} was made for CPU ranks and this machine has GPUs; "
                          f"plan again with --topology nvidia-smi (or a preset)")
    data = read_config(None, list(overrides))
    for sec, keys in sections.items():
        data[sec] = {**keys, **data.get(sec, {})}
    # the model first: a plan's partition and policies would not validate against another
    # model, and the message should say that the model changed
    bare = {**data, "parallel": {k: v for k, v in data.get("parallel", {}).items()
                                 if k not in ("partition", "virtual_stages")},
            "memory": {k: v for k, v in data.get("memory", {}).items() if k != "policies"},
            "train": {k: v for k, v in data.get("train", {}).items() if k != "schedule"}}
    check_plan_model(Config.from_dict(bare), fp, path)
    cfg = Config.from_dict(data)
    if cfg.world_size != fp.get("devices", cfg.world_size):
        raise ConfigError(f"--plan {path} was made for {fp['devices']} devices; this run has "
                          f"parallel.pp x dp = {cfg.world_size}; plan again for it")
    return cfg


def check_plan_model(cfg: Config, fp: dict, path: Path) -> None:
    """Refuse a plan made for another model than ``cfg`` builds (layers, parameters).

    Raises:
        ConfigError: one line naming both models.
    """
    from trainwright.model.build import build_model

    named, module = build_model(cfg)
    params = sum(p.numel() for p in module.parameters())
    if (len(named), params) != (fp.get("layers"), fp.get("params")):
        raise ConfigError(f"--plan {path} was made for {fp.get('spec')} ({fp.get('layers')} "
                          f"layers, {fp.get('params')} parameters); this configuration builds "
                          f"{len(named)} layers, {params} parameters; plan this model again")
