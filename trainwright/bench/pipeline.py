"""``trainwright bench pipeline``: every schedule of ours against torch pipelining's, same work.

Every system trains :class:`~trainwright.bench.spec.PipelineBenchSpec` (8-block GPT, 2 ranks
split [embed + 4 blocks | 4 blocks + head], SGD) on the same batches from the same initial
weights, at 8 and at 4 micro-batches:

* ours: ``1f1b``, ``gpipe``, ``zb-h1``, ``zb-h2``, ``interleaved-1f1b`` and ``zb-v`` (two
  chunks per rank, cut as torch's: equal blocks per chunk) (the real Trainer);
* torch pipelining: ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV`` (the
  multi-chunk ones cut the model in four chunks of two blocks each, see
  :func:`~trainwright.bench.peers.chunk_split`);
* DeepSpeed, where it imports: ``deepspeed_pipeline``, its ``PipelineModule`` on the same
  layers and split with its ``PipelineEngine`` (``TrainSchedule``, a 1F1B), fp32, ZeRO off,
  client SGD (:func:`~trainwright.bench.deepspeed_peer.deepspeed_train`). It joins the bench's own
  gloo group (``deepspeed.init_distributed`` adopts an initialised ``torch.distributed``),
  so it runs in the same rounds and processes as every other system, timed like torch's
  rows. ``ratio_vs_deepspeed`` is our best schedule's samples/s over it, paired per round;
  ``best_torch`` and ``ratio_vs_best_torch`` stay torch pipelining's.

The bench runs in two phases, each in one pair of processes (one process group), round by
round, the systems in alternating order (ABBA, :mod:`trainwright.bench.paired`), so a
drifting machine hits them alike; a system that fails is reported with its error:

1. **screening**: every system, ``screen_rounds`` rounds. It gives the table, the bubbles,
   ``ratio_vs_deepspeed``, our best schedule and the ranking of torch's schedules;
2. **head-to-head**: our best against **every** torch schedule that ran (1F1B,
   Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), ``repeats`` rounds
   (rounded up to an even number), back to back, under the run clock (below). Runs back to
   back are seconds apart, so their ratio measures the systems, not the drift. Torch's
   best is the schedule our ratio is lowest against in these rounds (``best_torch``;
   screening's pick stays as ``screen_best_torch``): screening ranks by the step clock,
   which denies torch's zero-bubble overlap, so no torch schedule may lose its place
   there (at m = 8, ZBVZeroBubble once missed the final by 2 ms). The number of rounds is
   even so that every system runs first as often as last (``order_effect`` gives each
   half's median apart). A warm-up round (every finalist once) opens the phase and is
   discarded: fresh processes pay one-time costs in their first run.
   ``ratio_vs_best_torch`` (median of the per-round samples/s ratios, its 90 % interval
   and the verdict against >= 1.0 in ``ratio_vs_best_torch_judged``) comes from this
   phase; the screening's own paired ratio stays as ``screen_ratio_vs_best_torch``.

**The compute bound** (``step_vs_isolated_compute_bound``): our best schedule's run-clock
step over the slowest rank's compute measured **outside the pipeline**: the same layers of
each rank, the same micro-batches, one process, plain autograd
(:func:`~trainwright.bench.stage_overhead.isolated_compute_bound`). The trace-based ratio
``run_step_vs_compute_bound`` divides by our own busiest rank's F + B + W time, i.e. it is
1 less the bubble, and is kept for comparison only. ``zb_h1_bubble_vs_1f1b`` is ZB-H1's
own bubble over 1F1B's (each zero-bubble schedule's in ``zb_bubble_vs_1f1b_per_schedule``).
``stage_overhead``'s verdict (``measured_ratio_judged``, <= 1.005) is on the measured step,
per-layer segments: the fast step fuses kept layers into the plain graph.

**Two clocks, each the same for every system:**

* **step clock** (screening, and the per-step figures): torch's, a barrier before each
  step, then each rank's time from leaving it to the end of its step (our ``STEP``
  action, torch's ``optimizer.step``), the slowest rank per step. Data reading and loss
  logging lie outside it for torch; for ours the batch read and the trainer's per-step
  set-up lie inside, sending the step's metrics to rank 0 outside. A barrier per step
  stops a rank from starting its next step while another still finishes this one, which a
  training loop without one does: under torch's ZB-V, rank 0 starts forwarding the next step while
  rank 1 still runs its last weight passes. Our ZB-V carries those passes into the next
  step (``train.carry_weight_grads``), so this clock would credit us with an overlap it
  denies torch;
* **run clock** (the headline): one barrier after the warm-up steps, then the remaining
  steps back to back as a training loop runs them (torch: data, ``step``, loss logging,
  ``optimizer.step``; ours: ``Trainer.fit``, its per-step metrics included), each
  rank timed from leaving the barrier to the end of its last step; the slowest rank's
  time over the number of steps. The CLI runs 1 warm-up and 10 timed steps, so our timed
  window holds one profile step (step 10, at the default ``run.profile_every``; its first
  micro-batch runs unfused and measured), the share a long run pays.

Our former clock, rank 0's time between consecutive metrics rows (everything included, no
barrier), stays in each of our screening rows as ``period_ms_median``.

From our trace, per step after warm-up: the **common span** runs from the first action of
any rank to the last action of any rank; each rank's idle time is the span minus its
``F``/``B``/``W`` time (tail idle included); ``bubble_fraction`` = summed idle / (ranks x
span). The **compute bound** is the busiest rank's summed ``F``, ``B``, ``W`` and ``STEP``
time in that step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.bench import deepspeed_peer, peers
from trainwright.bench.paired import balanced_rounds, host_info, judged, round_order
from trainwright.bench.pipeline_figures import (
    DEEPSPEED,
    HEADLINE,
    head_to_head,
    summarise,
    trace_steps,
)
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.bench.spec_overrides import spec_overrides
from trainwright.bench.stage_overhead import isolated_compute_bound
from trainwright.config import Config, load_config
from trainwright.dist import collective as coll
from trainwright.observe.progress import RunProgress

__all__ = ["OUR_SCHEDULES", "spec_config", "systems", "run", "main"]

log = logging.getLogger(__name__)

OUR_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v:whole")


def spec_config(spec: PipelineBenchSpec, run_dir: Path, schedule: str = "1f1b") -> Config:
    """Our configuration for the benchmark workload (interleaved and ZB-V: two chunks per
    rank, cut as torch's multi-chunk schedules are: ``peers.chunk_split``). ``"zb-v:whole"``
    is ZB-V with ``train.carry_weight_grads`` off: every step runs its whole list."""
    schedule, _, variant = schedule.partition(":")
    split, chunks = spec.split, 2 if schedule in ("interleaved-1f1b", "zb-v") else 1
    if chunks > 1:
        split = peers.chunk_split(spec.split, chunks)
    return load_config(None, [
        "model.name=gpt", f"model.n_blocks={spec.n_blocks}", f"model.d_model={spec.d_model}",
        f"model.n_heads={spec.n_heads}", f"model.context={spec.context}",
        "data.name=stdlib", "data.max_bytes=1000000",
        f"train.steps={spec.steps}", f"train.batch_size={spec.batch_size}",
        f"train.micro_batches={spec.micro_batches}", f'train.schedule="{schedule}"',
        "train.optimizer=sgd", f"train.lr={spec.lr}", f"train.seed={spec.seed}",
        f"parallel.pp={len(spec.split)}", f"parallel.partition={split}",
        f"parallel.virtual_stages={chunks}",
        f"parallel.threads_per_rank={spec.threads_per_rank}",
        f"train.carry_weight_grads={'false' if variant == 'whole' else 'true'}",
        "run.report=false", "run.progress=false", "run.checkpoint_every=0",
        f"run.trace_steps={spec.steps}",  # run.profile_every stays the default: 10
        f'run.dir="{run_dir.parent}"', f'run.name="{run_dir.name}"',
    ])


def _ours(rank: int, spec: PipelineBenchSpec, schedule: str, run_dir: Path,
          clock: str = "step") -> dict:
    """Train with our ``schedule`` in the current process group, timed on every rank as
    torch's are (module docstring; ``clock`` as for
    :func:`~trainwright.bench.peers.torch_pipelining_train`); rank 0 also reads the run's
    metrics and trace."""
    from trainwright.run.trainer import Trainer

    cfg = spec_config(spec, run_dir, schedule)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    coll.barrier()
    trainer = Trainer(cfg, run_dir)
    started, ended = {}, {}

    def on_step(step: int, stats) -> None:
        if clock == "step" or step == spec.steps:
            ended[step] = max(t + d for s, _, _, t, d in trainer.trace_events if s == step)
        if clock == "step" or step == spec.warmup:
            coll.barrier()
            started[step + 1] = time.time_ns()

    coll.barrier()
    started[trainer.start] = time.time_ns()
    trainer.fit(on_step)
    trainer.close()  # the bench builds ~90 trainers in these two processes
    out: dict = {"clock": clock}
    if clock == "step":
        out["step_times_s"] = [(ended[k] - started[k]) / 1e9 for k in sorted(ended)]
    else:
        out["step_times_s"] = []
        out["run_s"] = (ended[spec.steps] - started[spec.warmup + 1]) / 1e9
        out["run_steps"] = spec.steps - spec.warmup
    if rank != 0:
        return out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    start = next(r for r in rows if r["kind"] == "run")["time_started"]
    ends = [start] + [r["time"] for r in steps]
    trace = trace_steps(run_dir / "trace.json", spec.warmup)
    return {**out, "losses": [r["loss"] for r in steps],
            "period_s": [b - a for a, b in zip(ends, ends[1:], strict=False)],
            "trace": {str(k): v for k, v in trace.items()}}


def bench_worker(rank: int, world_size: int, master_port: int, spec: PipelineBenchSpec,
                 out_path: str, plan: list) -> None:
    """One rank: every ``(round, micro_batches, system)`` of ``plan``, in order."""
    torch.set_num_threads(spec.threads_per_rank)
    peers.init_process_group(rank, world_size, master_port)
    runs = []
    progress = RunProgress("bench pipeline", len(plan)) if rank == 0 else None
    try:
        for i, (rnd, m, system, *clock) in enumerate(plan):
            sp, clock = dataclasses.replace(spec, micro_batches=m), (clock or ["step"])[0]
            t0 = time.perf_counter()
            try:
                if system.startswith("trainwright_"):
                    res = _ours(rank, sp, system.removeprefix("trainwright_"),
                                Path(out_path).parent / f"run{i}", clock)
                elif system == DEEPSPEED:
                    res = _deepspeed(rank, world_size, master_port, sp)
                else:
                    res, _ = peers.torch_pipelining_train(rank, world_size, sp,
                                                          _torch_schedules()[system], clock)
            except Exception as exc:  # a peer failing on CPU is reported, not dropped
                log.exception("%s failed", system)
                res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            res.update(round=rnd, micro_batches=m, system=system,
                       wall_s=time.perf_counter() - t0)
            runs.append(res)
            Path(out_path).write_text(json.dumps({"rank": rank, "runs": runs,
                                                  "step_times_s": []}))
            if progress is not None:
                progress.update(i + 1, _progress_text(res))
    finally:
        if progress is not None:
            progress.close()
        dist.destroy_process_group()


def _progress_text(res: dict) -> str:
    """One run's result for the progress bar (the whole bench takes up to an hour)."""
    times = res.get("step_times_s") or []
    what = res["error"][:80] if "error" in res else (
        f"median step {1e3 * statistics.median(times):.1f} ms" if times else
        f"{1e3 * res['run_s'] / res['run_steps']:.1f} ms per step back to back"
        if res.get("run_s") else "done")
    return (f"round {res['round'] + 1}, {res['micro_batches']} micro-batches, "
            f"{res['system']}: {what} ({res['wall_s']:.0f} s)")


def _deepspeed(rank: int, world_size: int, master_port: int, spec: PipelineBenchSpec) -> dict:
    """DeepSpeed's ``PipelineEngine`` (``TrainSchedule``: 1F1B) in the bench's process group,
    timed like torch's rows (barrier, then ``train_batch``, optimizer step included)."""
    deepspeed_peer.deepspeed_env(rank, world_size, master_port)  # DeepSpeed reads the launcher's
    got, _, _ = deepspeed_peer.deepspeed_train(rank, world_size, spec)
    return {"step_times_s": got["step_times"], "losses": got["losses"]}


def _torch_schedules() -> dict[str, str]:
    return {peers.torch_system_name(s): s for s in peers.TORCH_SCHEDULES}


def systems() -> list[str]:
    """Every system the benchmark runs."""
    return ([f"trainwright_{s}" for s in OUR_SCHEDULES] + list(_torch_schedules())
            + ([DEEPSPEED] if deepspeed_peer.deepspeed_available() else []))


def run(spec: PipelineBenchSpec, repeats: int = 6, micro_batches: tuple = (8, 4),
        overhead: bool = True, screen_rounds: int | None = None) -> dict:
    """Screen every system, then pit our best schedule against torch's best, and compare.

    Phase 1 (screening) runs every system ``screen_rounds`` (default ``min(3, repeats)``)
    rounds at each micro-batch
    count: the table, the bubbles, our best schedule and torch's two best. Phase 2
    (head-to-head) runs only those three, ``repeats`` rounds (an odd number is rounded up:
    each system then runs first as often as last), back to back in alternating order, so
    each paired ratio compares runs seconds apart rather than minutes apart on a
    machine whose speed drifts: ``ratio_vs_best_torch`` and ``step_vs_compute_bound`` come
    from it.

    Returns:
        The benchmark result: per micro-batch count (``by_micro_batches``) the rows and the
        headline keys, the same keys at top level keyed by micro-batch count, the one-stage
        overhead (``stage_overhead``) and the host.
    """
    t0 = time.perf_counter()
    screen_rounds = min(3, repeats) if screen_rounds is None else screen_rounds
    repeats = balanced_rounds(repeats)
    names = systems()
    plan = [(r, m, name) for r in range(screen_rounds) for m in micro_batches
            for name in round_order(names, r)]
    runs_of_rank = _spawn(spec, plan)
    by_m = {str(m): summarise(runs_of_rank, spec, m, names) for m in micro_batches}
    finals = {m: [by_m[str(m)]["best_ours"], *by_m[str(m)]["torch_ranked"]]
              for m in micro_batches if "best_ours" in by_m[str(m)]}
    if finals:
        # round -1 warms the fresh processes up and is discarded (module docstring)
        plan = [(r, m, name, "run") for r in range(-1, repeats) for m in finals
                for name in round_order(finals[m], r)]
        runs_of_rank = _spawn(spec, plan)
        for m in finals:
            h2h = head_to_head(runs_of_rank, spec, m, finals[m][0], finals[m][1:])
            if "ours_step_s" in h2h:
                bound = isolated_compute_bound(spec, m)
                h2h["isolated_compute_bound"] = bound
                h2h["step_vs_isolated_compute_bound"] = round(
                    h2h["ours_step_s"] / bound["bound_s"], 4)
            row = by_m[str(m)]
            row.update(head_to_head=h2h, screen_best_torch=row["best_torch"])
            row.update({k: h2h[k] for k in (*HEADLINE, "best_torch") if k in h2h})
    keys = (*HEADLINE, "zb_h1_bubble_vs_1f1b", "zb_bubble_vs_1f1b_per_schedule",
            "bubble_fraction", "idle_s_per_rank", "best_ours",
            "best_torch", "screen_best_torch", "screen_ratio_vs_best_torch", "ratio_vs_deepspeed",
            "ratio_vs_deepspeed_spread", "deepspeed_error")
    result = {
        "benchmark": "pipeline",
        "question": "samples/s of our best schedule vs torch pipelining's best schedule on "
                    "the same work (best chosen in screening rounds of every system, then "
                    "ours against torch's two best back to back in paired rounds, the headline "
                    "against whichever of the two does better); bubble over all ranks from the "
                    "step's common start to its common end",
        "spec": spec.to_dict(), "screen_rounds": screen_rounds, "repeats": repeats,
        "micro_batches": list(micro_batches),
        "wall_s": round(time.perf_counter() - t0, 1),
        **{k: {m: v[k] for m, v in by_m.items() if k in v} for k in keys},
        "by_micro_batches": by_m, "host": host_info(),
    }
    if overhead:
        from trainwright.bench.stage_overhead import measure
        result["stage_overhead"] = measure(dataclasses.replace(spec, micro_batches=4))
        so = result["stage_overhead"]  # judged on the measured step: per-layer segments
        so["measured_ratio_judged"] = judged(so["measured_paired_ratios"], 1.005)
    return result



def _spawn(spec: PipelineBenchSpec, plan: list) -> list[list[dict]]:
    """Run ``plan`` in one pair of rank processes; every rank's list of runs."""
    results = peers.spawn_peer(bench_worker, spec, world_size=len(spec.split),
                               timeout_s=24 * 3600, worker_kwargs={"plan": plan})
    return [r["runs"] for r in results]


def main(args: argparse.Namespace) -> dict:
    """CLI entry: ``trainwright bench pipeline [--repeats N] [--steps N] [--spec K=V ...]``."""
    # 1 warm-up + 10 timed steps: the timed window holds one profile step in ten, as a
    # long run at the default run.profile_every does
    spec = PipelineBenchSpec(steps=11)
    if args.steps:
        spec.steps = args.steps
    spec = dataclasses.replace(spec, **spec_overrides("pipeline", spec,
                                                      getattr(args, "spec", None)))
    return run(spec, repeats=args.repeats or 6)
