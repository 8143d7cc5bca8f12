"""Linear layers whose weight gradients wait for W (pipeline/deferred_linear.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from trainwright.model.gpt import Block, GPTConfig
from trainwright.pipeline.deferred_linear import WeightStash, defer_linears
from trainwright.pipeline.split_backward import backward_input, backward_weight


class _Odd(nn.Module):
    """A block plus the cases B alone would miss or double-count: a linear whose input does
    not hang from the segment's input, and a weight used by a linear and by an embedding."""

    def __init__(self, big_rest: bool = False):
        super().__init__()
        self.block = Block(GPTConfig(vocab=32, context=8, d_model=16, n_heads=2, n_blocks=1))
        self.query = nn.Parameter(torch.randn(8, 16))
        self.key = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16, bias=False)
        self.embed = nn.Embedding(16, 16)
        self.embed.weight = self.tied.weight
        # a non-linear parameter holding most elements keeps the boundary-node W
        self.scale = nn.Parameter(torch.randn(64, 8, 16)) if big_rest else None

    def forward(self, x):
        y = self.block(x) + self.key(self.query)  # key's input needs no input gradient
        y = y + self.tied(y)  # a weight in a linear here ...
        y = y + self.embed(torch.arange(8))  # ... and in an embedding
        y = y + nn.functional.linear(y, self.key.weight)  # F.linear itself stays plain
        return y * self.scale.sum(0) if self.scale is not None else y


def _reference(model, xs, gys):
    model.zero_grad(set_to_none=True)
    for x, gy in zip(xs, gys, strict=True):
        torch.autograd.backward(model(x), gy)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big_rest", [False, True])
def test_deferred_b_then_w_equals_plain_backward(big_rest):
    torch.manual_seed(0)
    model = _Odd(big_rest)
    xs = [torch.randn(2, 8, 16) for _ in range(3)]
    gys = [torch.randn(2, 8, 16) for _ in range(3)]
    ref = _reference(model, xs, gys)
    ref_dx = [torch.autograd.grad(model(x.requires_grad_()), x, gy)[0]
              for x, gy in zip(xs, gys, strict=True)]
    model.zero_grad(set_to_none=True)
    works = []
    for x, gy in zip(xs, gys, strict=True):
        x = x.detach().requires_grad_()
        stash = WeightStash()
        with defer_linears(model, stash):
            y = model(x)
        assert len(stash.weights) == 6  # qkv, proj, fc, out, key, the tied weight
        (dx,), work = backward_input((y,), (gy,), (x,), list(model.parameters()), stash)
        torch.testing.assert_close(dx, ref_dx[len(works)])
        assert len(stash.items) == 6  # B ran every deferred node, the one off the input too
        assert model.block.fc.weight.grad is None  # the linear weight side waits for W
        works.append(work)
    for work in works:
        backward_weight(work)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], msg=n)


@pytest.mark.timeout(60)
def test_unsplit_backward_under_deferral_returns_weight_gradients_at_once():
    torch.manual_seed(0)
    model, x, gy = _Odd(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    ref = _reference(model, [x], [gy])
    model.zero_grad(set_to_none=True)
    stash = WeightStash()
    with defer_linears(model, stash):
        y = model(x)
    torch.autograd.backward(y, gy)
    assert stash.items == []
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)


@pytest.mark.timeout(60)
def test_deferral_keeps_plain_linear_where_it_cannot_apply():
    lin = nn.Linear(4, 4)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    hooked = nn.Linear(4, 4)
    hooked.weight.register_hook(lambda g: g)
    wrapped = nn.Linear(4, 4)
    wrapped.forward = lambda x: nn.Linear.forward(wrapped, x) * 2  # someone else's patch
    stash = WeightStash()
    x = torch.randn(3, 4)
    model = nn.Sequential(lin, frozen, hooked, wrapped)
    with defer_linears(model, stash):
        with torch.no_grad():
            model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
        frozen(x)
        hooked(x)
        wrapped(x)
        assert stash.weights == {}
        y = lin(x)
    assert stash.weights == {id(lin.weight): lin.weight}
    assert type(y.grad_fn).__name__ == "_DeferredLinearBackward"
    assert "forward" not in lin.__dict__  # the class's forward is back
    assert lin(x).grad_fn.name() == "AddmmBackward0"
    torch.testing.assert_close(wrapped(x), 2 * nn.functional.linear(x, wrapped.weight,
                                                                    wrapped.bias))


class _AddParam(nn.Module):
    """``x + p`` hands ``x`` and ``p`` the same gradient tensor."""

    def __init__(self, big_rest: bool):
        super().__init__()
        self.p = nn.Parameter(torch.randn(1, 2, 16))
        self.lin = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))
        self.big = nn.Parameter(torch.randn(4096)) if big_rest else None

    def forward(self, x):
        y = self.lin(x + self.p)
        return y * self.big.mean() if self.big is not None else y


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big_rest", [False, True])
@pytest.mark.parametrize("defer", [False, True])
def test_a_gradient_shared_with_the_input_gradient_is_not_written_into(big_rest, defer):
    torch.manual_seed(0)
    model = _AddParam(big_rest)
    xs = [torch.randn(1, 2, 16) for _ in range(3)]
    gys = [torch.randn(1, 2, 16) for _ in range(3)]
    ref = _reference(model, xs, gys)
    model.zero_grad(set_to_none=True)
    sent, works = [], []
    for x, gy in zip(xs, gys, strict=True):
        x = x.detach().requires_grad_()
        stash = WeightStash() if defer else None
        with defer_linears(model, stash) if defer else contextlib.nullcontext():
            y = model(x)
        (dx,), work = backward_input((y,), (gy,), (x,), list(model.parameters()), stash)
        sent.append((dx, dx.clone()))  # what a pipeline would send on, and a copy
        works.append(work)
    for work in works:
        backward_weight(work)
    for dx, copy in sent:  # later micro-batches' adds went elsewhere
        torch.testing.assert_close(dx, copy, rtol=0, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], msg=n)
