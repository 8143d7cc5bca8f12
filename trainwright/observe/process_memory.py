"""A rank's peak resident memory over a step: the CPU's counterpart of
``torch.cuda.max_memory_allocated`` for the ``step`` rows.

The activation store counts only what it holds; this is everything the process held at
its worst moment (weights, gradients, optimizer state, activations, buffers, the
allocator's slack), from the kernel. On Linux the high-water mark (``VmHWM``) is read and
then reset through ``/proc/self/clear_refs``, so each reading covers the time since the
last one; elsewhere it is the process's lifetime peak (``ru_maxrss``).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

__all__ = ["peak_resident_bytes"]

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def peak_resident_bytes(reset: bool = True) -> int:
    """Peak resident bytes of this process since the last reset (Linux), else ever."""
    try:
        text = _STATUS.read_text()
        kib = int(next(x for x in text.splitlines() if x.startswith("VmHWM:")).split()[1])
        if reset:
            _CLEAR.write_text("5")  # resets VmHWM to the current resident size
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
