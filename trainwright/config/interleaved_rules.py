"""Cross-field rules of ``parallel.virtual_stages`` (interleaved 1F1B)."""

from __future__ import annotations

from trainwright.errors import ConfigError

__all__ = ["check_virtual_stages", "INTERLEAVED"]

INTERLEAVED = ("interleaved-1f1b", "zb-v")
"""Schedules that run several model chunks (virtual stages) per rank."""


def check_virtual_stages(cfg) -> None:
    """Refuse combinations interleaved 1F1B does not run: one line each, naming the fix."""
    v, sch = cfg.parallel.virtual_stages, cfg.train.schedule
    p, m = cfg.parallel.pp, cfg.train.micro_batches
    if sch in INTERLEAVED and v < 2:
        raise ConfigError(f"train.schedule = \"{sch}\" needs parallel.virtual_stages >= 2 "
                          f"(model chunks per rank), got {v}")
    if sch not in INTERLEAVED and v != 1:
        raise ConfigError(f"parallel.virtual_stages = {v} needs train.schedule = "
                          f"\"interleaved-1f1b\" or \"zb-v\", not {sch!r}; set one, or "
                          f"virtual_stages = 1")
    if sch == "zb-v" and v != 2:
        raise ConfigError(f"train.schedule = \"zb-v\" places two chunks per rank in a V; set "
                          f"parallel.virtual_stages = 2, not {v}")
    if v == 1:
        return
    if p < 2:
        raise ConfigError(f"train.schedule = \"{sch}\" interleaves chunks over pipeline ranks "
                          f"and needs parallel.pp >= 2, got {p}")
    if sch == "interleaved-1f1b" and m % p:
        raise ConfigError(f"train.schedule = \"{sch}\" needs train.micro_batches to be a "
                          f"multiple of parallel.pp = {p}, got {m}")
    # peer swap and live migration are refused for every schedule but 1F1B / GPipe (core);
    # memory.limit planning works (one limit per rank, over all its chunks)
    if cfg.eval.every:
        raise ConfigError(f"eval.every works with one stage per rank, not train.schedule = "
                          f"{sch!r}; set eval.every = 0 (evaluate the exported model instead)")
