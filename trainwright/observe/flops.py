"""Model FLOPs and the devices' peak: what model FLOPs utilisation (MFU) is measured against.

* :func:`count_flops` counts the floating-point operations of whatever a callable runs
  (e.g. one forward and backward of the model), layer by layer, with torch's
  ``FlopCounterMode`` (matmuls, convolutions and attention; no formula for one architecture).
* :func:`device_peak` is one device's peak FLOP/s: from :data:`GPU_PEAKS` for known GPUs
  (dense, no sparsity), else measured by :func:`calibrate_matmul` (a short square matmul
  loop, well under a second) — always so on a CPU.
* :class:`StepCost` turns a step's time into ``tokens_per_s`` and ``mfu``.

MFU = model FLOPs per step / (step time × the devices' summed peak). Model FLOPs are the
model's forward and backward; recomputed forwards and the optimizer step are not counted
(the usual definition, so MFU compares across memory policies).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["GPU_PEAKS", "Peak", "count_flops", "calibrate_matmul", "device_peak", "run_peak",
           "StepCost"]

log = logging.getLogger(__name__)

GPU_PEAKS: dict[str, dict[str, float]] = {
    # name fragment of torch.cuda.get_device_name -> dense peak FLOP/s per precision
    # (NVIDIA data sheets; bf16/fp16 on the tensor cores, fp32 without TF32)
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM (HBM3)
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}
"""Checked in this order: the first fragment found in the device name wins."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s a run's MFU is measured against."""

    flops_per_s: float
    """Summed over the devices the run uses."""
    per_device: float
    devices: float
    """Devices counted (on a CPU: ranks, at most as many as the cores can run at once)."""
    source: str
    """Where the figure comes from, e.g. ``"table: H100 bf16"`` or ``"calibrated ..."``."""

    def to_dict(self) -> dict:
        """The ``run`` row's fields: ``peak_flops_per_s``, ``peak_per_device``,
        ``peak_devices``, ``peak_source``."""
        return {"peak_" + k: v
                for k, v in asdict(self).items()}


def count_flops(fn: Callable[[], object]) -> int:
    """The FLOPs of what ``fn()`` runs (forward and backward both count), from the layers.

    Works on the ``meta`` device, where nothing is computed: count a whole model there
    without the memory or the time.
    """
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def calibrate_matmul(device: torch.device, precision: str = "fp32", size: int = 1024,
                     budget_s: float = 0.3) -> float:
    """FLOP/s of a square ``size`` matmul on ``device`` in ``precision``: the best of short
    repeats within about ``budget_s`` (after one warm-up), so a busy moment costs little."""
    dtype = _DTYPES[precision]
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16  # what CPU autocast computes in for half precision
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up (thread pool, kernels)
    sync()
    best, end = float("inf"), time.perf_counter() + budget_s
    while True:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > end:
            break
    return 2 * size ** 3 / best


def device_peak(device: torch.device, precision: str = "fp32") -> tuple[float, str]:
    """One device's peak FLOP/s and where the figure comes from: the table for a known GPU,
    a matmul calibration otherwise (every CPU). Calibrated, the peak is the faster of
    ``precision`` and fp32: a CPU without bf16 units runs a bf16 matmul a hundred times
    slower than fp32 (0.67 against 80 GFLOP/s on the host of docs/bench), and a model's own
    bf16 layers, smaller, beat that figure (MFU 4.6 for the tiny Llama example)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in GPU_PEAKS.items():
            if fragment in name:
                return peaks[precision], f"table: {fragment} {precision} dense ({name})"
    flops, measured = calibrate_matmul(device, precision), precision
    if precision != "fp32":  # half precision emulated (a CPU without bf16 units) is slower
        fp32 = calibrate_matmul(device, "fp32")
        if fp32 > flops:
            flops, measured = fp32, f"fp32 (faster here than {precision})"
    threads = torch.get_num_threads() if device.type == "cpu" else None
    where = f"{threads} threads" if threads is not None else torch.cuda.get_device_name(device)
    return flops, f"calibrated: 1024x1024 {measured} matmul, {where}"


def run_peak(device: torch.device, precision: str, ranks: int) -> Peak:
    """The peak of ``ranks`` devices like ``device``. On a CPU the ranks share the host's
    cores: each rank counts as one device at its thread count, and no more ranks count than
    the cores can run at once (4 one-thread ranks on 2 cores count as 2). On GPUs, ranks
    sharing a GPU (more local ranks, ``LOCAL_WORLD_SIZE``, than GPUs) count as that GPU."""
    per, source = device_peak(device, precision)
    devices = float(ranks)
    if device.type == "cpu":
        devices = min(devices, (os.cpu_count() or 1) / torch.get_num_threads())
    elif device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
        devices *= min(1.0, torch.cuda.device_count() / max(local, 1))
    return Peak(per * devices, per, devices, source)


@dataclass(frozen=True)
class StepCost:
    """What a step costs and what it is measured against: the source of a ``step`` row's
    ``tokens_per_s`` and ``mfu``.

    Args:
        flops_per_step: model FLOPs of one global step (forward and backward).
        peak: the devices' peak (None: no MFU).
        tokens_per_sample: tokens in a sample (the context) for token models, else None.
    """

    flops_per_step: int | None
    peak: Peak | None
    tokens_per_sample: int | None

    def run_fields(self) -> dict:
        """The ``run`` row's fields: FLOPs per step, tokens per sample and the peak."""
        return {"model_flops_per_step": self.flops_per_step,
                "tokens_per_sample": self.tokens_per_sample,
                **(self.peak.to_dict() if self.peak is not None else {})}

    def step_fields(self, samples_per_s: float, step_time_s: float) -> dict:
        """``tokens_per_s`` (samples/s × context, exactly), ``model_flops_per_s`` and
        ``mfu`` of a step that took ``step_time_s`` at ``samples_per_s``."""
        out = {}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.flops_per_step and self.peak is not None and step_time_s > 0:
            out["model_flops_per_s"] = self.flops_per_step / step_time_s
            out["mfu"] = out["model_flops_per_s"] / self.peak.flops_per_s
        return out
