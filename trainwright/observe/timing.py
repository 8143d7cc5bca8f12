"""Timing a piece of work where it runs: the host's clock on a CPU, CUDA events on a GPU.

On a GPU, ``time.perf_counter`` around a layer's forward sees how long the host took to
*launch* its kernels, not how long they ran. :class:`CudaEventTimer` records an event
before and after and returns the device time between them. The pipeline times every
layer it runs on its own (the measured micro-batch of a profile step, layers that
recompute or swap, and every layer of a step that is not fused: the first, and every step
under a memory limit or with rebalancing on), so its timer does not wait
(``wait=False``): :meth:`~CudaEventTimer.stop` returns a :class:`DeviceSeconds` that
reads the events when first converted with ``float()``, which the layer profiler does
at the end of the step (:meth:`~trainwright.observe.layer_profile.LayerProfiler.end_step`),
so the host keeps launching kernels ahead of the device. (A waiting timer, as the first
GPU check had, made every measured layer a host-device round trip: launch latency the
step then paid once per layer and micro-batch.)

Both timers have the same two calls, ``mark = timer.start()`` and
``seconds = timer.stop(mark)`` (a float, or anything ``float()`` turns into one);
:func:`device_timer` picks one for a device. Tests pass their own object with these
calls (an injected clock).
"""

from __future__ import annotations

import time
from typing import Protocol, SupportsFloat

import torch


class Timer(Protocol):
    """``start() -> mark``; ``stop(mark) -> seconds`` of work done in between (a float, or
    a value ``float()`` reads later)."""

    def start(self) -> object: ...

    def stop(self, mark: object) -> float | SupportsFloat: ...


class WallTimer:
    """The host's monotonic clock (``time.perf_counter``, or an injected ``clock``)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock

    def start(self) -> float:
        return self.clock()

    def stop(self, mark: float) -> float:
        return self.clock() - mark


class DeviceSeconds:
    """Device time between two recorded CUDA events, read (waiting for the end event) when
    first converted with ``float()``."""

    __slots__ = ("start", "end", "_value")

    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event):
        self.start, self.end, self._value = start, end, None

    def __float__(self) -> float:
        if self._value is None:
            self.end.synchronize()
            self._value = self.start.elapsed_time(self.end) / 1e3  # milliseconds -> s
        return self._value


class CudaEventTimer:
    """Device time between two CUDA events on the current stream of ``device``.

    Args:
        device: the CUDA device.
        wait: :meth:`stop` waits for the end event and returns seconds; False: it returns
            a :class:`DeviceSeconds`, read later (the step goes on meanwhile).
    """

    def __init__(self, device: torch.device, wait: bool = True):
        self.device, self.wait = device, wait

    def start(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def stop(self, mark: torch.cuda.Event) -> float | DeviceSeconds:
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        seconds = DeviceSeconds(mark, end)
        return float(seconds) if self.wait else seconds


def device_timer(device: torch.device | None,
                 wait: bool = True) -> WallTimer | CudaEventTimer:
    """The timer for work on ``device``: CUDA events on a CUDA device (``wait``: see
    :class:`CudaEventTimer`), else the wall clock."""
    if device is not None and device.type == "cuda":
        return CudaEventTimer(device, wait=wait)
    return WallTimer()
