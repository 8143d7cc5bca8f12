"""``trainwright run | report | export | schedule | bench | plan | simulate``: the command line.

Configuration errors print one line and exit 2 before any process starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from trainwright.errors import ConfigError, PlanError
from trainwright.observe.telemetry import atomic_write_text, setup_logging
from trainwright.schedule.actions import SCHEDULES, VIRTUAL_SCHEDULES

__all__ = ["main"]

EXIT_CONFIG = 2


def _cmd_run(args: argparse.Namespace) -> int:
    from trainwright.config.combinations import check_start
    from trainwright.run.launch import create_run_dir, in_torchrun, launch_local
    from trainwright.run.worker import resume_hint

    if args.resume:
        resume_dir = Path(args.resume)
        if not (resume_dir / "config.toml").exists():
            raise ConfigError(f"--resume {args.resume}: no config.toml there; pass the run "
                              f"directory a previous `trainwright run` printed")
        if args.config:
            raise ConfigError("give either CONFIG or --resume RUN_DIR (the run keeps its config; "
                              "change keys with --set)")
        cfg = _load(resume_dir / "config.toml", args.set)
    else:
        resume_dir = None
        cfg = _load(args.config, args.set)

    check_start(cfg, via="torchrun" if in_torchrun() else "cli", resume=resume_dir is not None,
                run_dir=resume_dir)
    if cfg.sync.strategy == "tokenring":  # its own launcher: no process group
        return _run_tokenring(cfg, resume_dir)
    _preflight(cfg)
    if in_torchrun():  # torchrun / SLURM started us: be one rank of that job
        from trainwright.run.worker import run_worker
        run_dir = create_run_dir(cfg, resume_dir) if resume_dir else None
        code, run_dir = run_worker(cfg, run_dir, resume=resume_dir is not None)
        if code == 0 and os.environ["RANK"] == "0":
            _finish_message(cfg, run_dir)
        return code

    run_dir = create_run_dir(cfg, resume_dir)
    setup_logging("[launcher]", logging.INFO)
    dp = cfg.parallel.dp
    print(f"trainwright: {cfg.world_size} ranks ({cfg.parallel.pp} stages x {dp} "
          f"{'replica' if dp == 1 else 'replicas'}), {cfg.train.schedule}, "
          f"{cfg.train.steps} steps -> {run_dir}", file=sys.stderr)
    result = launch_local(cfg, run_dir, resume=resume_dir is not None)
    if not result.ok:
        others = [r for r in range(len(result.returncodes)) if r != result.first_failure]
        print(f"error: {result.describe(result.first_failure)}; "
              + ", ".join(result.describe(r) for r in others)
              + f". Partial outputs are in {run_dir}. {resume_hint(run_dir)}", file=sys.stderr)
        return 1
    _finish_message(cfg, run_dir)
    return 0


def _load(path, overrides: list[str]):
    """The run's configuration (under torchrun a token ring has a node per process)."""
    from trainwright.config import load_config
    from trainwright.run.launch import in_torchrun

    if in_torchrun():
        from trainwright.run.ring_torchrun import load_torchrun_config
        return load_torchrun_config(path, overrides)
    return load_config(path, overrides)


def _preflight(cfg) -> None:
    """Checks that need the model built: layer count of a factory model, memory limits."""
    from trainwright.model.build import check_data

    check_data(cfg)
    if not cfg.model.factory and not any(v is not None for v in cfg.stage_limits()):
        return
    from trainwright.model.build import build_layers
    from trainwright.pipeline.budget import check_limits
    from trainwright.pipeline.tied import check_ties

    named = build_layers(cfg)
    cfg.check_layers(len(named))
    check_limits(cfg, named)
    check_ties(cfg, named)


def _finish_message(cfg, run_dir: Path | None) -> None:
    if run_dir is None:
        return
    if cfg.run.report:
        print(f"report: {run_dir / 'report.html'}")
    print(f"run directory: {run_dir}")


def _cmd_report(args: argparse.Namespace) -> int:
    from trainwright.observe.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {args.run_dir!r} does not exist")
    print(write_report(run_dir))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from trainwright.run.export import export_run

    for path in export_run(Path(args.run_dir), Path(args.to), args.step):
        print(f"wrote {path}")
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from trainwright.schedule.actions import build_schedule, format_grid

    v = args.virtual_stages
    if v is None:
        v = 2 if args.schedule in VIRTUAL_SCHEDULES else 1
    sched = build_schedule(args.schedule, args.pp, args.micro_batches, v)
    print(format_grid(sched))
    if args.actions:
        for acts in sched:
            print(" ".join(map(str, acts)))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from trainwright.bench import BENCHMARKS, run_benchmark

    if args.name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {args.name!r}; choose one of {sorted(BENCHMARKS)}")
    result = run_benchmark(args.name, args)
    if args.json:
        atomic_write_text(Path(args.json), json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if not args.json else f"wrote {args.json}")
    for row in result.get("rows", []):
        figures = {k: v for k, v in row.items() if k in ("step_ms_median", "samples_per_s",
                                                           "step_s", "peak_bytes_per_stage",
                                                           "sync_s")}
        print(f"{row['system']:<24} {figures}", file=sys.stderr)
    for key, value in result.items():  # the headline figures: every top-level scalar
        if isinstance(value, (int, float, bool, str)) and key != "benchmark":
            print(f"{key} = {value}", file=sys.stderr)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from trainwright.cli.plan_commands import cmd_plan, format_plan

    print(format_plan(cmd_plan(args)))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from trainwright.cli.plan_commands import cmd_simulate

    print(json.dumps(cmd_simulate(args)))
    if args.png:
        print(f"wrote {args.png}")
    return 0


def _run_tokenring(cfg, resume_dir: Path | None) -> int:
    """``trainwright run`` for ``sync.strategy = "tokenring"``: its own node launcher, or one
    node per process under torchrun."""
    from trainwright.run.launch import create_run_dir, in_torchrun
    from trainwright.run.ring_launch import launch_ring

    if in_torchrun():
        from trainwright.run.ring_torchrun import run_torchrun_node
        code, saved_in = run_torchrun_node(cfg, resume_dir)
        if saved_in is not None:  # the node that saved the model names the outputs
            print(f"model: {saved_in / 'model.pt'}")
            print(f"run directory: {saved_in}")
        return code
    run_dir = create_run_dir(cfg, resume_dir)
    r = cfg.tokenring
    print(f"trainwright: token ring of {r.nodes} nodes, close_fraction {r.close_fraction}, "
          f"{cfg.train.steps} steps -> {run_dir}", file=sys.stderr)
    result = launch_ring(cfg, run_dir, resume=resume_dir is not None)
    if not result.ok:
        print(f"error: token ring run failed: {result.message()}. Outputs are in {run_dir}",
              file=sys.stderr)
        return 1
    for line in result.warnings():
        print(f"warning: {line}", file=sys.stderr)
    print(f"model: {run_dir / 'model.pt'}")
    print(f"run directory: {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``trainwright`` command."""
    p = argparse.ArgumentParser(prog="trainwright", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train (default: small GPT, 2 stages, 1F1B, local ranks)")
    run.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config key, e.g. --set parallel.pp=4 (repeatable)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    run.set_defaults(func=_cmd_run)

    rep = sub.add_parser("report", help="write RUN_DIR/report.html from a run's outputs")
    rep.add_argument("run_dir")
    rep.set_defaults(func=_cmd_report)

    exp = sub.add_parser("export", help="write a run's trained weights as safetensors (a "
                         "transformers model: a from_pretrained folder)")
    exp.add_argument("run_dir")
    exp.add_argument("--to", required=True, metavar="DIR", help="new or empty output folder")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    exp.set_defaults(func=_cmd_export)

    sch = sub.add_parser("schedule", help="print a pipeline schedule as a step x stage grid")
    sch.add_argument("--schedule", default="1f1b",
                     choices=[*SCHEDULES, *VIRTUAL_SCHEDULES])
    sch.add_argument("--pp", type=int, default=4)
    sch.add_argument("--micro-batches", type=int, default=8)
    sch.add_argument("--virtual-stages", type=int, default=None,
                     help="model chunks per rank (interleaved-1f1b; default 2 there, else 1)")
    sch.add_argument("--actions", action="store_true", help="also list every stage's actions")
    sch.set_defaults(func=_cmd_schedule)

    ben = sub.add_parser("bench", help="run a side-by-side benchmark, e.g. `bench pipeline`")
    ben.add_argument("name")
    ben.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    ben.add_argument("--repeats", type=int, default=None,
                     help="paired rounds per system (default: the benchmark's own, e.g. "
                          "pipeline 6, rebalance 3)")
    ben.add_argument("--steps", type=int, default=None, help="steps per run (default: spec)")
    ben.add_argument("--stages", type=int, default=None,
                     help="pipeline stages, where the benchmark has them (default: spec)")
    ben.add_argument("--spec", action="append", metavar="KEY=VALUE",
                     help="pipeline, sparse: change a scalar of the workload "
                          "(e.g. d_model=128; rows=125000)")
    ben.add_argument("--loopback", action="store_true",
                     help="hierarchical: run on 127.0.0.1 instead of the emulated network")
    ben.add_argument("--link", metavar="RATE",
                     help="sparse: run each rank in its own network namespace with RATE egress "
                          "(tc syntax, e.g. 1gbit; needs root) instead of on 127.0.0.1")
    ben.set_defaults(func=_cmd_bench)

    from trainwright.cli.plan_commands import add_parsers as add_plan_parsers
    add_plan_parsers(sub, _cmd_plan, _cmd_simulate)  # `plan` and `simulate`: the peer-swap planner
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``trainwright`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
