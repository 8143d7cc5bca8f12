"""One micro-batch through the whole model, measured: per-layer costs and footprint terms.

:func:`profile_model` runs the model as one pipeline stage in this process: timed passes
for the cost table, then untimed passes under a
:class:`~trainwright.pipeline.workset.WorkingSetProbe` for the footprint model's terms
(forward working sets, what swap and a split backward leave on the device, and on a GPU
each layer's backward by the CUDA allocator). :mod:`~trainwright.pipeline.budget` plans
from its :class:`ProfileTable`.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext

import torch

from trainwright.config import Config
from trainwright.model.build import build_data, loss_fn
from trainwright.observe.layer_profile import LayerCost, LayerProfiler
from trainwright.pipeline.stage import LayerSlot, Stage, StageOptions
from trainwright.pipeline.store import ActivationStore
from trainwright.pipeline.workset import WorkingSetProbe
from trainwright.plan.footprint import LayerTerms

__all__ = ["ProfileTable", "profile_model"]

log = logging.getLogger(__name__)


class ProfileTable(list):
    """:func:`profile_model`'s cost table (a list of :class:`LayerCost`) with the footprint
    terms measured in the same pass: :attr:`terms`, layer -> :class:`LayerTerms`."""

    def __init__(self, costs: list[LayerCost], terms: dict[int, LayerTerms]):
        super().__init__(costs)
        self.terms = terms


def profile_model(cfg: Config, named: list, device: torch.device | None = None,
                  options: StageOptions | None = None) -> ProfileTable:
    """Per-layer costs of one micro-batch through the whole model, in this process.

    Used before training starts: to reject an impossible ``memory.limit`` before any
    process is launched, and to plan every stage before its first step. A third, untimed
    pass runs under a :class:`~trainwright.pipeline.workset.WorkingSetProbe`, which
    measures each layer's forward working set and what it keeps (the footprint terms);
    on a GPU its backward also measures each layer's backward by the CUDA allocator
    (``back_work``: what the allocator holds that tensors' storages do not show).

    Args:
        cfg: the configuration (batch shape, loss, data).
        named: ``(name, layer)`` pairs from :func:`~trainwright.model.build.build_layers`;
            gradients they accumulate here are cleared.
        device: where to profile (the stage's own device, so that a GPU's kernels, saved
            tensors and times are what is planned); None: where the layers are.
        options: the stage's options (mixed precision, timer); None: fp32, wall clock.
    """
    x, y = build_data(cfg).batch(1, cfg.train.batch_size)
    n = cfg.train.batch_size // cfg.parallel.dp // cfg.train.micro_batches
    if device is not None:
        named = [(name, m.to(device)) for name, m in named]
        x, y = x.to(device), y.to(device)
    slots = [LayerSlot(i, name, m) for i, (name, m) in enumerate(named)]
    profiler = LayerProfiler(smoothing=0.5)
    options = StageOptions(autocast=options.autocast, timer=options.timer) if options else None
    stage = Stage(slots, ActivationStore(device=device), profiler, is_first=True,
                  loss_fn=loss_fn(cfg), options=options)
    probe = WorkingSetProbe({t.untyped_storage().data_ptr() for _, m in named
                             for t in [*m.parameters(), *m.buffers()]})
    for _ in range(2):  # the first pass warms up allocators and kernels
        stage.forward(0, (x[:n],), y[:n])
        stage.backward(0)
        profiler.end_step()
    # a third pass under the probe (each layer's forward again without a graph too), on a
    # scratch copy of the profiler so that its times never reach the cost table
    stage.profiler = copy.deepcopy(profiler)
    run = stage._run
    inputs: dict[int, tuple] = {}

    def measured(slot, inp, *a, **k):
        inputs[slot.index] = tuple(t.detach() if isinstance(t, torch.Tensor) else t
                                   for t in inp)
        return probe.measure(slot.index, lambda: run(slot, inp, *a, **k))

    stage._run = measured
    try:
        with probe:
            stage.forward(0, (x[:n],), y[:n])
    finally:
        del stage._run
    if device is not None and device.type == "cuda":
        back_work = _backward_by_allocator(stage, device)
    else:
        back_work = {}
        stage.backward(0)
    _measure_split(stage, inputs, probe, y[:n])
    inputs.clear()
    _measure_swapped(stage, probe, x[:n], y[:n])
    for _, m in named:
        m.zero_grad(set_to_none=True)
    costs = profiler.table()
    last, target_bytes = costs[-1].layer, y[:n].numel() * y.element_size()
    for c in costs:  # W's share of the split pass, applied to the smoothed backward time
        b_s, w_s = probe.split_s.get(c.layer, (0.0, 0.0))
        c.weight_s = c.backward_s * w_s / (b_s + w_s) if b_s + w_s > 0 else 0.0
    terms = {c.layer: LayerTerms(c.layer, *probe.layers.get(c.layer, (0, 0)), c.saved_bytes,
                                 c.output_bytes, c.input_bytes, c.param_bytes,
                                 work_nograd=probe.nograd.get(c.layer, -1),
                                 back_work=back_work.get(c.layer, -1),
                                 work_swap=probe.swapped.get(c.layer, (-1, -1))[0],
                                 kept_swap=probe.swapped.get(c.layer, (-1, -1))[1],
                                 w_held=probe.split.get(c.layer, (-1, False))[0],
                                 w_keeps_input=probe.split.get(c.layer, (-1, False))[1],
                                 target_bytes=target_bytes if c.layer == last else 0)
             for c in costs}
    return ProfileTable(costs, terms)


def _measure_swapped(stage: Stage, probe: WorkingSetProbe, x: torch.Tensor,
                     target: torch.Tensor) -> None:
    """One more forward with every layer swapped to the host (its copies uncounted), each
    layer's device working set and what stays on the device after it, then its backward."""
    stage.store.set_policies({s.index: "swap" for s in stage.slots})
    run = stage._run
    stage._run = lambda slot, *a, **k: probe.measure_swapped(slot.index,
                                                             lambda: run(slot, *a, **k))
    try:
        with probe:
            stage.forward(0, (x,), target)
    finally:
        del stage._run
        stage.store.set_policies({})
    stage.backward(0)
    stage.profiler.end_step()


def _measure_split(stage: Stage, inputs: dict[int, tuple], probe: WorkingSetProbe,
                   target: torch.Tensor) -> None:
    """What a split backward's ``B`` leaves for ``W``, per layer whose input takes a gradient
    (:meth:`~trainwright.pipeline.workset.WorkingSetProbe.measure_split`), as a stage past
    the first runs it under this stage's autocast."""
    last = stage.slots[-1].index

    def loss(out: torch.Tensor) -> torch.Tensor:
        return stage.loss_fn(out.float() if stage.autocast is not None else out, target)

    for slot in stage.slots:
        inp = inputs.get(slot.index, ())
        if not inp or not isinstance(inp[0], torch.Tensor) or not inp[0].is_floating_point():
            continue  # token ids: the model's first stage, whose B defers all to W
        try:
            with stage.autocast() if stage.autocast is not None else nullcontext():
                probe.measure_split(slot.index, slot.module, inp,
                                    loss if slot.index == last else None,
                                    defer=stage.autocast is None)
        except (RuntimeError, TypeError, ValueError) as exc:  # a layer autograd cannot split
            log.warning("layer %d (%s): could not measure what a split backward keeps for W "
                        "(%s); planning keeps its whole activations until W", slot.index,
                        slot.name, exc)


def _backward_by_allocator(stage: Stage, device: torch.device) -> dict[int, int]:
    """Run micro-batch 0's backward on ``stage`` (CUDA), each layer's under the allocator:
    layer -> highest bytes allocated during its backward above those at its start
    (:attr:`~trainwright.plan.footprint.LayerTerms.back_work`). The parameters' gradients
    exist from the earlier passes, so they are not counted (the allocator's bookkeeping is
    the host's: nothing waits for the device)."""
    out: dict[int, int] = {}
    one = stage._backward_segment

    def measured(seg, *args, **kwargs):
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        got = one(seg, *args, **kwargs)
        out[seg.layer] = torch.cuda.max_memory_allocated(device) - base
        return got

    stage._backward_segment = measured
    try:
        stage.backward(0)
    finally:
        del stage._backward_segment
    return out
