"""A node's whole training state as tensor frames: parameters, then optimizer state.

The first node sends it in every *welcome* (at formation, after a resume, and when it admits
a standby node), so a node that joins has the others' weights **and** their optimizer state
(Adam's moments and step counts): with any ``torch.optim`` optimizer the replicas then stay
bit-identical. The optimizer's state tensors travel as frames; a small JSON skeleton in the
welcome header says where each goes. Param groups (learning rate, betas...) are not sent:
every node builds its optimizers from the same configuration.
"""

from __future__ import annotations

import torch

__all__ = ["snapshot", "restore"]


def _params(slots: list) -> list[torch.Tensor]:
    return [p for slot in slots for p in slot.module.parameters()]


def snapshot(slots: list) -> tuple[list[torch.Tensor], dict]:
    """The layers' parameters followed by their optimizers' state tensors, and the skeleton.

    Args:
        slots: the stage's ``LayerSlot`` list (each with its module and optimizer).

    Returns:
        ``(tensors, skeleton)``: ``skeleton = {"params": n, "optim": {layer: {param: {key:
        frame index or plain value}}}}``.
    """
    tensors = [p.detach() for p in _params(slots)]
    optim: dict = {}
    for slot in slots:
        if slot.optimizer is None:
            continue
        layer: dict = {}
        for pid, entry in slot.optimizer.state_dict()["state"].items():
            row = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    row[key] = {"frame": len(tensors)}
                    tensors.append(value.detach())
                else:
                    row[key] = {"value": value}
            layer[str(pid)] = row
        optim[str(slot.index)] = layer
    return tensors, {"params": len(_params(slots)), "optim": optim}


def restore(slots: list, tensors: list[torch.Tensor], skeleton: dict | None) -> None:
    """Copy a :func:`snapshot` into the layers and their optimizers (in place).

    A welcome without a skeleton (parameters only) leaves the optimizers as they are.
    """
    params = _params(slots)
    count = len(params) if skeleton is None else skeleton["params"]
    if count != len(params) or len(tensors) < count:
        raise ValueError(f"welcome carries {count} parameters, this model has {len(params)}")
    with torch.no_grad():
        for p, w in zip(params, tensors[:count], strict=True):
            p.copy_(w)
    if skeleton is None:
        return
    for slot in slots:
        rows = skeleton["optim"].get(str(slot.index))
        if slot.optimizer is None or rows is None:
            continue
        state = {int(pid): {key: tensors[v["frame"]].clone() if "frame" in v else v["value"]
                            for key, v in row.items()} for pid, row in rows.items()}
        current = slot.optimizer.state_dict()
        slot.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
