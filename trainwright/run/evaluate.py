"""Forward-only evaluation through the pipeline on held-out data (``eval.every``).

Each stage runs its layers under ``torch.no_grad`` (:meth:`Stage.infer`: no graph, no
activation kept, no backward) micro-batch by micro-batch, receiving from the previous
stage and sending to the next one through the same headers-and-deadlines channel as
training. The last stage sums ``loss / micro_batches`` over a batch's micro-batches (the
batch mean, as in training) and averages over ``eval.batches`` batches; replicas each take
their share of every held-out batch, and rank 0 averages them. The data object provides
the held-out batches as ``eval_batch(index, batch_size) -> (inputs, targets)``.
"""

from __future__ import annotations

import math
import time

import torch

from trainwright.model.build import split_microbatches
from trainwright.model.data import shard as take_shard
from trainwright.model.text_data import check_eval_data

__all__ = ["check_eval_data", "evaluate", "maybe_evaluate"]


def _stage_losses(trainer, batches: int) -> list[float]:
    """Run ``batches`` held-out batches through this rank's stage; the last stage returns the
    loss of each batch, the others an empty list."""
    stage, rt, cfg = trainer.stage, trainer.runtime, trainer.cfg
    m, bs = cfg.train.micro_batches, cfg.train.batch_size
    first, last = trainer.topo.stage == 0, stage.is_last
    out: list[float] = []
    for i in range(batches):
        x = y = None
        if first or last:
            x, y = take_shard(trainer.data.eval_batch(i, bs), *trainer.shard)
            x, y = x.to(trainer.device), y.to(trainer.device)
        xs = split_microbatches(x, m) if first else None
        ys = split_microbatches(y, m) if last else None
        total = torch.zeros((), dtype=torch.float64)
        for mb in range(m):
            inp = (xs[mb],) if first else tuple(rt.p2p.recv(rt.prev_rank, "act", mb))
            res = stage.infer(inp, ys[mb] if last else None)
            if last:
                total += res[0].double().cpu()
            else:
                rt.p2p.send(rt.next_rank, "act", mb, list(res))
        if last:
            out.append(float(total))
    rt.p2p.wait_sends()
    return out


def evaluate(trainer, step: int) -> dict | None:
    """Evaluate ``eval.batches`` held-out batches; every rank calls it after the same step.

    Returns:
        On rank 0: ``{"step", "loss", "perplexity" (cross-entropy only), "batches",
        "seconds"}``; None on other ranks.
    """
    t0 = time.perf_counter()
    batches = trainer.cfg.eval.batches
    was_training = [s.module.training for s in trainer.stage.slots]
    for s in trainer.stage.slots:
        s.module.eval()
    try:
        losses = _stage_losses(trainer, batches)
    finally:
        for s, mode in zip(trainer.stage.slots, was_training, strict=True):
            s.module.train(mode)
    gathered = trainer.records.gather(losses)
    if gathered is None:
        return None
    per_replica = [sum(v) / len(v) for v in gathered if v]
    loss = sum(per_replica) / len(per_replica)
    row = {"step": step, "loss": loss, "batches": batches,
           "seconds": time.perf_counter() - t0}
    if trainer.cfg.train.loss == "cross_entropy":
        row["perplexity"] = math.exp(min(loss, 700.0))
    return row


def maybe_evaluate(trainer, step: int) -> dict | None:
    """Evaluate after ``step`` when ``eval.every`` says so (and after the last step); rank 0
    writes an ``eval`` row to the metrics and shows it on the progress bar."""
    every, last = trainer.cfg.eval.every, trainer.cfg.train.steps
    if not every or (step % every and step != last):
        return None
    row = evaluate(trainer, step)
    if row is not None and trainer.records.recorder is not None:
        trainer.records.recorder.eval(row)
    return row
