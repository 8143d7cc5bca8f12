"""``trainwright plan`` and ``trainwright simulate``: the peer-swap planner on the command line.

``trainwright plan`` profiles a GPT (for real when small, on the meta device when large:
nothing is allocated), takes a topology (a preset, a JSON file, or ``nvidia-smi`` where a
GPU exists) and budgets, and prints and writes the plan: partition, stage-to-device mapping,
per-tensor policies, predicted step time and per-device peak. ``--pp auto`` tries several
pipeline depths (``pp * dp`` = all devices) and keeps the fastest plan that fits.

``--model SPEC`` with a Hugging Face ``config.json``, a model factory or a built-in model
(``gpt``, ``mlp``), or ``--rank`` with a preset, gives the ranked answer of
:mod:`trainwright.cli.plan_model` instead: every candidate best first, the rejected with why.

``trainwright simulate PLAN.json`` replays a written plan and draws its timeline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from trainwright.errors import ConfigError
from trainwright.model.gpt_profile import gpt_profile
from trainwright.schedule.base import ActionKind

__all__ = ["add_parsers", "cmd_plan", "cmd_simulate", "format_plan", "gpt_profile", "PRESET_MODELS"]

PRESET_MODELS = {
    # name: (n_blocks, d_model, n_heads, context, vocab)
    "gpt-small": (6, 256, 4, 128, 256),
    "gpt-1.3b": (24, 2048, 16, 2048, 50257),
    "gpt-13b": (40, 5120, 40, 2048, 50257),
    "gpt3-175b": (96, 12288, 96, 2048, 50257),
}


def _bytes(text: str) -> int:
    from trainwright.config import parse_bytes

    try:
        return int(parse_bytes(text))
    except Exception:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 80GB, 512MiB or "
                          f"1073741824") from None


def _topology(args):
    from trainwright.dist.probe import from_nvidia_smi
    from trainwright.plan.devices import PRESETS, DeviceTopology, cluster, preset

    mem = _bytes(args.gpu_memory)
    if args.topology in PRESETS:
        topo = preset(args.topology, mem)
    elif args.topology == "nvidia-smi":
        topo = from_nvidia_smi()
    else:
        path = Path(args.topology)
        if not path.exists():
            raise ConfigError(f"--topology {args.topology!r}: not a preset ({', '.join(PRESETS)}), "
                              f"not 'nvidia-smi' and no such file")
        try:
            topo = DeviceTopology.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--topology {path}: not JSON ({exc})") from None
    if args.devices:
        topo = _first(topo, args.devices)
    if args.nodes > 1:
        topo = cluster(topo, args.nodes, args.inter_node_gbps * 1e9)
    return topo


def _first(topo, n: int):
    """The first ``n`` devices of a one-node table."""
    from dataclasses import replace

    if not 1 <= n <= topo.n:
        raise ConfigError(f"--devices {n}: the topology {topo.name} has {topo.n} devices per "
                          f"node; give 1..{topo.n}")
    return replace(topo, memory=topo.memory[:n], bandwidth=[r[:n] for r in topo.bandwidth[:n]],
                   host_bandwidth=topo.host_bandwidth[:n], node_size=n,
                   labels=topo.labels[:n])


def _pp_options(args, n_devices: int, n_layers: int, node: int) -> list[int]:
    if args.pp != "auto":
        try:
            return [int(args.pp)]
        except ValueError:
            raise ConfigError(f"--pp {args.pp!r}: give a number or 'auto'") from None
    out = [p for p in range(2, min(n_devices, n_layers) + 1)
           if n_devices % p == 0 and (p <= node or p % node == 0)]
    return out[-4:] or [1]


def _check_virtual_stages(schedule: str, v: int | None) -> None:
    """``--virtual-stages`` fits the schedule: 2 or more for interleaved 1F1B, 2 for ZB-V,
    not given otherwise (``auto`` chooses it)."""
    if v is None:
        return
    if schedule == "interleaved-1f1b" and v < 2:
        raise ConfigError(f"--virtual-stages {v}: interleaved-1f1b needs 2 or more chunks "
                          f"per rank")
    if schedule == "zb-v" and v != 2:
        raise ConfigError(f"--virtual-stages {v}: zb-v places exactly 2 chunks per rank")
    if schedule not in ("interleaved-1f1b", "zb-v"):
        raise ConfigError(f"--virtual-stages goes with --schedule interleaved-1f1b or zb-v, "
                          f"not {schedule} (auto tries 2 to 4 chunks itself)")


def cmd_plan(args: argparse.Namespace) -> dict:
    """``trainwright plan``: the plan as data (also written to ``args.json`` when given)."""
    from trainwright.observe.telemetry import atomic_write_text
    from trainwright.plan.choose import best_plan, schedule_candidates
    from trainwright.plan.placement import Rules
    from trainwright.plan.planner import PlanRequest

    if args.rank or args.model not in PRESET_MODELS:
        from trainwright.cli.plan_model import cmd_plan_model
        return cmd_plan_model(args, _topology(args))
    args.schedule = args.schedule or "1f1b"
    _check_virtual_stages(args.schedule, args.virtual_stages)
    topo = _topology(args)
    n_dev = topo.node_size * max(args.nodes, 1)
    t0 = time.perf_counter()
    nb, d, h, ctx, vocab = PRESET_MODELS[args.model]
    meta = args.meta or d * d * nb * 12 > 2e8
    layers = gpt_profile(nb, d, h, ctx, vocab, args.micro_batch_size or 1, meta, args.dtype,
                         (args.flops or 125.0) * 1e12, (args.mem_gbps or 900.0) * 1e9)
    t_prof = time.perf_counter() - t0
    best = None
    tried = []
    for pp in _pp_options(args, n_dev, len(layers), topo.node_size):
        dp = n_dev // pp
        mbs, batch = args.micro_batch_size or 1, args.global_batch or 64
        if batch % (dp * mbs):
            continue
        m = batch // dp // mbs
        grad = sum(x.param_bytes for x in layers) / pp
        sync = 2 * (dp - 1) / dp * grad / (topo.inter_node_bandwidth or 1e10) if dp > 1 else 0.0
        if args.schedule == "auto":
            pairs, skipped = schedule_candidates(pp, m, len(layers))
            tried += skipped
        else:
            multi = args.schedule in ("interleaved-1f1b", "zb-v")
            pairs = [(args.schedule, args.virtual_stages or (2 if multi else 1))]
        req = PlanRequest(layers, args.schedule, pp, m, topo,
                          budget=_bytes(args.budget) if args.budget else None,
                          state_factor=args.state_factor, reserve=_bytes(args.reserve),
                          rules=Rules(), peer_swap=not args.no_peer_swap,
                          latency_s=args.latency_us * 1e-6, sync_s=sync)
        plan, rows = best_plan(req, pairs)
        tried += [{**r, "dp": dp} for r in rows]
        if plan is None:
            continue
        key = (not all(sp.fits for sp in plan.placement.stages), plan.sim.step_s)
        if best is None or key < best[0]:
            best = (key, plan, pp, dp)
    if best is None:
        raise ConfigError(f"no pipeline depth could be planned: {tried}")
    _, plan, pp, dp = best
    wall = time.perf_counter() - t0
    out = plan.to_dict()
    out.update({"model": args.model, "meta": meta, "topology": topo.name, "dp": dp,
                "devices": n_dev, "plan_s": wall, "profile_s": t_prof, "depths_tried": tried})
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(out, indent=1) + "\n")
    return out


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def format_plan(out: dict) -> str:
    """The plan as the table ``trainwright plan`` prints (the ranked table for a plan of
    ``--model SPEC``)."""
    if "ranked" in out:
        from trainwright.cli.plan_model import format_ranked
        return format_ranked(out)
    v = out.get("virtual_stages", 1)
    ranks = out.get("stage_ranks") or list(range(out["pp"]))
    chunks = f" x {v} chunks per rank" if v > 1 else ""
    lines = [f"model {out['model']} on {out['devices']} devices ({out['topology']}): "
             f"pp={out['pp']} x dp={out['dp']}{chunks}, {out['schedule']}, "
             f"{out['micro_batches']} micro-batches; planned in {out['plan_s']:.2f} s",
             f"predicted step {out['predicted']['step_s']:.3f} s "
             f"(all keep {out['all_keep']['step_s']:.3f} s)",
             "run it with: " + " ".join(
                 f"--set '{k}={json.dumps(x, separators=(',', ':'))}'"
                 for k, x in out["config"].items()),
             "stage  layers      device  budget       peak         fits  policies"]
    for s in range(out["pp"]):
        spans = ",".join(f"{layers[0]}-{layers[-1]}" for k, layers in enumerate(out["partition"])
                         if ranks[k] == s)
        b = out["budgets"][s]
        lines.append(f"{s:<6} {spans:<11} {out['mapping'][s]:<7} "
                     f"{_fmt(b) if b is not None else '-':<12} "
                     f"{_fmt(out['predicted']['peak_bytes'][s]):<12} {str(out['fits'][s]):<5} "
                     f"{out['policy_counts'][s]}")
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> dict:
    """``trainwright simulate``: the plan's figures (timeline PNG to ``args.png`` when given)."""
    from trainwright.plan.calibration import scaled
    from trainwright.plan.simulate import Links, StageCost, simulate
    from trainwright.schedule.actions import build_schedule
    from trainwright.schedule.carry import simulated_lists
    from trainwright.schedule.peer import with_peer_swap

    path = Path(args.plan)
    try:
        plan = json.loads(path.read_text())
        costs = [StageCost(**c) for c in plan["stage_costs"]]
        for c in costs:
            c.peer_bytes = {int(k): v for k, v in c.peer_bytes.items()}
        peers = {int(k): v for k, v in plan["peers"].items()}
        sched = with_peer_swap(build_schedule(plan["schedule"], plan["pp"],
                                              plan["micro_batches"],
                                              plan.get("virtual_stages", 1)), peers)
        sched = simulated_lists(plan["schedule"], sched,  # as the planner simulated it
                                plan.get("carry_weight_grads", True))
        slowdown = float(plan["predicted"].get("slowdown", 1.0))  # ranks sharing cores
    except FileNotFoundError:
        raise ConfigError(f"no plan file {path}; write one with `trainwright plan --json`") \
            from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a plan written by `trainwright plan --json` "
                          f"({exc})") from None
    n = plan["pp"]
    links = Links(list(range(n)), plan["stage_bandwidth"], latency_s=args.latency_us * 1e-6)
    r = simulate(sched, scaled(costs, slowdown) if slowdown != 1.0 else costs, links)
    figures = {"step_s": r.step_s, "bubble": [round(b, 4) for b in r.bubble],
               "peak_bytes": r.peak_bytes, "activation_peak_bytes": r.own_peak_bytes}
    if args.png:
        draw_timeline(r, Path(args.png), title=f"{path.name}: step {r.step_s:.3f} s")
    return figures


def draw_timeline(r, path: Path, title: str = "") -> None:
    """Gantt chart of every stage's actions and its memory over time (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(r.busy_s)
    colors = {ActionKind.F: "#4C72B0", ActionKind.B: "#DD8452", ActionKind.PEER_SEND: "#55A868",
              ActionKind.PEER_WAIT: "#C44E52", ActionKind.PEER_RETURN: "#8172B3",
              ActionKind.SYNC: "#937860", ActionKind.STEP: "#DA8BC3"}
    fig, (ax, mx) = plt.subplots(2, 1, figsize=(12, 2 + 0.5 * n + 3), sharex=True,
                                 gridspec_kw={"height_ratios": [max(n, 2), 3]})
    for s, kind, _mb, start, end in r.timeline:
        if end > start and kind in colors:
            ax.barh(s, end - start, left=start, color=colors[kind], edgecolor="none")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"stage {s}" for s in range(n)])
    ax.invert_yaxis()
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=len(colors), fontsize=7, loc="upper right")
    for s, curve in enumerate(r.memory):
        if curve:
            xs, ys = zip(*curve, strict=True)
            mx.step(xs, [y / 2**20 for y in ys], where="post", label=f"stage {s}")
    mx.set_ylabel("MiB held")
    mx.set_xlabel("seconds")
    if n <= 16:
        mx.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def add_parsers(sub, on_plan, on_simulate) -> None:
    """Add the ``plan`` and ``simulate`` subcommands (handled by ``on_plan`` / ``on_simulate``,
    which print what :func:`cmd_plan` / :func:`cmd_simulate` return)."""
    p = sub.add_parser("plan", help="plan partition, device mapping and per-tensor memory "
                       "policies (peer swap, host swap, recompute) and predict step time and peaks")
    p.add_argument("--model", default="gpt-small", metavar="SPEC",
                   help=f"a Hugging Face config.json (or its folder), a model factory "
                        f"'package.module:function', a built-in model (gpt, mlp: sized by "
                        f"--config / --set) or a preset: {sorted(PRESET_MODELS)}")
    p.add_argument("--rank", action="store_true", help="the ranked answer for a preset too "
                   "(automatic for any other SPEC)")
    p.add_argument("--config", default=None, help="run configuration TOML (model, data and "
                   "training keys of a built-in or factory model)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="run configuration "
                   "override, as in `trainwright run` (repeatable)")
    p.add_argument("--device", default=None, help="device peak figures for the cost model: "
                   "h100, a100 or v100 (default v100; --flops / --mem-gbps override)")
    p.add_argument("--optimizer", default=None, choices=["adam", "adamw", "sgd"],
                   help="optimizer state per parameter (default: the run config's; adamw "
                        "for a config.json)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample of a "
                   "config.json model (default: its max_position_embeddings)")
    p.add_argument("--devices", type=int, default=0, help="use the first N devices of a "
                   "node (e.g. --topology cpu --devices 4)")
    p.add_argument("--top", type=int, default=3, help="plan this many candidates in full and "
                   "write their run configurations (run one with run --plan --candidate K)")
    p.add_argument("--meta", action="store_true", help="profile on the meta device (automatic "
                   "for large models)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--topology", default="dgx1", help="nvswitch8, dgx1, pcie8, cpu (ranks "
                   "on this host), nvidia-smi or a topology JSON file")
    p.add_argument("--gpu-memory", default="32GiB", help="memory per device")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s per device "
                   "between nodes")
    p.add_argument("--pp", default="auto", help="pipeline stages, or 'auto'")
    p.add_argument("--schedule", default=None,
                   choices=["1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v",
                            "auto"],
                   help="pipeline schedule (default 1f1b; with --model SPEC: auto), or "
                        "'auto': the one of least predicted step time, "
                        "interleaved 1F1B (2..4 chunks per rank) and ZB-V included (all but "
                        "1f1b and gpipe are planned without peer swap)")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="model chunks per rank for interleaved-1f1b (default 2; zb-v: 2)")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step "
                   "(default 64; with --model SPEC: the run config's train.batch_size)")
    p.add_argument("--micro-batch-size", type=int, default=0, help="samples per micro-batch "
                   "(default 1; with --model SPEC: 1, 2 and 4 are tried)")
    p.add_argument("--budget", default="", help="activation bytes per device (default: memory "
                   "minus state_factor x parameters minus reserve)")
    p.add_argument("--state-factor", type=float, default=4.0, help="device bytes per parameter "
                   "byte for parameters, gradients and optimizer state (4: fp32 Adam)")
    p.add_argument("--reserve", default="2GiB")
    p.add_argument("--no-peer-swap", action="store_true")
    p.add_argument("--no-calibration", action="store_true", help="with --model SPEC on "
                   "--topology cpu: predict without this host's calibrated per-action "
                   "overheads and shared-core slowdown (cached in ~/.cache/trainwright)")
    p.add_argument("--flops", type=float, default=None, help="device TFLOP/s (cost model; "
                   "default 125)")
    p.add_argument("--mem-gbps", type=float, default=None, help="device memory GB/s "
                   "(default 900)")
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument("--json", metavar="PATH", help="write the plan here")
    p.set_defaults(func=on_plan)

    s = sub.add_parser("simulate", help="replay a plan written by `trainwright plan --json`: "
                       "timeline image and figures")
    s.add_argument("plan")
    s.add_argument("--png", metavar="PATH", help="write the timeline here")
    s.add_argument("--latency-us", type=float, default=10.0)
    s.set_defaults(func=on_simulate)

