"""``trainwright run | report | export | checkpoint | schedule | bench | plan | simulate``:
the command line.

Configuration errors print one line and exit 2 before any process starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trainwright.errors import ConfigError, PlanError
from trainwright.observe.telemetry import atomic_write_text, setup_logging
from trainwright.schedule.actions import SCHEDULES, VIRTUAL_SCHEDULES

__all__ = ["main"]

EXIT_CONFIG = 2


def _cmd_run(args: argparse.Namespace) -> int:
    """``trainwright run``: the Python API's :func:`~trainwright.run.api.run_job`, printing
    the start line, what failed, and where the outputs are."""
    from trainwright.run.api import load_run_config, run_job

    resume_dir = None
    if args.resume:
        resume_dir = Path(args.resume)
        if not (resume_dir / "config.toml").exists():
            raise ConfigError(f"--resume {args.resume}: no config.toml there; pass the run "
                              f"directory a previous `trainwright run` printed")
        if args.config:
            raise ConfigError("give either CONFIG or --resume RUN_DIR (the run keeps its config; "
                              "change keys with --set)")
    if args.plan:
        if args.config or resume_dir:
            raise ConfigError("give --plan PLAN alone (it holds the whole configuration; "
                              "change keys with --set)")
        from trainwright.run.plan_file import load_plan_config
        cfg = load_plan_config(args.plan, args.set, args.candidate)
    else:
        cfg = load_run_config(args.config, args.set, resume_dir)
    outcome = run_job(cfg, resume_dir, via="cli", on_start=_start_line)
    if outcome.error:
        print(f"error: {outcome.error}", file=sys.stderr)
        return outcome.code
    for line in outcome.warnings:  # nodes the ring dropped from a run that succeeded
        print(f"warning: {line}", file=sys.stderr)
    if outcome.names_outputs:
        if outcome.model is not None:
            print(f"model: {outcome.model}")
        if outcome.report is not None:
            print(f"report: {outcome.report}")
        print(f"run directory: {outcome.run_dir}")
    return outcome.code


def _start_line(cfg, run_dir: Path) -> None:
    """What a local launch says before its processes start (the launcher logs from here on)."""
    if cfg.sync.strategy == "tokenring":
        r = cfg.tokenring
        print(f"trainwright: token ring of {r.nodes} nodes, close_fraction {r.close_fraction}, "
              f"{cfg.train.steps} steps -> {run_dir}", file=sys.stderr)
        return
    setup_logging("[launcher]", logging.INFO)
    dp = cfg.parallel.dp
    print(f"trainwright: {cfg.world_size} ranks ({cfg.parallel.pp} stages x {dp} "
          f"{'replica' if dp == 1 else 'replicas'}), {cfg.train.schedule}, "
          f"{cfg.train.steps} steps -> {run_dir}", file=sys.stderr)


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


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from trainwright.run.manifest import verify_run

    lines, code = verify_run(Path(args.run_dir))
    print("\n".join(lines))
    return code


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
    setup_logging("[bench]", logging.INFO)  # benches log their phases (a log file gets them)
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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``trainwright`` command."""
    p = argparse.ArgumentParser(prog="trainwright", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train (default: small GPT, 2 stages, 1F1B, local ranks)")
    run.add_argument("config", nargs="?", help="TOML config file (default: built-in defaults)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config key, e.g. --set parallel.pp=4 (repeatable)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    run.add_argument("--plan", metavar="PLAN", help="train with exactly what `trainwright plan "
                     "--model SPEC --json PLAN.json` chose (the JSON or its .toml)")
    run.add_argument("--candidate", type=int, default=1, help="with --plan JSON: run its K-th "
                     "best candidate (plan --top K writes them)")
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

    ck = sub.add_parser("checkpoint", help="check a run's checkpoints against their manifests")
    ck_sub = ck.add_subparsers(dest="action", required=True)
    ver = ck_sub.add_parser("verify", help="every checkpoint of RUN_DIR: intact or what is "
                            "wrong (exit 1 when one is damaged)")
    ver.add_argument("run_dir")
    ver.set_defaults(func=_cmd_checkpoint)

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
                     help="sparse: after the loopback run, run again with each rank in its own "
                          "network namespace with RATE egress (tc syntax; default 1gbit; needs "
                          "root; 'none' skips it)")
    ben.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="memory: run on the CPU (default) or one CUDA GPU, sized for an H100")
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
