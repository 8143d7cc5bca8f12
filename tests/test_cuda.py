"""The CUDA branches, on a CUDA device: ``python -m pytest -m cuda`` (``tools/gpu_check.sh``).

Skipped where no CUDA device is visible (``tests/test_gpu_check.py`` checks that they are
collected and skipped here). Every run is two pipeline stages as two processes on one GPU:
NCCL refuses two ranks on one device ("Duplicate GPU detected"), so these runs use the gloo
backend with ``parallel.device = "cuda"``, which moves each transferred tensor through host
memory (:mod:`trainwright.dist.collective`). A machine with two GPUs would run them with
NCCL; none has been available.

What they check: the pipeline trains on the GPU equal to the one-process CPU reference
(fp32, to 1e-4: CUDA and CPU kernels sum in other orders); swap (pinned buffers, side
stream, prefetch) and recompute (CUDA RNG restored) equal keep on the GPU; a run planned
under a limit stays within it by the CUDA allocator, every step; the profile measures each
layer's backward by the allocator; ``memory.limit = "auto"`` resolves
against the device; bf16 trains; per-layer times from CUDA events agree with a
synchronised wall clock.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.helpers import step_rows
from tests.torch_reference import check_against_torch
from trainwright.run.api import run_job

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(600)]

ON_GPU = {"parallel.backend": '"gloo"', "parallel.device": '"cuda"'}


def _run(cfg):
    outcome = run_job(cfg)
    assert outcome.code == 0, outcome.error
    return outcome.run_dir


def _gpu(tiny, **kw):
    return tiny(**{**ON_GPU, **kw})


def _params(run_dir):
    from trainwright.run.api import load_model
    return dict(load_model(run_dir).named_parameters())


def test_two_stages_on_one_gpu_train_equal_to_the_cpu_reference(tiny):
    cfg = _gpu(tiny, **{"train.steps": 4, "train.schedule": '"1f1b"', "train.micro_batches": 4})
    run_dir = _run(cfg)
    check_against_torch(cfg, run_dir, loss_rtol=1e-4, param_tol=1e-4)
    stages = step_rows(run_dir)[-1]["stages"]
    assert all(st.get("cuda_max_allocated_bytes", 0) > 0 for st in stages), \
        f"the ranks did not run on the GPU: {stages}"


@pytest.mark.parametrize(
    "policies", [["swap"], ["recompute"], ["keep", "swap", "recompute", "swap"]])
def test_swap_and_recompute_on_cuda_equal_keep(tiny, policies):
    common = {"train.steps": 3, "train.micro_batches": 4, "train.schedule": '"gpipe"'}
    keep = _run(_gpu(tiny, **common))
    other = _run(_gpu(tiny, **common, **{"memory.policies": json.dumps(policies)}))
    losses = [[r["loss"] for r in step_rows(d)] for d in (keep, other)]
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]))
    got, ref = _params(other), _params(keep)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_planned_run_stays_within_its_limit_by_the_allocator(tiny):
    common = {"train.steps": 3, "train.micro_batches": 8, "train.schedule": '"gpipe"',
              "model.d_model": 256, "model.n_blocks": 4, "model.context": 128,
              "train.batch_size": 64}
    keep = _run(_gpu(tiny, **common))
    peaks = [st["cuda_activation_peak_bytes"] for st in step_rows(keep)[-1]["stages"]]
    limit = max(peaks) // 2
    planned = _run(_gpu(tiny, **common, **{"memory.limit": limit,
                                            "memory.planner": '"optimal"'}))
    over = [(row["step"], st["stage"], st["cuda_activation_peak_bytes"])
            for row in step_rows(planned) for st in row["stages"]
            if st["cuda_activation_peak_bytes"] > limit]
    assert not over, f"limit {limit} B (half of {peaks}); by the allocator, over: {over}"


def test_the_profile_measures_each_layers_backward_by_the_allocator(tiny):
    from trainwright.model.build import build_layers
    from trainwright.pipeline.profile import profile_model

    cfg = _gpu(tiny, **{"model.d_model": 256, "model.context": 128})
    table = profile_model(cfg, build_layers(cfg), torch.device("cuda", 0))
    back = {i: t.back_work for i, t in table.terms.items()}
    # measured for every layer (the blocks' backward allocates at least their input's
    # gradient); on a CPU nothing is measured (-1) and the walk leaves the backward out
    assert all(b >= 0 for b in back.values()) and max(back.values()) > 0, back
    cpu = profile_model(tiny(), build_layers(tiny()))
    assert {t.back_work for t in cpu.terms.values()} == {-1}


def test_auto_limit_resolves_against_the_device(tiny):
    from trainwright.config import parse_bytes
    from trainwright.pipeline.budget import resolve_limit

    cfg = _gpu(tiny, **{"memory.limit": '"auto"', "memory.reserve": '"1GiB"'})
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    assert resolve_limit("auto", cfg, device) == total - parse_bytes("1GiB")
    run_dir = _run(cfg)
    assert len(step_rows(run_dir)) == cfg.train.steps


def test_bf16_trains_on_cuda(tiny):
    cfg = _gpu(tiny, **{"train.precision": '"bf16"', "train.steps": 6,
                        "train.optimizer": '"adamw"', "train.lr": 0.003})
    run_dir = _run(cfg)
    losses = [r["loss"] for r in step_rows(run_dir)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    # bf16 on the GPU against bf16 autocast on the CPU: other kernels, same arithmetic
    check_against_torch(cfg, run_dir, loss_rtol=3e-2, param_tol=3e-2)


def test_cuda_event_layer_times_agree_with_a_synchronised_wall_clock():
    from trainwright.observe.timing import CudaEventTimer, device_timer

    device = torch.device("cuda", 0)
    assert isinstance(device_timer(device), CudaEventTimer)
    layer = torch.nn.Linear(4096, 4096, device=device)
    x = torch.randn(8192, 4096, device=device)
    timer = CudaEventTimer(device)
    for _ in range(3):  # warm up kernels and the allocator
        layer(x)
    torch.cuda.synchronize(device)
    for _ in range(5):
        t0 = time.perf_counter()
        mark = timer.start()
        for _ in range(20):
            y = layer(x)
        events_s = timer.stop(mark)
        torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - t0
        del y
        assert events_s == pytest.approx(wall_s, rel=0.10), (events_s, wall_s)
    # the pipeline's timer does not wait: its reading resolves later, to the same time
    later = CudaEventTimer(device, wait=False)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    mark = later.start()
    for _ in range(20):
        layer(x)
    reading = later.stop(mark)
    torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - t0
    assert float(reading) == pytest.approx(wall_s, rel=0.10), (float(reading), wall_s)
