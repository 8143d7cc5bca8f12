"""Per-step records of every rank to rank 0, without lining the ranks up each step.

A collective (``gather_object``) per step makes every rank wait for the slowest one at the
end of every step. In a pipeline the ranks end their steps at different times on purpose
(ZB-V: a rank that carries its last weight passes into the next step ends early and fills
its start-up wait with them); a gather at the end of the step undoes that, and it stalls
the critical rank for the others' transport threads.

So every other rank sends its record with a non-blocking send into a receive that rank 0
posted ahead, and rank 0 reads it one record later (:meth:`Mailbox.take`), when it has
long arrived. A record travels in one fixed-size slot (a length, then the pickled object);
a larger one sends the slot (holding only its length) and then the whole payload, which
rank 0 receives blocking. Rank 0 keeps one receive posted per rank until that rank's
:meth:`Mailbox.close` sends its end mark, so nothing is left posted at the end.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch

from trainwright.dist import collective as coll

__all__ = ["Mailbox"]

SLOT_BYTES = 1 << 16
"""One record's slot: 8 bytes of length, then the pickled record (most records: 1-3 kB)."""
IN_FLIGHT = 4
"""Sends a rank keeps unwaited; rank 0 reads each one record late, so it never waits."""
TAG = 7


class Mailbox:
    """Records of every rank to rank 0 over ``group`` (a gloo group of every rank).

    Every rank calls :meth:`post` once per record, in the same order; rank 0 reads them in
    that order with :meth:`take`. Call :meth:`close` on every rank when done.

    Args:
        group: a gloo process group over all ``world_size`` ranks.
        rank: this rank (global); ``world_size``: the ranks of the job.
    """

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world = group, rank, world_size
        self._sends: deque = deque()
        self._posted: dict[int, tuple[object, torch.Tensor]] = {}
        """Rank 0: source rank -> the receive posted for its next record."""
        if rank == 0:
            for src in range(1, world_size):
                self._post(src)

    def post(self, record) -> None:
        """Send this rank's ``record`` to rank 0 without waiting (rank 0 keeps its own)."""
        if self.rank != 0:
            self._send(record, end=False)

    def _send(self, record, end: bool) -> None:
        data = pickle.dumps((record, end), protocol=pickle.HIGHEST_PROTOCOL)
        slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
        slot[:8].view(torch.int64)[0] = len(data)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        tensors = [slot]
        if len(data) <= SLOT_BYTES - 8:
            slot[8 : 8 + len(data)] = payload
        else:
            tensors.append(payload)
        for t in tensors:
            self._sends.append((coll.isend(t, dst=0, group=self.group, tag=TAG), t))
        while len(self._sends) > IN_FLIGHT:
            self._sends.popleft()[0].wait()

    def take(self, src: int):
        """Rank 0: the next record of rank ``src`` (waits only if it has not come yet)."""
        if src not in self._posted:
            raise RuntimeError(f"rank {src} closed its mailbox stream; no record follows")
        work, slot = self._posted.pop(src)
        work.wait()
        n = int(slot[:8].view(torch.int64)[0])
        if n <= SLOT_BYTES - 8:
            data = slot[8 : 8 + n].numpy().tobytes()
        else:
            payload = torch.empty(n, dtype=torch.uint8)
            coll.recv(payload, src, group=self.group, tag=TAG)
            data = payload.numpy().tobytes()
        record, end = pickle.loads(data)
        if not end:
            self._post(src)
        return record

    def close(self) -> None:
        """Every rank: end the stream (an end mark, which rank 0 reads after any record it
        has not taken) and wait until every send has been received."""
        if self.rank == 0:
            for src in list(self._posted):
                while src in self._posted:
                    self.take(src)
            return
        self._send(None, end=True)
        while self._sends:
            self._sends.popleft()[0].wait()

    def _post(self, src: int) -> None:
        slot = torch.empty(SLOT_BYTES, dtype=torch.uint8)
        self._posted[src] = (coll.irecv(slot, src, group=self.group, tag=TAG), slot)
