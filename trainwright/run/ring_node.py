"""One token-ring node (``sync.strategy = "tokenring"``): plain data parallel without a barrier.

Every node holds the whole model and trains on shard ``index`` of each global batch. There
is no process group (a membership change would break it): nodes meet at a rendezvous,
the first node sends everyone its weights and optimizer state, and gradients travel through
:class:`~trainwright.tokenring.ring.TokenRing`. The local launcher is
:mod:`trainwright.run.ring_launch`; under torchrun every process is one node
(:mod:`trainwright.run.ring_torchrun`).

Each node writes ``node<index>.json`` (parameter hash after every applied step, steps it
contributed to, membership events, close times); the first node writes the checkpoints
(``run.checkpoint_every``, and the last step) and ``model.pt``. The hosting node also
writes ``metrics.jsonl``, the progress lines and ``report.html``
(:class:`~trainwright.run.records.NodeRecords`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch
import zmq
from torch import nn

from trainwright.config import Config, load_config
from trainwright.dist.topology import Topology
from trainwright.errors import CommError
from trainwright.model.text_data import read_share
from trainwright.observe.telemetry import atomic_write_text
from trainwright.run.records import NodeRecords
from trainwright.run.trainer import Trainer, TrainerOptions
from trainwright.tokenring.exchange import RingExchange, param_hash
from trainwright.tokenring.membership import Epoch, Rendezvous, join_rendezvous, local_address
from trainwright.tokenring.ring import RingFailed, RingLeft, RingTimes, Token, TokenRing
from trainwright.tokenring.state import restore, snapshot
from trainwright.tokenring.wire import wait_welcome

__all__ = ["param_hash", "node_main", "RingNode"]

log = logging.getLogger(__name__)
EXIT_RING_FAILED = 3
EXIT_NODE_ERROR = 4


def _times(cfg: Config) -> RingTimes:
    r = cfg.tokenring
    return RingTimes(token_timeout_s=r.token_timeout_s, succession_s=r.succession_s,
                     idle_hold_s=r.idle_hold_s, close_timeout_s=r.close_timeout_s,
                     close_grace_s=r.close_grace_s)


def traffic(rings: list[TokenRing], steps: int) -> dict:
    """Bytes this node sent and received (headers and tensors), and per applied step in
    units of one gradient: what ``bench straggler`` reports as the busiest node's load.
    Welcomes (weights and optimizer state for a joining node, once per join) are counted
    apart and left out of the sent bytes; the received side never sees them (a joiner
    reads its welcome before its ring starts)."""
    tensors = sum(g.links.tensor_bytes_sent for g in rings)
    sent = tensors + sum(g.links.header_bytes_sent for g in rings)
    received = sum(g.stats.bytes_received for g in rings)
    grad = max((g.grad_bytes for g in rings), default=0)
    per = (lambda b: round(b / steps / grad, 4)) if steps and grad else (lambda b: None)
    return {"bytes_sent": sent, "bytes_received": received, "grad_bytes": grad,
            "tensor_bytes_sent": tensors, "steps_applied": steps,
            "welcome_bytes_sent": sum(g.links.welcome_bytes_sent for g in rings),
            "bytes_sent_per_step_over_grad": per(sent),
            "tensor_bytes_sent_per_step_over_grad": per(tensors),
            "bytes_received_per_step_over_grad": per(received),
            "sums_rebuilt": sum(g.stats.rebuilt for g in rings),
            "running_sums_dropped": sum(g.stats.dropped_sums for g in rings)}


def _node_config(cfg: Config) -> Config:
    """The trainer's view of a node: the whole model as one stage, the node's shard as one
    micro-batch (``train.micro_batches`` is the pipeline's)."""
    data = cfg.to_dict()
    data["train"]["micro_batches"] = 1
    data["parallel"].update(pp=1, dp=1, partition=[])
    return Config.from_dict(data)


class WorkData:
    """The node's data source as the trainer sees it: step ``s`` reads the unit the work
    queue gives this node (:meth:`~trainwright.tokenring.exchange.RingExchange.unit_for`),
    so a dropped node's share is trained later by the others; everything else is the
    wrapped source's."""

    def __init__(self, data, exchange: RingExchange):
        self.data, self.exchange = data, exchange

    def share(self, step: int, batch_size: int, index: int, parts: int, inputs: bool,
              targets: bool):
        """Shard ``j`` of nominal step ``t``, the unit of ``(step, index)``."""
        nominal, shard = self.exchange.unit_for(step)
        return read_share(self.data, nominal, batch_size, shard, parts, inputs=inputs,
                          targets=targets)

    def __getattr__(self, name: str):
        return getattr(self.data, name)


class RingNode:
    """One node process: model, data shard, ring, and the training loop.

    Args:
        cfg: the run's configuration.
        run_dir: the run directory (reports, checkpoints, ``model.pt``).
        want: the node index asked for (a data shard; the rendezvous may grant another).
        endpoint: ``tcp://host:port`` of the rendezvous, as the other nodes reach it.
        role: ``"host"`` (binds the rendezvous and hosts formation) or ``"join"``.
        restarted: this process replaces a node killed by fault injection.
        resume: the host starts from the run directory's latest checkpoint.
        bind: what the host binds for the rendezvous (default: ``endpoint``).
    """

    def __init__(self, cfg: Config, run_dir: Path, want: int, endpoint: str, role: str,
                 restarted: bool = False, resume: bool = False, bind: str = ""):
        self.cfg, self.run_dir, self.want, self.endpoint, self.role = (cfg, run_dir, want,
                                                                       endpoint, role)
        self.bind = bind or endpoint
        torch.set_num_threads(max(1, cfg.parallel.threads_per_rank or 1))
        self.exchange = RingExchange(cfg.tokenring, want, restarted, on_applied=self._checkpoint)
        self.trainer = Trainer(_node_config(cfg), run_dir, resume=resume and role == "host",
                               options=TrainerOptions(
                                   mesh=Topology(pp=1, dp=1, rank=0), grad_sync=self.exchange,
                                   shard=(want, cfg.tokenring.nodes), outputs=False))
        self.params = self.trainer.stage.parameters()
        # the host reports the run as a pipeline's rank 0 does: metrics, progress, report
        # (its FLOP count reads a batch of the plain data, before the work queue wraps it)
        self.records = (NodeRecords(cfg, run_dir, self.trainer)
                        if role == "host" and not restarted else None)
        self.trainer.data = WorkData(self.trainer.data, self.exchange)
        self._work: dict | None = None
        """The data assignment's state from the welcome (None: a new run's)."""
        self.ctx = zmq.Context()
        self.index = want
        self.joined: list[dict] = []
        self.rings: list[TokenRing] = []
        self.restarted = restarted
        self.addr = ""

    # ------------------------------------------------------------ joining
    def _bind(self) -> tuple[zmq.Socket, str]:
        pull = self.ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)  # unlimited: never drop
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(f"tcp://{local_address(self.endpoint)}:*")  # the interface the others reach
        self.addr = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        return pull, self.addr

    def _ring(self, pull, epoch, **kw) -> TokenRing:
        r = self.cfg.tokenring
        ring = TokenRing(self.ctx, self.index, pull, epoch, close_fraction=r.close_fraction,
                         min_nodes=r.min_nodes, total_steps=self.cfg.train.steps,
                         times=_times(self.cfg), **kw)
        self.rings.append(ring)
        return ring

    def form(self) -> tuple[TokenRing, int]:
        """Host or join formation; returns the running ring and the last applied step."""
        r = self.cfg.tokenring
        pull, addr = self._bind()
        if self.role == "host":
            applied = self.trainer.start - 1  # > 0 after a resume
            try:
                rdzv = Rendezvous(self.ctx, self.bind, r.nodes, r.formation_quiet_s)
            except zmq.ZMQError as exc:
                raise CommError(f"token ring rendezvous {self.bind}: cannot bind it on this "
                                f"host ({exc}); tokenring.rendezvous must be a free port at an "
                                f"address of the first node's host (under torchrun: RANK 0's)"
                                ) from None
            members = rdzv.form(self.want, addr, r.min_nodes, r.standby_timeout_s)
            ring = self._ring(pull, Epoch((0, self.want), members), rendezvous=rdzv,
                              token=Token(applied + 1, [], min(members), 0), applied=applied)
            tensors, skeleton = snapshot(self.trainer.stage.slots)
            for i, a in members.items():  # the node holding the model broadcasts it
                if i != self.index:
                    ring.send_welcome(i, a, applied, tensors, {"state": skeleton})
            ring.start()
            self.joined.append({"as": "host", "applied": applied, "t": time.time()})
            return ring, applied
        res = join_rendezvous(self.ctx, self.endpoint, self.want, addr, r.standby_timeout_s)
        self.index = res.index
        return self._welcomed(pull, standby=res.standby)

    def _welcomed(self, pull, standby: bool) -> tuple[TokenRing, int]:
        r = self.cfg.tokenring
        h, weights, early = wait_welcome(pull, r.standby_timeout_s)
        restore(self.trainer.stage.slots, weights, h.get("state"))
        self._work = h.get("work")
        closes = {int(s): c for s, c in h["closes"].items()}
        ring = self._ring(pull, Epoch.from_json(h["ep"]), closes=closes, applied=h["applied"],
                          early=early)
        ring.expect_from(h["src"], h["inc"], h["sq"])
        ring.start()
        self.joined.append({"as": "standby" if standby else "member", "applied": h["applied"],
                            "t": time.time()})
        if standby:
            log.warning("node %d rejoined the ring after step %d", self.index, h["applied"])
        return ring, h["applied"]

    def rejoin(self) -> tuple[TokenRing, int]:
        """Dropped from the ring: keep index and model, wait as standby, rejoin."""
        pull, addr = self._bind()
        res = join_rendezvous(self.ctx, self.endpoint, self.index,
                              addr, self.cfg.tokenring.standby_timeout_s)
        self.index = res.index
        return self._welcomed(pull, standby=True)

    # ------------------------------------------------------------ training
    def train(self, ring: TokenRing, applied: int) -> int:
        """Run steps ``applied+1 .. train.steps`` through the trainer; returns the last
        applied step."""
        self.exchange.index = self.index
        self.trainer.shard = (self.index, self.cfg.tokenring.nodes)
        self.exchange.use(ring, applied, self._work)
        self.trainer.fit(start=applied + 1,
                         on_step=self.records.step if self.records is not None else None)
        return self.exchange.last_applied

    # ------------------------------------------------------------ outputs
    def _checkpoint(self, step: int, slots: list) -> None:
        """The first node writes the run's checkpoint after ``run.checkpoint_every`` steps
        and the last one (the trainer's format: ``--resume`` and ``load_model`` read it)."""
        every, ring = self.cfg.run.checkpoint_every, self.exchange.ring
        if ring.epoch.first() != self.index:
            return
        if step == self.cfg.train.steps or (every and step % every == 0):
            self.trainer.save_checkpoint(step)

    def save_model(self) -> Path:
        """Write ``model.pt`` (the whole model's state dict) atomically."""
        path = self.run_dir / "model.pt"
        tmp = path.with_name(f".model.pt.tmp{os.getpid()}")
        model = nn.Sequential(*[slot.module for slot in self.trainer.stage.slots])
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
        if self.exchange.snapshots:  # tokenring.record_weights
            torch.save(self.exchange.snapshots, self.run_dir / "weights_per_step.pt")
        return path

    def write_stats(self, status: str, reason: str = "") -> None:
        """Write ``node<index>[-restart].json``."""
        rings = self.rings
        closes, times = {}, {}
        for ring in rings:
            closes.update(ring.closes)
            times.update(ring.close_time)
        row = {"index": self.index, "status": status, "reason": reason,
               "restarted": self.restarted, "joined": self.joined,
               "hashes": {str(k): v for k, v in self.exchange.hashes.items()},
               "contributed": sorted({s for g in rings for s in g.stats.contributed}),
               "events": [e for g in rings for e in g.stats.events],
               "closes": {str(k): v for k, v in sorted(closes.items())},
               "close_time": {str(k): v for k, v in sorted(times.items())},
               "step_start": {str(k): v for k, v in self.exchange.step_start.items()},
               "applied_time": {str(k): v for k, v in self.exchange.applied_time.items()},
               "gaps": sum(g.stats.gaps for g in rings),
               "fetches": sum(g.stats.fetches for g in rings),
               "retransmissions": sum(g.stats.retransmissions for g in rings),
               **traffic(rings, self.exchange.steps_applied),
               "shard_samples": self.cfg.train.batch_size // self.cfg.tokenring.nodes,
               **self._samples(),
               "members": rings[-1].epoch.order if rings else [],
               "addr": self.addr, "host": socket.gethostname(), "pid": os.getpid()}
        name = f"node{self.index}{'-restart' if self.restarted else ''}.json"
        atomic_write_text(self.run_dir / name, json.dumps(row) + "\n")

    def _samples(self) -> dict:
        """Samples this node trained, samples skipped (handed out, neither trained nor
        waiting: 0) and waiting in the backlog when the run ended; the first node adds every
        contributor's unit per step (``[nominal step, shard]``)."""
        ex, shard = self.exchange, self.cfg.train.batch_size // self.cfg.tokenring.nodes
        mine = sum(self.index in units for units in ex.trained_units.values())
        out = {"samples_trained": mine * shard,
               "samples_skipped": None if ex.work is None else ex.work.skipped() * shard,
               "samples_pending": None if ex.work is None else len(ex.work.backlog) * shard,
               "read_units": {str(s): list(u) for s, u in ex.read_units.items()}}
        if self.rings and self.rings[-1].epoch.first() == self.index:
            out["trained_units"] = {str(s): {str(c): list(u) for c, u in units.items()}
                                    for s, units in ex.trained_units.items()}
        return out

    def run(self) -> int:
        """The node's whole life; returns its exit code."""
        r = self.cfg.tokenring
        ring = None
        try:
            ring, applied = self.form()
            while True:
                try:
                    applied = self.train(ring, applied)
                    break
                except RingLeft as exc:
                    if ring.rdzv is not None:
                        raise CommError(f"node {self.index} hosts the rendezvous and was "
                                        f"dropped from the ring ({exc})") from None
                    log.warning("node %d left the ring (%s); waiting as standby", self.index,
                                exc)
                    ring.stop()
                    ring, applied = self.rejoin()
            ring.finish(linger_s=2 * r.token_timeout_s + 1)
            first = ring.epoch.first() == self.index
            ring.stop()
            if first:
                self.save_model()
            if self.records is not None:
                self.records.finish()
            self.write_stats("done")
            return 0
        except RingFailed as exc:
            msg = str(exc)
            if ring is not None and ring.epoch.first() == self.index:
                msg += f"; model (after step {self.exchange.last_applied}) saved to " \
                       f"{self.save_model()}"
            log.error("node %d: %s", self.index, msg)
            self.write_stats("failed", msg)
            return EXIT_RING_FAILED
        except CommError as exc:
            log.error("node %d: %s", self.index, exc)
            self.write_stats("error", str(exc))
            return EXIT_NODE_ERROR
        except Exception as exc:  # a bug or bad input: say what, so the launcher can tell
            log.exception("node %d failed", self.index)
            self.write_stats("error", f"{type(exc).__name__}: {str(exc)[:300]}")
            return EXIT_NODE_ERROR
        finally:
            if ring is not None:
                ring.stop()
            if ring is not None and ring.rdzv is not None:
                ring.rdzv.close()
            self.ctx.destroy(0)


def node_main(argv: list[str]) -> int:
    """One node: ``RUN_DIR INDEX ENDPOINT ROLE [--resume]`` (host | join | rejoin, rejoin =
    restarted)."""
    run_dir, want, endpoint, role = Path(argv[0]), int(argv[1]), argv[2], argv[3]
    logging.basicConfig(level=logging.WARNING, format=f"[node {want}] %(message)s", force=True)
    cfg = load_config(run_dir / "config.toml")
    node = RingNode(cfg, run_dir, want, endpoint, "join" if role == "rejoin" else role,
                    restarted=role == "rejoin", resume="--resume" in argv[4:])
    return node.run()



if __name__ == "__main__":
    raise SystemExit(node_main(sys.argv[1:]))
