"""Tied (shared) weights between layers: find them, and give each layer its own copy.

A weight is *tied* when two layers of the model hold the same ``nn.Parameter`` object
(Hugging Face GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; captured layers keep
the model's objects, see :mod:`trainwright.model.graph`). Every rank builds the whole model
and keeps its stage's layers, so a tie whose layers land on two stages becomes two copies
that the pipeline must keep equal (:mod:`trainwright.pipeline.tied`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Tie", "find_ties", "untie"]


@dataclass(frozen=True)
class Tie:
    """One shared weight: where each layer holding it registers it."""

    members: tuple[tuple[int, str], ...]
    """``(layer index, parameter name inside that layer)``, by layer index."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The indices of the layers holding the weight."""
        return tuple(i for i, _ in self.members)

    def describe(self, names: list[str] | None = None) -> str:
        """``"lm_head.weight in layers 0 (embed), 3 (head)"``."""
        where = ", ".join(f"{i}" + (f" ({names[i]})" if names else "") for i in self.layers)
        return f"{self.members[0][1]} in layers {where}"


def find_ties(named: list[tuple[str, nn.Module]]) -> list[Tie]:
    """Every parameter object held by two or more layers, in order of first appearance."""
    holders: dict[int, list[tuple[int, str]]] = {}
    order: list[int] = []
    for index, (_, module) in enumerate(named):
        for pname, p in module.named_parameters():
            if id(p) not in holders:
                holders[id(p)] = []
                order.append(id(p))
            holders[id(p)].append((index, pname))
    return [Tie(tuple(holders[k])) for k in order if len(holders[k]) > 1]


def _set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def untie(named: list[tuple[str, nn.Module]], ties: list[Tie]) -> None:
    """Give every layer after the first holder of each tie its own copy of the weight.

    The copies start equal; :class:`~trainwright.pipeline.tied.TiedGradSync` sums their
    gradients so that they stay equal. Each layer then owns all its parameters, so a layer
    can migrate with its gradient and optimizer state alone.
    """
    for tie in ties:
        for index, pname in tie.members[1:]:
            module = named[index][1]
            shared = module.get_parameter(pname)
            copy = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
            for name, p in list(module.named_parameters(remove_duplicate=False)):
                if p is shared:  # every name the layer has for it
                    _set_parameter(module, name, copy)
