"""Timing a piece of work where it runs: the host's clock on a CPU, CUDA events on a GPU.

On a GPU, ``time.perf_counter`` around a layer's forward sees how long the host took to
*launch* its kernels, not how long they ran. :class:`CudaEventTimer` records an event
before and after and returns the device time between them; it waits for the end event,
so a timed layer is finished when :meth:`~CudaEventTimer.stop` returns. The pipeline times
every layer it runs on its own (the measured micro-batch of a profile step, layers that
recompute or swap, and every layer of a step that is not fused: the first, and every step
under a memory limit or with rebalancing on), so on a GPU those steps wait for each such
layer before launching the next: a cost the GPU check's timings include.

Both timers have the same two calls, ``mark = timer.start()`` and
``seconds = timer.stop(mark)``; :func:`device_timer` picks one for a device. Tests pass
their own object with these calls (an injected clock).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch


class Timer(Protocol):
    """``start() -> mark``; ``stop(mark) -> seconds`` of work done in between."""

    def start(self) -> object: ...

    def stop(self, mark: object) -> float: ...


class WallTimer:
    """The host's monotonic clock (``time.perf_counter``, or an injected ``clock``)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock

    def start(self) -> float:
        return self.clock()

    def stop(self, mark: float) -> float:
        return self.clock() - mark


class CudaEventTimer:
    """Device time between two CUDA events on the current stream of ``device``."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def stop(self, mark: torch.cuda.Event) -> float:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        end.synchronize()
        return mark.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def device_timer(device: torch.device | None) -> WallTimer | CudaEventTimer:
    """The timer for work on ``device``: CUDA events on a CUDA device, else the wall clock."""
    if device is not None and device.type == "cuda":
        return CudaEventTimer(device)
    return WallTimer()
