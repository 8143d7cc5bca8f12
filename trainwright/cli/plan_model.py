"""``trainwright plan --model SPEC``: will it fit, and how fast? A ranked answer.

SPEC is a Hugging Face ``config.json`` (or its folder), a ``package.module:function``
model factory or a built-in model (:mod:`trainwright.model.spec`). Every candidate (pp x
dp, schedule, chunks per rank, micro-batch size, peer swap on or off) is planned
(:mod:`trainwright.plan.candidates`) and printed best first, with the reason each rejected
one was rejected. ``--json OUT`` writes the table, the best plan (the format
``trainwright simulate`` replays), and ``OUT.toml``: the run configuration of the pick,
which ``trainwright run --plan`` (OUT or the TOML) trains with exactly.

On ``--topology cpu`` (a topology of kind ``cpu``: ranks on this host's cores, one node)
the prediction includes this host's calibrated per-action, per-segment, send and receive
overheads and the transport threads' CPU, ranks sharing its cores
(:mod:`trainwright.plan.sharing`; :func:`trainwright.bench.calibrate.calibrate`: cached
per host, measured the first time); the JSON's ``calibration`` names the terms used (None
for GPUs or ``--no-calibration``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainwright.errors import ConfigError

__all__ = ["DEVICES", "cmd_plan_model", "format_ranked", "plan_toml"]

DEVICES = {
    # name: (dense bf16 TFLOP/s, memory GB/s), the vendors' peak figures
    "h100": (989.0, 3350.0),
    "a100": (312.0, 2039.0),
    "v100": (125.0, 900.0),
}
PLAN_FORMAT = 1


def _device_figures(args) -> tuple[float, float]:
    """FLOP/s and memory bytes/s of the cost model: ``--device``, or ``--flops`` and
    ``--mem-gbps`` where given."""
    name = args.device or "v100"
    if name not in DEVICES:
        raise ConfigError(f"--device {args.device!r}: choose one of {sorted(DEVICES)}, or give "
                          f"--flops and --mem-gbps")
    flops, gbps = DEVICES[name]
    return (args.flops or flops) * 1e12, (args.mem_gbps or gbps) * 1e9


def _run_config(args):
    from trainwright.config import load_config

    return load_config(args.config, list(args.set or []))


def _calibration(args, topology):
    """This host's calibration when the devices are its own cores (a ``cpu`` topology of
    one node), loaded from the cache or measured (a progress line on stderr); else None."""
    if topology.kind != "cpu" or args.nodes > 1 or args.no_calibration:
        return None
    from trainwright.bench.calibrate import calibrate

    return calibrate(say=lambda line: print(line, file=sys.stderr, flush=True))


PROFILE_REPEATS = 5
"""Profiles per micro-batch size of a measured model; each layer's time is their median."""


def _measured_rows(model: str, cfg, size: int) -> list:
    """A measured model's layer rows at ``size`` samples per micro-batch, each layer's
    times the median of :data:`PROFILE_REPEATS` profiles.

    Measured at every size rather than scaled from one sample: a larger micro-batch runs
    more samples per second (on this 2-core host a 4-block GPT took 0.65-0.8 of the time
    per sample at 2 and 4 samples), which is what decides between fewer, larger
    micro-batches and more, smaller ones; one pass of a small layer is noisy, hence the
    median."""
    import statistics

    from trainwright.model.spec import load_spec

    runs = [load_spec(model, cfg, micro_batch_size=size).layers
            for _ in range(PROFILE_REPEATS)]
    rows = runs[0]
    for i, row in enumerate(rows):
        row.forward_s = statistics.median(r[i].forward_s for r in runs)
        row.backward_s = statistics.median(r[i].backward_s for r in runs)
    return rows


def cmd_plan_model(args: argparse.Namespace, topology) -> dict:
    """The ranked answer as data (written to ``args.json`` and its ``.toml`` when given)."""
    from trainwright.model.spec import load_spec
    from trainwright.observe.telemetry import atomic_write_text
    from trainwright.plan.candidates import (
        bytes_per_param,
        enumerate_candidates,
        rank_candidates,
        scaled_layers,
    )
    from trainwright.plan.planner import PlanRequest

    t0 = time.perf_counter()
    cfg = _run_config(args)
    flops, bps = _device_figures(args)
    prof = load_spec(args.model, cfg, dtype=args.dtype, flops_per_s=flops, bytes_per_s=bps,
                     seq_len=args.seq_len)
    t_prof = time.perf_counter() - t0
    optimizer = args.optimizer or (cfg.train.optimizer if not prof.meta else "adamw")
    per = bytes_per_param(prof.param_dtype_bytes, optimizer, cfg.train.momentum > 0)
    n_dev = topology.node_size * max(args.nodes, 1)
    batch = args.global_batch or cfg.train.batch_size
    sizes = [args.micro_batch_size] if args.micro_batch_size else [1, 2]
    pps = None if args.pp == "auto" else [_int(args.pp, "--pp")]
    cands, skipped = enumerate_candidates(n_dev, topology.node_size, len(prof.layers), batch,
                                          sizes, pps, peer_swap=not args.no_peer_swap)
    if args.schedule not in (None, "auto"):
        cands = [c for c in cands if c.schedule == args.schedule]
    if not cands:
        raise ConfigError(f"no candidate to plan for {n_dev} devices, global batch {batch}, "
                          f"micro-batch sizes {sizes}: {skipped[:3]}")
    cal = _calibration(args, topology)
    base = PlanRequest(prof.layers, "1f1b", 2, 1, topology,
                       state_factor=per.total / prof.param_dtype_bytes,
                       reserve=_bytes(args.reserve), latency_s=args.latency_us * 1e-6,
                       calibration=cal)
    rows_for = ({k: scaled_layers(prof.layers, k) for k in sizes} if prof.meta
                else {k: _measured_rows(args.model, cfg, k) for k in sizes})
    outs = rank_candidates(cands, rows_for, base, per, prof.param_dtype_bytes,
                           full=max(3, args.top))
    best = outs[0]
    if best.plan is None or not best.fits:
        why = best.reason or "no candidate fits"
        raise ConfigError(f"{args.model} does not fit {n_dev} x {_gib(topology.memory[0])} "
                          f"in any candidate; the closest: {best.candidate.label()}: {why}. "
                          f"Add devices or memory (--nodes, --gpu-memory), or shrink the "
                          f"global batch or micro-batch size")
    wall = time.perf_counter() - t0
    tokens = prof.tokens_per_sample
    out = best.plan.to_dict()
    out.update({
        "format": PLAN_FORMAT, "model": args.model, "model_kind": prof.kind.value,
        "fingerprint": {**prof.fingerprint(), "devices": n_dev,
                        "device_kind": topology.kind, "topology": topology.name},
        "meta": prof.meta, "topology": topology.name, "dp": best.candidate.dp,
        "devices": n_dev, "plan_s": wall, "profile_s": t_prof,
        "global_batch": batch, "micro_batch_size": best.candidate.micro_batch_size,
        "bytes_per_param": {"weights": per.weights, "grads": per.grads,
                            "optimizer": per.optimizer, "optimizer_name": optimizer},
        "params": prof.params, "state_bytes": best.state,
        "device_memory": topology.memory[0],
        "ranked": [_row(o, batch, tokens, topology.memory[0]) for o in outs],
        "skipped": skipped, "calibration": cal.to_dict() if cal is not None else None,
    })
    top = [o for o in outs if o.fits and o.plan is not None][:max(1, args.top)]
    out["top"] = [{"label": o.candidate.label(), "config": _run_keys(o, prof, cfg, batch)}
                  for o in top]
    out["run_config"] = out["top"][0]["config"]
    if args.json:
        path = Path(args.json)
        out["toml"] = str(path.with_suffix(".toml"))
        atomic_write_text(path.with_suffix(".toml"), plan_toml(out))
        atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    return out


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a number or 'auto'") from None


def _bytes(text: str) -> int:
    from trainwright.config import parse_bytes

    return int(parse_bytes(text))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _size(n: float) -> str:
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _row(o, batch: int, tokens: int, memory: int) -> dict:
    c = o.candidate
    ok = o.plan is not None and o.step_s < float("inf")
    return {"label": c.label(), "pp": c.pp, "dp": c.dp, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages, "micro_batches": c.micro_batches,
            "micro_batch_size": c.micro_batch_size, "peer_swap": c.peer_swap,
            "fits": o.fits, "planned": o.planned if o.plan is not None else "no",
            "peak_bytes": o.peak_bytes, "device_memory": memory,
            "step_s": o.step_s if ok else None,
            "samples_per_s": batch / o.step_s if ok else None,
            "tokens_per_s": batch * tokens / o.step_s if ok else None,
            "reason": o.reason,
            "mapping": o.plan.mapping if o.plan is not None else None}


def _run_keys(o, prof, cfg, batch: int) -> dict:
    """The run configuration of one candidate: the run config's own keys, the model's,
    and the plan's choices."""
    from trainwright.plan.candidates import layer_policies, peer_swapped

    plan, c = o.plan, o.candidate
    d = cfg.to_dict()
    for k, v in prof.run_keys.items():
        sec, _, name = k.partition(".")
        if sec in d:
            d[sec][name] = v
    node = plan.mapping
    d["train"].update({"schedule": c.schedule, "micro_batches": c.micro_batches,
                       "batch_size": batch})
    d["parallel"].update({"pp": c.pp, "dp": c.dp, "virtual_stages": c.virtual_stages,
                          "partition": [len(x) for x in plan.partition],
                          "mapping": _local_order(node)})
    if peer_swapped(plan):  # the peer-swap runtime plans its chunks again at start
        d["memory"].update({"peer_swap": True, "policies": [],
                            "limit": [int(b) for b in plan.budgets]})
    else:
        pol = layer_policies(plan, len(prof.layers))
        d["memory"]["policies"] = [] if set(pol) == {"keep"} else pol
    d["run"].pop("dir", None)
    return d


def _local_order(mapping: list[int]) -> list[int]:
    """Stage -> rank position inside a replica's block: the planner's devices, ranked."""
    order = sorted(range(len(mapping)), key=lambda s: mapping[s])
    pos = [0] * len(mapping)
    for p, s in enumerate(order):
        pos[s] = p
    return pos


def plan_toml(out: dict) -> str:
    """The pick's run configuration as TOML, with the ``[plan]`` fingerprint ``run --plan``
    checks."""
    import tomli_w

    doc = {k: v for k, v in out["run_config"].items() if v not in ({}, None)}
    doc["plan"] = {**out["fingerprint"], "format": out["format"]}
    return tomli_w.dumps(doc)


def format_ranked(out: dict, limit: int = 12) -> str:
    """The table ``trainwright plan --model SPEC`` prints, best first, then the rejected."""
    mem = out["device_memory"]
    fits = [r for r in out["ranked"] if r["fits"]]
    bad = [r for r in out["ranked"] if not r["fits"]]
    n = out["params"]
    size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3g} M"
    lines = [f"{out['model']}: {size} parameters, {out['fingerprint']['layers']} layers; "
             f"{out['devices']} devices ({out['topology']}, "
             f"{_gib(mem)} each); global batch {out['global_batch']}; "
             f"{len(out['ranked'])} candidates in {out['plan_s']:.1f} s",
             f"{'#':>2}  {'pp x dp':<8} {'schedule':<30} {'micro-batches':>13} "
             f"{'peak / device':>18} {'step s':>9} {'samples/s':>10} {'tokens/s':>11}"]
    for i, r in enumerate(fits[:limit]):
        sched = r["schedule"] + (f" v={r['virtual_stages']}" if r["virtual_stages"] > 1
                                 else "") + ("" if r["peer_swap"] else " no-peer")
        pxd = f"{r['pp']}x{r['dp']}"
        lines.append(f"{i + 1:>2}  {pxd:<8} {sched:<30} "
                     f"{r['micro_batches']:>6} of {r['micro_batch_size']:<4} "
                     f"{max(r['peak_bytes']) / 2**30:>6.1f} / {mem / 2**30:<6.1f}GiB "
                     f"{r['step_s']:>9.3f} {r['samples_per_s']:>10.1f} "
                     f"{r['tokens_per_s']:>11.4g}" + ("" if r["planned"] == "full"
                                                      else "  (screened)"))
    if len(fits) > limit:
        lines.append(f"    ... {len(fits) - limit} more that fit (--json has them all)")
    if out.get("calibration"):
        from trainwright.plan.calibration import Calibration

        lines.append("includes this host's calibration: "
                     f"{Calibration.from_dict(out['calibration']).describe()}")
    lines.append(f"rejected ({len(bad)}):")
    for r in bad[:limit]:
        lines.append(f"    {r['label']}: {r['reason']}")
    if len(bad) > limit:
        lines.append(f"    ... {len(bad) - limit} more (--json has them all)")
    order = out["run_config"]["parallel"]["mapping"]
    lines.append(f"pick: {fits[0]['label']}, stage -> rank {order}"
                 f"; weights+grads+optimizer per stage "
                 f"{' / '.join(_size(sum(s.values())) for s in out['state_bytes'])}")
    if out.get("toml"):
        lines.append(f"run it with: trainwright run --plan {out['toml']}")
    return "\n".join(lines)
