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
rank 0 receives blocking. Each message says whether another follows, so rank 0 posts a
receive only where one will come, and nothing is left posted at the end.
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
        self._more = True
        """Rank 0 may still expect a record of this rank (it posts a receive for each rank
        at the start): :meth:`close` then sends an empty last one."""
        self._posted: dict[int, tuple[object, torch.Tensor]] = {}
        """Rank 0: source rank -> the receive posted for its next record."""
        if rank == 0:
            for src in range(1, world_size):
                self._post(src)

    def post(self, record, more: bool) -> None:
        """Send this rank's ``record`` to rank 0 without waiting (rank 0 keeps its own);
        ``more``: another record follows from this rank."""
        if self.rank == 0:
            return
        data = pickle.dumps((record, more), protocol=pickle.HIGHEST_PROTOCOL)
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
        self._more = more

    def take(self, src: int):
        """Rank 0: the next record of rank ``src`` (waits only if it has not come yet)."""
        if src not in self._posted:  # its last record said none follows; one came anyway
            self._post(src)
        work, slot = self._posted.pop(src)
        work.wait()
        n = int(slot[:8].view(torch.int64)[0])
        if n <= SLOT_BYTES - 8:
            data = slot[8 : 8 + n].numpy().tobytes()
        else:
            payload = torch.empty(n, dtype=torch.uint8)
            coll.recv(payload, src, group=self.group, tag=TAG)
            data = payload.numpy().tobytes()
        record, more = pickle.loads(data)
        if more:
            self._post(src)
        return record

    def close(self) -> None:
        """Every rank: end the stream (a last empty record if the last one promised more;
        rank 0 reads those) and wait until every send has been received."""
        if self.rank == 0:
            for src in list(self._posted):
                while src in self._posted:
                    self.take(src)
            return
        if self._more:
            self.post(None, more=False)
        while self._sends:
            self._sends.popleft()[0].wait()

    def _post(self, src: int) -> None:
        slot = torch.empty(SLOT_BYTES, dtype=torch.uint8)
        self._posted[src] = (coll.irecv(slot, src, group=self.group, tag=TAG), slot)
