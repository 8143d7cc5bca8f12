"""What a split backward costs on this machine: one segment's B + W against its one-pass backward.

Zero-bubble schedules pay off only if the weight gradients (W) they move into bubbles cost
little more, split off, than they do inside one backward. This script times, on the
pipeline bench's layers (one process, one thread, same micro-batch, rounds in alternating
order):

* ``fused``: ``torch.autograd.backward`` over the segment (what 1F1B runs);
* ``autograd``: :func:`trainwright.pipeline.split_backward.backward_input` then
  :func:`~trainwright.pipeline.split_backward.backward_weight` through autograd alone (what
  our stages run under autocast);
* ``deferred``: the same with the forward under
  :func:`~trainwright.pipeline.deferred_linear.defer_linears` (what our stages run
  otherwise: linear layers' W from the ``(x, dy)`` B stashed);
* ``torch``: torch pipelining's ``stage_backward_input`` then ``stage_backward_weight``
  (what its zero-bubble schedules run).

Usage: ``python tools/split_backward_cost.py [--d-model 256] [--context 128] [--rounds 8]``.
It prints one line per segment (the last stage's 4 blocks + head + loss, and the first
stage's 4 blocks) with the medians in ms of the backward and of forward + backward (the
deferral's forward costs a little more), and ``split / fused`` for both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from trainwright.bench.paired import round_order
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.pipeline.deferred_linear import WeightStash, defer_linears
from trainwright.pipeline.split_backward import backward_input, backward_weight

SYSTEMS = ("fused", "autograd", "deferred", "torch")


def _segment(spec: PipelineBenchSpec, last: bool):
    """The segment, its input (detached, needing a gradient), and ``forward()``."""
    layers = spec.layers()
    seg = nn.Sequential(*(layers[5:] if last else layers[1:5]))
    ids, targets = spec.data().batch(1, spec.micro_batch_size)
    with torch.no_grad():
        x0 = nn.Sequential(*layers[:5 if last else 1])(ids)
    grad = None if last else torch.randn_like(seg(x0))

    def forward(stash=None):
        x = x0.clone().requires_grad_(True)
        if stash is None:
            out = seg(x)
        else:
            with defer_linears(seg, stash):
                out = seg(x)
        if last:
            out = F.cross_entropy(out.flatten(0, 1), targets.flatten())
        return x, out

    return seg, grad, forward


def _time(system: str, seg: nn.Module, grad, forward) -> tuple[float, float]:
    """Seconds of the forward and of the backward."""
    params = list(seg.parameters())
    stash = WeightStash() if system == "deferred" else None
    t0 = time.perf_counter()
    x, out = forward(stash)
    t_fwd = time.perf_counter() - t0
    grads = None if grad is None else (grad,)
    t0 = time.perf_counter()
    if system == "fused":
        torch.autograd.backward([out], None if grad is None else [grad])
    elif system in ("autograd", "deferred"):
        _, work = backward_input((out,), grads, (x,), params, stash)
        del out
        backward_weight(work)
    else:
        _, groups = stage_backward_input([out], None if grad is None else [grad], [x],
                                         iter(params))
        del out
        stage_backward_weight(iter(params), groups)
    dt = time.perf_counter() - t0
    seg.zero_grad(set_to_none=True)
    return t_fwd, dt


def main() -> None:
    """Time the three backward variants on both segments and print the medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = PipelineBenchSpec(d_model=args.d_model, context=args.context)
    print(f"d_model={args.d_model} context={args.context} micro-batch={spec.micro_batch_size} "
          f"rounds={args.rounds} torch={torch.__version__}")
    for last in (True, False):
        seg, grad, forward = _segment(spec, last)
        times: dict[str, list] = {s: [] for s in SYSTEMS}
        for r in range(args.rounds + 1):
            for system in round_order(list(times), r):
                got = _time(system, seg, grad, forward)
                if r:  # round 0 warms up
                    times[system].append(got)
        bwd = {s: 1e3 * statistics.median(b for _, b in v) for s, v in times.items()}
        both = {s: 1e3 * statistics.median(f + b for f, b in v) for s, v in times.items()}
        name = "last stage (4 blocks + head + loss)" if last else "first stage's 4 blocks"
        print(f"{name}: backward fused {bwd['fused']:.1f} ms; B+W " + ", ".join(
            f"{s} {bwd[s]:.1f} ms ({bwd[s] / bwd['fused']:.3f}x)" for s in SYSTEMS[1:]))
        print(f"{' ' * len(name)}  forward + backward fused {both['fused']:.1f} ms; " + ", ".join(
            f"{s} {both[s]:.1f} ms ({both[s] / both['fused']:.3f}x)" for s in SYSTEMS[1:]))


if __name__ == "__main__":
    main()
