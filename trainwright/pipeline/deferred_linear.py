"""Linear layers whose weight gradients wait for W, without a second autograd pass.

A zero-bubble B through autograd alone (:mod:`~trainwright.pipeline.split_backward`) keeps
the graph, hooks the nodes where the weight side branches off, and in W walks autograd
again from them. For a linear layer ``y = x W^T + b`` the weight side is two products of
tensors B already holds: ``dW = dy^T x`` and ``db = dy.sum()``. So while a segment's
forward runs under :func:`defer_linears`, every ``nn.Linear`` with a plain trainable weight
records one :class:`_DeferredLinear` node instead:

* in B (its :class:`WeightStash` set to ``defer``) the node computes ``dx = dy W`` only and
  stashes ``(x, dy)``;
* in W, :meth:`WeightStash.flush` adds ``dy^T x`` into ``weight.grad`` with one in-place
  ``addmm_`` (no second gradient tensor to allocate and add), and ``dy`` summed into the
  bias's.

Otherwise (an unsplit backward, or a W that walks autograd) the node returns its weight
and bias gradients like ``F.linear``'s own backward. ``tools/split_backward_cost.py`` on
the pipeline bench's segments (one thread, 20 paired rounds): B + W costs 1.02-1.04x one
unsplit backward this way, 1.14x through autograd alone, 1.10x in torch pipelining's
zero-bubble stages.

Calls that keep the plain ``F.linear``: no grad mode, autocast on (its casts belong to
autograd's own node), a weight or bias that is not a trainable parameter or carries
gradient hooks, or an input whose dtype differs from the weight's. ``F.linear`` called
directly (not through an ``nn.Linear``) stays plain too; its weight gets its gradient
through autograd like any other parameter.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightStash", "defer_linears"]


class WeightStash:
    """One segment's deferred linear layers: what their weight gradients need."""

    def __init__(self) -> None:
        self.defer = False
        """True from B on: nodes stash ``(x, dy)`` instead of returning weight gradients."""
        self.weights: dict[int, torch.Tensor] = {}
        """Weights run through a deferred node (by ``id``)."""
        self.items: list[tuple] = []
        """``(weight, bias, x, dy)`` per node B ran."""

    @torch.no_grad()
    def flush(self) -> None:
        """W: add every stashed node's weight and bias gradients; empties the stash."""
        for weight, bias, x, dy in self.items:
            x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
            if weight.grad is None:
                weight.grad = dy2.t().mm(x2)
            else:
                weight.grad.addmm_(dy2.t(), x2)
            if bias is not None:
                db = dy2.sum(0)
                if bias.grad is None:
                    bias.grad = db
                else:
                    bias.grad += db
        self.items = []


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward stashes the weight side when its stash says so."""

    @staticmethod
    def forward(ctx, x, weight, bias, stash):
        ctx.save_for_backward(x)  # through the store's pack hook: counted, swapped
        ctx.weight, ctx.bias, ctx.stash = weight, bias, stash
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weight, bias, stash = ctx.weight, ctx.bias, ctx.stash
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if stash.defer:
            stash.items.append((weight, bias, x, dy))
            return dx, None, None, None
        dy2 = dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def _plain(t) -> bool:
    return (t is None or (type(t) is torch.nn.Parameter and t.requires_grad
                          and not t._backward_hooks
                          and not getattr(t, "_post_accumulate_grad_hooks", None)))


def _forward(module: nn.Linear, stash: WeightStash, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if (torch.is_grad_enabled() and _plain(weight) and weight is not None and _plain(bias)
            and x.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        stash.weights[id(weight)] = weight
        return _DeferredLinear.apply(x, weight, bias, stash)
    return F.linear(x, weight, bias)


@contextmanager
def defer_linears(module: nn.Module, stash: WeightStash):
    """While active, every ``nn.Linear`` in ``module`` (its exact class: subclasses may
    compute otherwise; not one whose ``forward`` someone already replaced, e.g.
    accelerate's hooks) records deferred nodes into ``stash``.

    Each one's ``forward`` is shadowed by an instance attribute for the duration, so hooks
    and ``__call__`` stay as they were and no other operation pays anything (a
    ``TorchFunctionMode`` seeing every call cost 4 % of a GPT block's forward)."""
    linears = [m for m in module.modules()
               if type(m) is nn.Linear and "forward" not in m.__dict__]
    for m in linears:
        m.forward = functools.partial(_forward, m, stash)
    try:
        yield
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)
