"""The GPU check's behaviour where there is no GPU (every machine CI runs on), and the
device-independent parts of the CUDA branches."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainwright.bench.memory_cuda import GpuMemorySpec, copy_overlap, gpu_checkpoint_candidates
from trainwright.errors import ConfigError
from trainwright.observe.timing import CudaEventTimer, WallTimer, device_timer

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


@NO_CUDA
def test_gpu_check_exits_at_once_in_one_line_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    got = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), str(out)],
                         capture_output=True, text=True, timeout=120)
    lines = (got.stdout + got.stderr).strip().splitlines()
    assert got.returncode == 3, got
    assert lines == ["gpu_check: no CUDA device is present (torch.cuda.is_available() is "
                     "false); nothing checked"]
    assert not out.exists()


@NO_CUDA
def test_cuda_tests_are_collected_and_skipped_without_cuda():
    got = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py",
                          "-q", "-rs", "-p", "no:cacheprovider"], cwd=ROOT,
                         capture_output=True, text=True, timeout=170)
    assert got.returncode == 0, got.stdout[-2000:]
    skipped = re.findall(r"SKIPPED \[(\d+)\] tests/test_cuda.py:\d+: needs a CUDA device",
                         got.stdout)
    assert sum(map(int, skipped)) == 9, got.stdout[-2000:]  # 7 tests, one in 3 variants


def test_the_timer_follows_the_device():
    assert isinstance(device_timer(torch.device("cpu")), WallTimer)
    assert isinstance(device_timer(None), WallTimer)
    assert isinstance(device_timer(torch.device("cuda", 0)), CudaEventTimer)  # built, not run
    now = [10.0]
    timer = WallTimer(clock=lambda: now[0])
    mark = timer.start()
    now[0] += 0.25
    assert timer.stop(mark) == 0.25


@NO_CUDA
def test_asking_for_cuda_without_one_is_a_one_line_config_error(tiny):
    from trainwright.run.worker import resolve_device

    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        resolve_device(tiny(**{"parallel.device": '"cuda"'}))
    with pytest.raises(ConfigError, match="needs parallel.device"):
        resolve_device(tiny(**{"parallel.backend": '"nccl"', "parallel.device": '"cpu"'}))
    assert resolve_device(tiny()) == ("gloo", "cpu")


def test_copy_overlap_counts_copy_time_under_compute():
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, a, b):
        return NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=a, end=b))
    events = [ev("Memcpy DtoH (Device -> Pinned)", 0, 10), ev("gemm", 5, 20),
              ev("Memcpy HtoD (Pinned -> Device)", 30, 40), ev("elementwise", 35, 36),
              NS(name="aten::mm", device_type=DeviceType.CPU, time_range=NS(start=0, end=99))]
    got = copy_overlap(events)
    assert got["copies"] == 2 and got["copy_us"] == 20
    assert got["overlapped_us"] == 6 and got["overlap_fraction"] == 0.3


def test_gpu_checkpoint_candidates_are_distinct_and_cover_each_stage():
    spec = GpuMemorySpec(n_blocks=4, stages=2)
    cands = gpu_checkpoint_candidates(spec)
    assert len({tuple(c) for _, c in cands}) == len(cands)
    per_stage = dict(cands)["each stage's first half"]
    assert 0 in per_stage and sum(spec.layer_split()[:1]) in per_stage
