"""Layer times read at the step's end, and the allocator's step figures (CPU-checkable parts
of the GPU timing and memory paths)."""

import torch

from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.runtime import allocator_figures


class _Reading:
    """A timer reading resolved only by ``float()`` (as a CUDA event pair is)."""

    reads = 0

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __float__(self) -> float:
        _Reading.reads += 1
        return self.seconds


def test_profiler_reads_each_time_only_at_the_end_of_the_step():
    _Reading.reads = 0
    profiler = LayerProfiler(smoothing=1.0, warmup_steps=0)
    profiler.register(0, "l0", param_bytes=0)
    for mb in range(2):  # two micro-batches: forward 2 s and 4 s, backward in two parts
        profiler.forward(0, _Reading(2.0 + 2 * mb), None, 1, 1)
        profiler.backward(0, _Reading(1.0), _Reading(0.5 + mb))
    assert _Reading.reads == 0  # nothing waits for the device during the step
    profiler.end_step()
    assert _Reading.reads == 6
    cost = profiler.table()[0]
    assert (cost.forward_s, cost.backward_s) == (3.0, 2.0)  # means over the micro-batches
    profiler.forward(0, 1.5, None, 1, 1)  # plain floats (the wall clock) still work
    profiler.end_step()
    assert profiler.table()[0].forward_s == 1.5


def test_allocator_figures_take_the_first_optimizer_state_off_the_activations():
    params = [torch.zeros(10)]  # 40 bytes of parameters: 40 bytes of gradients
    params[0].requires_grad_(True)
    # before the optimizer step the peak was 1,000; it then created 300 bytes of state and
    # the rest of the step peaked at 1,200 (900 without that state)
    got = allocator_figures(1200, params, start_bytes=100, updates=[(1000, 300)])
    assert got == {"cuda_max_allocated_bytes": 1200,
                   "cuda_activation_peak_bytes": 1000 - 100 - 40}
    # a later step: no new state, the peak after the optimizer step counts whole
    got = allocator_figures(1200, params, start_bytes=400, updates=[(1000, 0)])
    assert got["cuda_activation_peak_bytes"] == 1200 - 400 - 40
    assert allocator_figures(700, params, 100, [])["cuda_activation_peak_bytes"] == 560
