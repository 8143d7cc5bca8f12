"""The token ring's messages on the wire: one JSON header frame, then each
tensor's raw bytes; and the standby node's wait for its welcome. The protocol itself is
:mod:`trainwright.tokenring.ring`.
"""

from __future__ import annotations

import json
import math
import time
import warnings

import torch
import zmq

from trainwright.errors import CommError

__all__ = ["pack", "unpack", "wait_welcome"]


def pack(header: dict, tensors: list[torch.Tensor]) -> list:
    """Frames of one message: a JSON header, then each tensor's raw bytes (no copy)."""
    header = {**header, "shapes": [list(t.shape) for t in tensors],
              "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors]}
    # bytes view of each tensor (any dtype, bfloat16 included), shared with the tensor
    return [json.dumps(header, separators=(",", ":")).encode()] + [
        memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        for t in tensors]


def unpack(frames: list) -> tuple[dict, list[torch.Tensor]]:
    """Inverse of :func:`pack`; tensors view the received buffers (no copy)."""
    header = json.loads(frames[0].bytes)
    out = []
    for frame, shape, dt in zip(frames[1:], header.get("shapes", []), header.get("dtypes", []),
                                strict=True):
        dtype = getattr(torch, dt)
        if math.prod(shape) == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        with warnings.catch_warnings():  # read-only buffer: we never write into it
            warnings.simplefilter("ignore", UserWarning)
            out.append(torch.frombuffer(frame.buffer, dtype=dtype).reshape(shape))
    return header, out


def wait_welcome(pull: zmq.Socket, deadline_s: float) -> tuple[dict, list[torch.Tensor], list]:
    """Standby: wait on ``pull`` for the first node's welcome (weights and closes).

    Returns:
        The welcome header, the weights, and the messages that arrived before it (to replay).

    Raises:
        CommError: no welcome within ``deadline_s``.
    """
    end = time.monotonic() + deadline_s
    early: list = []
    while time.monotonic() < end:
        if not pull.poll(int(max(1, (end - time.monotonic()) * 1000))):
            break
        frames = pull.recv_multipart(copy=False)
        header = json.loads(frames[0].bytes)
        if header["t"] == "welcome":
            h, weights = unpack(frames)
            return h, [w.clone() for w in weights], early
        early.append(frames)
    raise CommError(f"standby node: not admitted within {deadline_s:.0f} s; the ring admits "
                    f"standby nodes at batch boundaries (tokenring.batch_steps)")
