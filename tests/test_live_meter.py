"""The live-storage meter and the GPT cut into attention and MLP layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainwright.bench.live_meter import Checkpointed, Metered, reset_meter
from trainwright.bench.memory import MemoryBenchSpec, checkpoint_candidates
from trainwright.model.gpt import GPTConfig, gpt_layers
from trainwright.model.gpt_split import split_gpt_layers


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.timeout(60)
def test_meter_counts_forward_storages_until_freed():
    m = reset_meter()
    layer = Metered(_mlp())
    x = torch.randn(4, 8, requires_grad=True)
    y = layer(x)
    # input, fc output, gelu output, output: 4*8 + 4*32 + 4*32 + 4*8 floats; weights excluded
    assert m.bytes == m.peak_bytes == 4 * (32 + 128 + 128 + 32)
    y.sum().backward()
    del y
    assert m.bytes == 4 * 32  # only x is alive


@pytest.mark.timeout(60)
def test_memory_a_freed_parameter_leaves_is_counted_when_an_activation_takes_it():
    # bench_gpt wraps every layer of the whole model, then each pipeline rank drops the
    # layers of the other stages: their parameters' memory is freed and reused by this
    # stage's activations, which the meter must still count (an exclusion by address alone
    # hid 1-2 MB of a 9 MB stage). numpy holds the memory, so the new storage lands on the
    # freed parameter's address for sure.
    import numpy as np

    m = reset_meter()
    buf = np.zeros(64, dtype=np.float32)
    gone = nn.Linear(8, 8, bias=False)
    gone.weight = nn.Parameter(torch.from_numpy(buf).view(8, 8))
    Metered(gone)  # excluded: a parameter
    address = gone.weight.untyped_storage().data_ptr()
    del gone
    layer = Metered(nn.Identity())
    x = torch.from_numpy(buf)  # a new storage at the freed parameter's address
    assert x.untyped_storage().data_ptr() == address
    layer(x)
    assert m.bytes == 64 * 4
    kept = nn.Linear(8, 8)
    Metered(kept)
    layer(kept.weight)  # a live parameter passed in is still not counted
    assert m.bytes == 64 * 4


@pytest.mark.timeout(60)
def test_meter_sees_through_checkpoint_hooks_and_counts_recompute():
    m = reset_meter()
    layer = Checkpointed(Metered(_mlp()))
    x = torch.randn(4, 8, requires_grad=True)
    y = layer(x)
    assert m.bytes == 4 * (32 + 32)  # checkpoint keeps the input; the output is alive
    # the forward's working set: without a graph the fc output is freed before the last
    # linear allocates, so the peak is input + fc + gelu outputs
    assert m.peak_bytes == 4 * (32 + 128 + 128)
    m.peak_bytes = m.bytes
    y.sum().backward()
    # recomputed in backward (torch stops the recompute once the saved tensors are back)
    assert m.peak_bytes == 4 * (32 + 32 + 128 + 128)


@pytest.mark.timeout(60)
def test_split_gpt_computes_what_the_block_gpt_computes():
    cfg = GPTConfig(vocab=64, context=8, d_model=16, n_heads=2, n_blocks=2)
    torch.manual_seed(0)
    blocks = nn.Sequential(*gpt_layers(cfg))
    torch.manual_seed(0)
    split = split_gpt_layers(cfg)
    assert [n for n, _ in split] == ["embed", "attn0", "mlp0", "attn1", "mlp1", "head"]
    ids = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(nn.Sequential(*(m for _, m in split))(ids), blocks(ids))


@pytest.mark.timeout(60)
def test_checkpoint_candidates_fewest_first_and_distinct():
    spec = MemoryBenchSpec(n_blocks=2)
    cands = checkpoint_candidates(spec)
    sizes = [len(c[1]) for c in cands]
    assert sizes == sorted(sizes)
    assert len({tuple(c[1]) for c in cands}) == len(cands)
    rules = dict(cands)
    assert rules["every layer"] == list(range(6))
    assert rules["all MLP layers"] == [2, 4] and rules["all attention layers"] == [1, 3]
    # per-stage rules: 6 layers over 4 stages split [2, 2, 1, 1]; each stage's first layer
    assert rules["each stage's first 1 layers"] == [0, 2, 4, 5]


def _swapping():
    """A fresh meter, a metered MLP, a store to swap through and an input."""
    from trainwright.pipeline.store import ActivationStore

    return reset_meter(), Metered(_mlp()), ActivationStore(), torch.randn(4, 8,
                                                                          requires_grad=True)


@pytest.mark.timeout(60)
def test_meter_tells_host_swap_copies_from_device_bytes_by_allocation_site():
    m, layer, store, x = _swapping()
    with store.capture((x,), swap=True) as cap:
        y = layer(x)
    # every saved activation but the input went through HostSwap.pack: a host copy
    copies = sum(s.nbytes for s in cap.swapped)
    assert copies > 0 and m.host_bytes == m.peak_host_bytes == copies
    # device: input, fc and gelu outputs at once; the fc output, saved as a host copy
    # only, is freed before the last linear allocates
    assert m.peak_bytes == 4 * (32 + 128 + 128)
    y.sum().backward()
    del y, cap
    assert m.host_bytes == 0


@pytest.mark.timeout(60)
def test_the_whole_steps_meter_sees_host_copies_of_what_the_loss_saves():
    # autograd runs pack hooks with grad mode off: outside a metered layer (the loss on
    # the last stage) the whole-step meter took their copies for backward work and counted
    # none (bench planner: every swapped last stage 270 KB per micro-batch under the store)
    m, layer, store, x = _swapping()
    m.start_steps()
    try:
        with store.capture((x,), swap=True) as cap:
            loss = torch.nn.functional.cross_entropy(layer(x), torch.tensor([0, 1, 2, 3]))
    finally:
        m.stop_steps()
    assert m.host_bytes == sum(s.nbytes for s in cap.swapped) > 0
    loss.backward()


@pytest.mark.timeout(60)
def test_level_two_detail_names_each_live_storage_by_layer_and_the_action_that_made_it():
    import importlib.util
    import time
    from pathlib import Path

    m = reset_meter()
    m.detail = 2
    first, second = Metered(nn.Linear(8, 32), "0:a"), Metered(nn.Linear(32, 8), "1:b")
    t0 = time.time()
    y = second(first(torch.randn(4, 8)))
    t1 = time.time()
    rows = m.live_at_peak
    assert sum(r["bytes"] for r in rows) == m.peak_bytes == 4 * (8 + 32 + 8) * 4
    assert {(r["layer"], r["bytes"]) for r in rows} == {("", 4 * 8 * 4), ("0:a", 4 * 32 * 4),
                                                        ("1:b", 4 * 8 * 4)}
    # tools/meter_at_peak.py names the traced action running when each was made
    spec = importlib.util.spec_from_file_location(
        "meter_at_peak", Path(__file__).parents[1] / "tools" / "meter_at_peak.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    events = [{"ph": "X", "pid": 1, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "name": "F0",
               "args": {"step": 2}},
              {"ph": "X", "pid": 0, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "name": "B5"}]
    got = tool.attribute(rows, events, rank=1)
    assert sum(got.values()) == m.peak_bytes and {k[0] for k in got} == {"F0@2"}
    assert tool.action_at(events, 1, t1 * 1e6 + 1e6) == "between actions"
    del y


@pytest.mark.timeout(60)
def test_the_meters_output_folder_is_made_or_refused_in_one_line(tmp_path, monkeypatch):
    # tools/meter_at_peak.py's recipe names a folder; a missing one killed every rank of
    # the run with a FileNotFoundError traceback at the first peak
    from trainwright.bench.live_meter import bench_gpt, meter
    from trainwright.config import load_config
    from trainwright.errors import ConfigError

    cfg = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.n_blocks=1",
                             "model.context=8"])
    reset_meter()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TW_BENCH_METER_DIR", str(tmp_path / "new" / "meter"))
    bench_gpt(cfg)
    meter().flush()
    assert (tmp_path / "new" / "meter" / "rank0.json").is_file()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TW_BENCH_METER_DIR", str(tmp_path / "file" / "meter"))
    with pytest.raises(ConfigError, match="TW_BENCH_METER_DIR=.*cannot create it"):
        bench_gpt(cfg)
    reset_meter()
