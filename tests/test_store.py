"""Activation store accounting and per-layer segments, single process."""

import torch
from torch import nn

from trainwright.observe.layer_profile import LayerProfiler
from trainwright.pipeline.stage import LayerSlot, Stage
from trainwright.pipeline.store import ActivationStore


def _stage(layers, last=True):
    store = ActivationStore()
    slots = [LayerSlot(i, f"l{i}", m) for i, m in enumerate(layers)]
    loss = (lambda out, y: ((out - y) ** 2).mean()) if last else None
    return Stage(slots, store, LayerProfiler(), is_first=True, loss_fn=loss), store


def test_segments_give_the_same_gradients_as_one_graph():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 16), nn.Linear(16, 4)]
    ref = nn.Sequential(*layers)  # same parameters, one autograd graph
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    stage, store = _stage(layers)
    for mb in range(2):
        stage.forward(mb, (x[mb * 3 : mb * 3 + 3],), y[mb * 3 : mb * 3 + 3])
    for mb in range(2):
        stage.backward(mb)
    got = [p.grad.clone() for p in stage.parameters()]
    for p in ref.parameters():
        p.grad = None
    loss = sum(((ref(x[i * 3 : i * 3 + 3]) - y[i * 3 : i * 3 + 3]) ** 2).mean() for i in range(2))
    loss.backward()
    for g, p in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)
    assert store.bytes == 0 and store.held() == []


def test_bytes_count_unique_storages_without_parameters():
    lin = nn.Linear(4, 4, bias=False)
    stage, store = _stage([lin, nn.Identity()], last=False)
    x = torch.randn(2, 4)
    stage.forward(0, (x,))
    # layer 0 keeps its input (saved by matmul, 32 B); its output is layer 1's input (32 B);
    # the weight, also saved by matmul, is a parameter and not counted
    assert store.bytes == 2 * 4 * 4 * 2
    assert store.microbatches() == {0}
    stage.forward(1, (torch.randn(2, 4),))
    assert store.peak_bytes == 2 * 64 and store.peak_microbatches == 2
    stage.backward(0, (torch.ones(2, 4),))
    assert store.bytes == 64
    store.reset_peaks()
    assert store.peak_bytes == 64 and store.peak_microbatches == 1


def test_profiler_sees_every_layer():
    stage, _ = _stage([nn.Linear(4, 4), nn.Linear(4, 2)])
    stage.forward(0, (torch.randn(3, 4),), torch.randn(3, 2))
    stage.backward(0)
    stage.profiler.end_step()
    table = stage.profiler.table()
    assert [c.layer for c in table] == [0, 1]
    assert all(c.forward_s > 0 and c.backward_s > 0 for c in table)
    assert table[0].param_bytes == (16 + 4) * 4 and table[0].output_bytes == 3 * 4 * 4


def test_capture_leaves_no_cycle_through_autograd():
    # exp saves its own output; packed as itself it would hold its grad_fn, a cycle through
    # C++ autograd nodes that gc cannot free. A split backward (B, then W over the weights
    # only) leaves such nodes unreleased: each ZB trainer leaked its graphs and its store.
    import gc
    import weakref

    store = ActivationStore()
    x = torch.randn(8, requires_grad=True)
    with store.capture((x,)):
        y = torch.exp(x * 2)
    torch.autograd.grad(y.sum(), x, retain_graph=True)  # a B that keeps the graph for W
    ref = weakref.ref(store)
    del store, y
    gc.collect()
    assert ref() is None


class _SavesOneRegionTwice(nn.Module):
    """As attention does: an op saves its output (``[b, h, t, d]``, laid out as
    ``[b, t, h, d]``) and the projection saves a ``[b * t, h * d]`` view of the same memory."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = x.view(3, 2, 2, 4).transpose(1, 2).exp()  # exp saves its output
        return self.proj(y.transpose(1, 2).reshape(6, 8))  # a view: linear saves it too


def test_swap_copies_memory_saved_twice_to_the_host_once():
    x = torch.randn(6, 8)
    grads = {}
    for policy in ("keep", "swap"):
        torch.manual_seed(1)
        layers = [nn.Linear(8, 8), _SavesOneRegionTwice()]
        stage, store = _stage(layers, last=False)
        store.set_policies({1: policy})
        stage.forward(0, (x,))
        if policy == "swap":
            # exp's output (6 x 8 floats) once, though autograd saved it twice
            assert store.host_bytes == 6 * 8 * 4
        stage.backward(0, (torch.ones(6, 8),))
        grads[policy] = [p.grad for p in stage.parameters()]
    for a, b in zip(grads["keep"], grads["swap"], strict=True):
        torch.testing.assert_close(a, b)


def test_swap_counts_its_copies_thread_cpu_time_and_bytes_per_window():
    # a run's copies over the same copies in one process are the planner's copy inflation
    stage, store = _stage([nn.Sequential(nn.Linear(256, 256), nn.Tanh())], last=False)
    store.set_policies({0: "swap"})
    for mb in range(2):
        stage.forward(mb, (torch.randn(512, 256),))
    cpu_s, copied = store.swap.take_copies()
    # tanh's output (the stage's input is not the layer's to copy; weights stay put)
    assert copied == 2 * 512 * 256 * 4 == store.host_bytes and cpu_s > 0
    assert store.swap.take_copies() == (0.0, 0)  # a new window
    stage2, store2 = _stage([_SavesOneRegionTwice()], last=False)
    store2.set_policies({0: "swap"})
    stage2.forward(0, (torch.randn(6, 8),))
    assert store2.swap.take_copies()[1] == 6 * 8 * 4  # memory saved twice is copied once
