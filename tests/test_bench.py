"""`trainwright bench pipeline` runs end to end and compares systems doing the same work."""

from __future__ import annotations

import pytest
import torch

from trainwright.bench.pipeline import run
from trainwright.bench.spec import PipelineBenchSpec
from trainwright.cli import main

TINY = dict(n_blocks=2, d_model=32, n_heads=2, context=16, micro_batches=4,
            micro_batch_size=2, split=[2, 2], steps=3, warmup=1)


@pytest.mark.timeout(300)
def test_bench_pipeline_runs_and_systems_do_the_same_work():
    result = run(PipelineBenchSpec(**TINY), repeats=1, deepspeed=False)
    for key in ("trainwright_samples_per_s", "torch_pipelining_samples_per_s", "ratio",
                "bubble_fraction", "bubble_bound"):
        assert key in result
    assert result["ratio"] > 0
    assert 0 <= result["bubble_fraction"] < 1
    assert result["bubble_bound"] == pytest.approx(1 / 5, abs=1e-3)
    rows = {r["system"]: r for r in result["rows"]}
    # same weights, same batches, same optimizer: the loss curves must agree
    torch.testing.assert_close(torch.tensor(rows["trainwright_1f1b"]["losses_last_repeat"]),
                               torch.tensor(rows["torch_pipelining_1f1b"]["losses_last_repeat"]),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(60)
def test_unknown_benchmark_is_a_config_error(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_saved_tensor_meter_counts_what_autograd_keeps():
    from trainwright.bench.meter import SavedTensorMeter

    lin = torch.nn.Linear(8, 8, bias=False)
    meter = SavedTensorMeter(exclude=[lin])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.measure():
        y = torch.tanh(lin(x))  # saves x (matmul) and tanh's output; the weight is excluded
        assert meter.bytes == 2 * 4 * 8 * 4
        y.sum().backward()
    assert meter.bytes == 0 and meter.peak_bytes == 2 * 4 * 8 * 4


@pytest.mark.timeout(600)
def test_bench_memory_runs_and_planned_stages_fit():
    from trainwright.bench.memory import MemoryBenchSpec
    from trainwright.bench.memory import run as run_memory

    spec = MemoryBenchSpec(d_model=32, n_heads=2, context=16, micro_batch_size=2, steps=2)
    result = run_memory(spec, repeats=1, deepspeed=False)
    for key in ("unconstrained_peak_bytes", "limit_bytes", "ratio_vs_checkpoint_all"):
        assert key in result
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"keep", "greedy", "optimal", "optimal_no_swap", "checkpoint_all"}
    assert result["limit_bytes"] == result["unconstrained_peak_bytes"][0] // 2
    for name in ("greedy", "optimal", "optimal_no_swap"):
        assert all(p <= result["limit_bytes"] for p in rows[name]["peak_bytes_per_stage"])
        assert rows[name]["fits"]
    assert "swap" not in {p for ps in rows["optimal_no_swap"]["policies"].values() for p in ps}
    for name in ("greedy", "optimal", "optimal_no_swap", "checkpoint_all"):  # same as keep
        torch.testing.assert_close(torch.tensor(rows[name]["losses"]),
                                   torch.tensor(rows["keep"]["losses"]))


@pytest.mark.timeout(300)
def test_bench_rebalance_runs_and_moves_layers_off_the_heavy_stage():
    from trainwright.bench.rebalance import RebalanceBenchSpec, best_static_partition
    from trainwright.bench.rebalance import run as run_rebalance

    assert best_static_partition([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == ([1, 5], 5.0)
    assert best_static_partition([1.0, 1.0, 2.0, 2.0], 3) == ([2, 1, 1], 2.0)
    spec = RebalanceBenchSpec(n_blocks=4, d_model=32, n_heads=2, context=16, micro_batches=4,
                              micro_batch_size=2, steps=12, static_steps=4, warmup=1)
    result = run_rebalance(spec, repeats=1, deepspeed=False)
    for key in ("before_samples_per_s", "after_samples_per_s", "best_static_samples_per_s",
                "ratio_to_best", "steps_to_rebalance", "migration_step_s", "median_step_s"):
        assert key in result
    assert result["best_static_samples_per_s"] > 0
    rows = {r["system"]: r for r in result["rows"]}
    assert len(rows["trainwright_rebalance"]["step_times_s"][0]) == spec.steps
    assert sum(rows["trainwright_best_static"]["partition"]) == spec.n_blocks + 2
    # at this size per-op overheads, not the heavy blocks, set the layer times, so the
    # direction of a move is not predictable; a move must change the partition
    assert all(r["old"] != r["new"] for rs in result["repartitions"] for r in rs)
