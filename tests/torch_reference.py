"""A plain-torch reference of a training run, and the check of a run against it.

Written with torch alone (``torch.autocast``, ``clip_grad_norm_``, ``lr_scheduler`` built
explicitly, a forward under ``no_grad`` for the held-out loss) on ``nn.Sequential`` of the
same layers and the same global batches, independently of ``run/lr.py`` and the trainer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from trainwright.model.build import build_data, build_layers, build_optimizer, loss_fn
from trainwright.run.api import load_model


def torch_scheduler(t, opt):
    """The schedule written out with torch's classes, independently of run/lr.py."""
    w, last = t.warmup_steps, max(t.steps - t.warmup_steps - 1, 1)
    main = {"cosine": lambda: sched.CosineAnnealingLR(opt, T_max=last, eta_min=t.min_lr),
            "linear": lambda: sched.LinearLR(opt, 1.0, t.min_lr / t.lr, total_iters=last),
            "constant": lambda: sched.LambdaLR(opt, lambda s: 1.0)}[t.lr_schedule]()
    if w < 2:
        return main
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 1.0 / w, 1.0, total_iters=w - 1), main],
                              milestones=[w])


def autocast(cfg):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


def _eval_loss(model, data, cfg, criterion) -> float:
    model.eval()
    with torch.no_grad(), autocast(cfg):
        losses = [criterion(model(x).float(), y).item() for x, y in
                  (data.eval_batch(i, cfg.train.batch_size) for i in range(cfg.eval.batches))]
    model.train()
    return sum(losses) / len(losses)


def _apply_edits(cfg, model: nn.Sequential, opt, step: int) -> None:
    """``rebalance.edits`` on the one-process model: each inserted layer built under
    ``torch.manual_seed(train.seed + step)`` as the trainer documents, its parameters a new
    group of the optimizer."""
    from trainwright.rebalance.edits import InsertLayer, load_edit_hook

    for edit in load_edit_hook(cfg.rebalance.edits)(step) if cfg.rebalance.edits else []:
        assert isinstance(edit, InsertLayer), edit
        torch.manual_seed(cfg.train.seed + step)
        module = edit.build()
        model.insert(edit.at, module)
        opt.add_param_group({"params": list(module.parameters())})


def reference(cfg) -> dict:
    """Plain-torch training of the configured model (with its ``rebalance.edits``): losses,
    lrs, grad norms, eval losses."""
    model = nn.Sequential(*(layer for _, layer in build_layers(cfg)))
    opt = build_optimizer(cfg, list(model.parameters()))
    # the schedule drives a one-parameter clock whose lr every group takes (an edit adds groups)
    clock = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.train.lr)
    lrs = torch_scheduler(cfg.train, clock)
    data, criterion, t = build_data(cfg), loss_fn(cfg), cfg.train
    scaler = torch.amp.GradScaler("cpu", enabled=t.precision == "fp16")
    out = {"model": model, "loss": [], "lr": [], "grad_norm": [], "eval": {}}
    for step in range(1, t.steps + 1):
        _apply_edits(cfg, model, opt, step)
        x, y = data.batch(step, t.batch_size)
        with autocast(cfg):
            logits = model(x)
        loss = criterion(logits.float() if t.precision != "fp32" else logits, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if t.clip_norm:
            out["grad_norm"].append(
                float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)))
        for group in opt.param_groups:
            group["lr"] = clock.param_groups[0]["lr"]
        out["lr"].append(opt.param_groups[0]["lr"])
        scaler.step(opt)
        scaler.update()
        clock.step()  # no gradient: only keeps the scheduler's order of calls
        lrs.step()
        out["loss"].append(loss.item())
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == t.steps):
            out["eval"][step] = _eval_loss(model, data, cfg, criterion)
    return out


def metric_rows(run_dir: Path, kind: str) -> list[dict]:
    """The rows of one ``kind`` in a run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def check_against_torch(cfg, run_dir: Path, loss_rtol: float | None = None,
                        param_tol: float | None = None) -> None:
    """Losses, lrs, grad norms, eval losses and final parameters of the run in ``run_dir``
    equal :func:`reference` (to ``loss_rtol`` / ``param_tol`` when given)."""
    ref = reference(cfg)
    steps = metric_rows(run_dir, "step")
    got_loss = torch.tensor([r["loss"] for r in steps])
    if loss_rtol is None:
        torch.testing.assert_close(got_loss, torch.tensor(ref["loss"]))
    else:
        torch.testing.assert_close(got_loss, torch.tensor(ref["loss"]), rtol=loss_rtol, atol=0)
    torch.testing.assert_close(torch.tensor([r["lr"] for r in steps], dtype=torch.float64),
                               torch.tensor(ref["lr"], dtype=torch.float64))
    if cfg.train.clip_norm:
        got = torch.tensor([r["grad_norm"] for r in steps])
        torch.testing.assert_close(got, torch.tensor(ref["grad_norm"]),
                                   rtol=loss_rtol or 1.3e-6, atol=1e-6)
        assert any(n > cfg.train.clip_norm for n in ref["grad_norm"]), "clipping never acted"
    if cfg.eval.every:
        evals = {r["step"]: r for r in metric_rows(run_dir, "eval")}
        assert sorted(evals) == sorted(ref["eval"])
        torch.testing.assert_close(torch.tensor([evals[s]["loss"] for s in sorted(evals)]),
                                   torch.tensor([ref["eval"][s] for s in sorted(evals)]),
                                   rtol=loss_rtol or 1.3e-6, atol=1e-5)
        for r in evals.values():
            if cfg.train.loss == "cross_entropy":
                assert r["perplexity"] == pytest.approx(math.exp(r["loss"]))
    tol = {} if param_tol is None else {"rtol": param_tol, "atol": param_tol}
    got = load_model(run_dir)
    for (name, a), (_, b) in zip(got.named_parameters(), ref["model"].named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}", **tol)
