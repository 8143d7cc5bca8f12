"""Which data each node trains in each step, so that no sample is lost when a node is.

The data is cut into *units*: ``(nominal step t, shard j)`` is shard ``j`` of ``nodes`` of
the global batch the data source gives for step ``t`` (``data.batch(t, batch_size)``), so
the units of nominal steps ``1 .. T`` are exactly the samples those steps would train.
In ring step ``s`` node slot ``i`` trains one unit; a step that closes without node ``i``
did not train its unit, which goes to the *backlog*. The next steps hand backlog units
(oldest first) to the nodes that contributed to the last close, then fresh units (the
next nominal ones) to the remaining slots. Every unit is trained exactly once, whatever
membership did: a dropped node's share is trained by the others one step later.

Every node computes the same assignment: it depends only on the closes, which every node
applies in order (:meth:`WorkQueue.close`). A node admitted later gets the queue's state
in its welcome.

Pure bookkeeping: literal lists in, literal lists out.
"""

from __future__ import annotations

__all__ = ["WorkQueue", "Unit"]

Unit = tuple[int, int]
"""``(nominal step, shard)``."""


class WorkQueue:
    """The ring's data assignment.

    Args:
        nodes: slots per step (``tokenring.nodes``; a unit is ``batch_size / nodes``).
        applied: the last step already accounted (0 for a new run).
    """

    def __init__(self, nodes: int, applied: int = 0):
        self.nodes = nodes
        self.step = applied
        """Last step whose close was applied."""
        self.fresh = applied * nodes
        """Fresh units handed out so far: unit ``u`` is ``(u // nodes + 1, u % nodes)``."""
        self.backlog: list[Unit] = []
        self.last: list[int] = list(range(nodes))
        """Contributors of the last close (they get the backlog first)."""
        self.trained = 0
        """Units trained since this queue started."""
        self._trained_before = self.fresh

    def assignment(self) -> list[Unit]:
        """The unit of every slot in step ``self.step + 1``."""
        first = sorted(i for i in self.last if i < self.nodes)
        order = first + [i for i in range(self.nodes) if i not in first]
        units: dict[int, Unit] = {}
        backlog = iter(self.backlog)
        fresh = self.fresh
        for slot in order:
            unit = next(backlog, None)
            if unit is None:
                unit = (fresh // self.nodes + 1, fresh % self.nodes)
                fresh += 1
            units[slot] = unit
        return [units[i] for i in range(self.nodes)]

    def close(self, step: int, contributors: list[int]) -> dict[int, Unit]:
        """Account ``step``, closed with ``contributors``; returns the unit each of them
        trained.

        Raises:
            ValueError: ``step`` is not the next one (closes must be applied in order).
        """
        if step != self.step + 1:
            raise ValueError(f"work queue at step {self.step} asked to close step {step}; "
                             f"closes must be applied in order")
        units = self.assignment()
        used = min(len(self.backlog), self.nodes)
        missed = [units[i] for i in range(self.nodes) if i not in contributors]
        self.fresh += self.nodes - used
        self.backlog = sorted(missed + self.backlog[used:])
        self.last = sorted(contributors)
        self.step = step
        trained = {i: units[i] for i in contributors if i < self.nodes}
        self.trained += len(trained)
        return trained

    def skipped(self) -> int:
        """Units handed out that were neither trained nor are waiting (0 unless a bug)."""
        return self.fresh - self.trained - len(self.backlog) - self._trained_before

    def to_json(self) -> dict:
        """Plain form (welcome headers, checkpoints)."""
        return {"nodes": self.nodes, "step": self.step, "fresh": self.fresh,
                "backlog": [list(u) for u in self.backlog], "last": self.last}

    @classmethod
    def from_json(cls, d: dict) -> WorkQueue:
        """Inverse of :meth:`to_json` (the units trained before are not known here)."""
        q = cls(d["nodes"], d["step"])
        q.fresh, q.last = d["fresh"], list(d["last"])
        q.backlog = [tuple(u) for u in d["backlog"]]
        q._trained_before = q.fresh - len(q.backlog)
        return q
