"""The forecast's one profile of the model (:func:`take_profile`): single process, one
thread, one micro-batch, measured before any configuration runs.

Per layer, forward and backward times and every saved tensor's bytes
(:func:`~trainwright.observe.tensor_profile.profile_tensors`, median of
``ForecastSpec.profile_repeats`` passes) and the share of each backward its weight
gradients take; the SGD step per layer; a gloo ping-pong between two processes (latency,
bandwidth); the runtime's host swap through a :class:`~trainwright.pipeline.stage.Stage`
(its bytes/s, and its copies' thread CPU per byte, which a run's copies are compared with:
:func:`~trainwright.bench.planner_forecast.copy_ratios`); and the footprint terms of the
same micro-batch (:func:`~trainwright.pipeline.profile.profile_model`).
:mod:`~trainwright.bench.planner_forecast` takes it three times and merges the takes
(:func:`~trainwright.bench.forecast_model.merged`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainwright.bench.forecast_model import ForecastSpec, Profile

__all__ = ["take_profile"]


def _layers_and_batch(spec: ForecastSpec, with_config: bool = False):
    from trainwright.config import load_config
    from trainwright.model.build import build_data, build_layers

    cfg = load_config(None, spec.overrides(2, 4, "1f1b", "keep"))
    os.environ.pop("TW_BENCH_METER", None)
    layers = build_layers(cfg)
    x, y = build_data(cfg).batch(0, spec.micro_batch_size)
    return (layers, x, y, cfg) if with_config else (layers, x, y)


def _link_worker(rank: int, world: int, out_dir: str) -> None:
    from trainwright.dist.probe import measure_p2p

    small = measure_p2p(nbytes=64, repeats=20)
    big = measure_p2p(nbytes=4 * 2**20, repeats=5)
    if rank == 0:
        Path(out_dir, "links.json").write_text(json.dumps(
            {"small": small.bandwidth[0][1], "big": big.bandwidth[0][1]}))


def _measure_links() -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo ping-pong (message + 4-byte ack per round)."""
    from trainwright.dist.testing import run_workers

    with tempfile.TemporaryDirectory() as d:
        run_workers(_link_worker, 2, d, timeout_s=300)
        got = json.loads(Path(d, "links.json").read_text())
    latency = 64 / got["small"] / 2
    bandwidth = 1 / max(1 / got["big"] - 2 * latency / (4 * 2**20), 1e-12)
    return latency, bandwidth


def _host_bandwidth() -> float:
    """Bytes/s of a plain host copy into memory already touched."""
    src = torch.randn(2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(times)


SWAP_TIMED_MBS = 24
"""Micro-batch pairs (kept, swapped) timed by :func:`_swap_bandwidth`, after 4 untimed."""


def _swap_bandwidth(layers, x, y) -> tuple[float, float]:
    """Bytes/s of host swap as the runtime does it, and the thread CPU seconds per byte of
    its forward copies (:meth:`~trainwright.pipeline.swap.HostSwap.take_copies`; what
    :func:`copy_ratios` compares a run's with): the model's layers in a
    :class:`~trainwright.pipeline.stage.Stage`, each its own segment, forward and backward
    of one micro-batch with every layer kept, then with every layer swapped, alternating;
    twice the bytes the swap held on the host (out in forward, back in backward) over the
    median of the pairs' differences. On the CPU a copy is a fresh allocation per saved
    tensor and a pack hook each, not a memcpy into memory already touched
    (:func:`_host_bandwidth`: 40-47 GB/s here, where the swap's runs at 12-13); that plain
    copy's rate where the difference is lost in noise."""
    from trainwright.model.build import cross_entropy
    from trainwright.observe.layer_profile import LayerProfiler
    from trainwright.pipeline.stage import LayerSlot, Stage, StepMode
    from trainwright.pipeline.store import ActivationStore

    def stage(policy: str) -> Stage:
        store = ActivationStore()
        store.exclude_params([m for _, m in layers])  # as the runtime: weights stay put
        st = Stage([LayerSlot(i, name, m) for i, (name, m) in enumerate(layers)], store,
                   LayerProfiler(), is_first=True, loss_fn=cross_entropy)
        store.set_policies(dict.fromkeys(range(len(layers)), policy))
        st.options.mode = StepMode(fast=False)  # every layer its own segment, both ways
        return st

    def once(st: Stage, mb: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        st.forward(mb, (x,), y)
        host = st.store.host_bytes
        st.backward(mb)
        took = time.perf_counter() - t0
        st.profiler.end_step()
        return took, host

    kept, swapped = stage("keep"), stage("swap")
    diffs, host, copies = [], 0, []
    for mb in range(SWAP_TIMED_MBS + 4):
        k, _ = once(kept, mb)
        s, host = once(swapped, mb)
        cpu_s, copied = swapped.store.swap.take_copies()
        if mb >= 4:
            diffs.append(s - k)
            copies.append(cpu_s / copied if copied else 0.0)
    extra = statistics.median(diffs)
    return (2 * host / extra if extra > 0 and host else _host_bandwidth(),
            statistics.median(copies))


def _opt_step_times(layers) -> list[float]:
    out = []
    for _, m in layers:
        params = list(m.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(params, lr=0.0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
        out.append(statistics.median(times))
    return out


def take_profile(spec: ForecastSpec) -> Profile:
    """The one profile: single process, one thread, one micro-batch (see module docstring)."""
    from trainwright.model.build import cross_entropy
    from trainwright.observe.tensor_profile import profile_tensors
    from trainwright.pipeline.profile import profile_model

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layers, x, y, cfg = _layers_and_batch(spec, with_config=True)
        runs = [profile_tensors(layers, x, y, cross_entropy) for _ in range(spec.profile_repeats)]
        rows = runs[-1]
        for i, r in enumerate(rows):
            r.forward_s = statistics.median(run[i].forward_s for run in runs)
            r.backward_s = statistics.median(run[i].backward_s for run in runs)
        opt = _opt_step_times(layers)
        host, copy_cpu = _swap_bandwidth(layers, x, y)
        table = profile_model(cfg, layers)  # the footprint terms, same micro-batch size
        for r, c in zip(rows, table, strict=True):  # W's measured share of each backward
            r.weight_s = r.backward_s * c.weight_s / c.backward_s if c.backward_s else 0.0
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth = _measure_links()
    return Profile(rows, opt, latency, bandwidth, host, time.perf_counter() - t0, table,
                   copy_cpu_s_per_byte=copy_cpu)
