"""``trainwright run`` with ``sync.strategy = "tokenring"``: plain data parallel over ring nodes.

Every node holds the whole model and trains on shard ``index`` of each global batch. There
is no process group (a membership change would break it): nodes meet at a rendezvous,
the first node sends everyone its weights, and gradients travel through
:class:`~trainwright.tokenring.ring.TokenRing`. :func:`launch_ring` starts the local node
processes (forked from one helper that imported torch once) and, with
``tokenring.restart_killed``, restarts nodes killed by fault injection as standby.

Each node writes ``node<index>.json`` (parameter hash after every applied step, steps it
contributed to, membership events, close times); the first node saves ``model.pt``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
from torch import nn

from trainwright.config import Config, load_config
from trainwright.dist.topology import Topology
from trainwright.errors import CommError
from trainwright.observe.telemetry import atomic_write_text
from trainwright.run.trainer import Trainer
from trainwright.tokenring.exchange import RingExchange, param_hash
from trainwright.tokenring.membership import Epoch, Rendezvous, join_rendezvous
from trainwright.tokenring.ring import RingFailed, RingLeft, RingTimes, Token, TokenRing
from trainwright.tokenring.wire import wait_welcome

__all__ = ["launch_ring", "RingResult", "param_hash", "node_main"]

log = logging.getLogger(__name__)
EXIT_RING_FAILED = 3
EXIT_NODE_ERROR = 4


def _times(cfg: Config) -> RingTimes:
    r = cfg.tokenring
    return RingTimes(token_timeout_s=r.token_timeout_s, succession_s=r.succession_s,
                     idle_hold_s=r.idle_hold_s, close_timeout_s=r.close_timeout_s,
                     close_grace_s=r.close_grace_s)


def _node_config(cfg: Config) -> Config:
    """The trainer's view of a node: the whole model as one stage, the node's shard as one
    micro-batch (``train.micro_batches`` is the pipeline's)."""
    data = cfg.to_dict()
    data["train"]["micro_batches"] = 1
    data["parallel"].update(pp=1, dp=1, partition=[])
    return Config.from_dict(data)


class _Node:
    """One node process: model, data shard, ring, and the training loop."""

    def __init__(self, cfg: Config, run_dir: Path, want: int, endpoint: str, role: str,
                 restarted: bool = False):
        self.cfg, self.run_dir, self.want, self.endpoint, self.role = (cfg, run_dir, want,
                                                                       endpoint, role)
        torch.set_num_threads(max(1, cfg.parallel.threads_per_rank or 1))
        self.exchange = RingExchange(cfg.tokenring, want, restarted)
        self.trainer = Trainer(_node_config(cfg), run_dir, mesh=Topology(pp=1, dp=1, rank=0),
                               grad_sync=self.exchange, shard=(want, cfg.tokenring.nodes),
                               outputs=False)
        self.params = self.trainer.stage.parameters()
        self.ctx = zmq.Context()
        self.index = want
        self.joined: list[dict] = []
        self.rings: list[TokenRing] = []
        self.restarted = restarted

    # ------------------------------------------------------------ joining
    def _bind(self) -> tuple[zmq.Socket, str]:
        pull = self.ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)  # unlimited: never drop
        pull.setsockopt(zmq.LINGER, 0)
        host = self.endpoint.split("//", 1)[1].rsplit(":", 1)[0]
        pull.bind(f"tcp://{host}:*")
        return pull, pull.getsockopt(zmq.LAST_ENDPOINT).decode()

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
            rdzv = Rendezvous(self.ctx, self.endpoint, r.nodes, r.formation_quiet_s)
            members = rdzv.form(self.want, addr, r.min_nodes, r.standby_timeout_s)
            ring = self._ring(pull, Epoch((0, self.want), members), rendezvous=rdzv,
                              token=Token(1, [], min(members), 0))
            for i, a in members.items():  # the node holding the model broadcasts it
                if i != self.index:
                    ring.send_welcome(i, a, 0, self.params)
            ring.start()
            self.joined.append({"as": "host", "applied": 0, "t": time.time()})
            return ring, 0
        res = join_rendezvous(self.ctx, self.endpoint, self.want, addr, r.standby_timeout_s)
        self.index = res.index
        return self._welcomed(pull, standby=res.standby)

    def _welcomed(self, pull, standby: bool) -> tuple[TokenRing, int]:
        r = self.cfg.tokenring
        h, weights, early = wait_welcome(pull, r.standby_timeout_s)
        with torch.no_grad():
            for p, w in zip(self.params, weights, strict=True):
                p.copy_(w)
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
        self.exchange.use(ring, applied)
        self.trainer.fit(start=applied + 1)
        return self.exchange.last_applied

    # ------------------------------------------------------------ outputs
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
               "shard_samples": self.cfg.train.batch_size // self.cfg.tokenring.nodes}
        name = f"node{self.index}{'-restart' if self.restarted else ''}.json"
        atomic_write_text(self.run_dir / name, json.dumps(row) + "\n")

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
        finally:
            if ring is not None:
                ring.stop()
            if ring is not None and ring.rdzv is not None:
                ring.rdzv.close()
            self.ctx.destroy(0)


def node_main(argv: list[str]) -> int:
    """One node: ``RUN_DIR INDEX ENDPOINT ROLE`` (host | join | rejoin, rejoin = restarted)."""
    run_dir, want, endpoint, role = Path(argv[0]), int(argv[1]), argv[2], argv[3]
    logging.basicConfig(level=logging.WARNING, format=f"[node {want}] %(message)s", force=True)
    cfg = load_config(run_dir / "config.toml")
    node = _Node(cfg, run_dir, want, endpoint, "join" if role == "rejoin" else role,
                 restarted=role == "rejoin")
    return node.run()


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _tell_launcher(line: str) -> None:
    """One protocol line on stdout, the pipe the launcher reads (not output for people)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def zygote_main(argv: list[str]) -> int:
    """Fork node processes on request, so torch is imported once, not once per node.

    Reads ``start KEY INDEX ROLE`` / ``kill`` lines on stdin, writes ``exit KEY CODE`` lines
    on stdout (CODE < 0: killed by that signal). Forks before any thread or ZeroMQ context
    exists here, which keeps the children sound. Ends when stdin closes and every child exited.
    """
    run_dir, endpoint = argv
    # a process's first optimizer imports torch._dynamo (4-5 s here): pay it once, before
    # forking, or a restarted node arrives after the ring has moved on
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    children: dict[int, str] = {}
    open_in, pending, fd = True, b"", sys.stdin.fileno()
    while open_in or children:
        lines: list[str] = []
        if open_in and select.select([fd], [], [], 0.02)[0]:
            chunk = os.read(fd, 65536)  # unbuffered: select and the reads must agree
            open_in = bool(chunk)
            *done, pending = (pending + chunk).split(b"\n")
            lines = [x.decode() for x in done]
        elif not open_in:
            time.sleep(0.02)
        for line in lines:
            if line.startswith("start"):
                _, key, index, role = line.split()
                pid = os.fork()
                if pid == 0:  # the node
                    code = 1
                    try:
                        code = node_main([run_dir, index, endpoint, role])
                    finally:
                        sys.stderr.flush()
                        os._exit(code)
                children[pid] = key
            elif line.startswith("kill"):
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _tell_launcher(f"exit {children.pop(pid)} {_exit_code(status)}")
    return 0


@dataclass
class RingResult:
    """Exit codes of the node processes (a restart is ``"2r"``) and the nodes' reports."""

    run_dir: Path
    returncodes: dict[str, int]
    reports: dict[str, dict]

    @property
    def ok(self) -> bool:
        """True when every node that ran to the end exited 0 (killed-and-restarted excluded)."""
        return all(c == 0 for k, c in self.returncodes.items()
                   if not (c == -signal.SIGKILL and f"{k}r" in self.returncodes))

    def message(self) -> str:
        """What went wrong, from the nodes' own reports (or their exit codes)."""
        reasons = [f"node {k}: {rep['reason']}" for k, rep in self.reports.items()
                   if rep.get("reason")]
        dead = [f"node {k} was killed by {signal.Signals(-c).name}" if c < 0 else
                f"node {k} exited with code {c}" for k, c in self.returncodes.items() if c]
        return "; ".join(reasons + dead)


def launch_ring(cfg: Config, run_dir: Path, timeout_s: float | None = None) -> RingResult:
    """Start ``tokenring.nodes`` local node processes and wait for them.

    The nodes are forked from one helper process that imported torch once. With
    ``tokenring.restart_killed`` a node killed by fault injection is started again (a new
    process, keeping its index), which joins as standby.

    Args:
        cfg: validated configuration, already written to ``run_dir/config.toml``.
        run_dir: the run directory (node reports and ``model.pt`` go there).
        timeout_s: overall deadline; nodes still running then are killed.
    """
    from trainwright.dist.ports import free_port

    r = cfg.tokenring
    endpoint = r.rendezvous or f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    zygote = subprocess.Popen([sys.executable, "-m", "trainwright.run.ring_node", "zygote",
                               str(run_dir), endpoint], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def start(key: str, index: int, role: str) -> None:
        zygote.stdin.write(f"start {key} {index} {role}\n")
        zygote.stdin.flush()

    for i in range(r.nodes):
        start(str(i), i, "host" if i == 0 else "join")
    running = {str(i) for i in range(r.nodes)}
    codes: dict[str, int] = {}
    grace = 3 * (r.token_timeout_s + r.nodes * r.succession_s) + 15
    end = time.monotonic() + (timeout_s or 1e9)
    failed_at, killed = None, False
    out, pending = zygote.stdout.fileno(), b""

    def exits(block: bool) -> list[tuple[str, int]] | None:
        """``(key, code)`` lines from the zygote (None at its end); unbuffered reads."""
        nonlocal pending
        if not block and not select.select([out], [], [], 0.05)[0]:
            return []
        chunk = os.read(out, 65536)
        if not chunk:
            return None
        *done, pending = (pending + chunk).split(b"\n")
        return [(w[1], int(w[2])) for w in (x.decode().split() for x in done)
                if len(w) == 3 and w[0] == "exit"]

    try:
        while running:
            got = exits(block=False)
            if got is None:
                break
            for key, code in got:
                running.discard(key)
                codes[key] = code
                restart = (r.restart_killed and codes[key] == -signal.SIGKILL
                           and not key.endswith("r") and int(key) in r.kill_nodes)
                if restart:
                    start(f"{key}r", int(key), "rejoin")
                    running.add(f"{key}r")
                elif codes[key] not in (0, -signal.SIGKILL) and failed_at is None:
                    failed_at = time.monotonic()
            now = time.monotonic()
            if not killed and (now > end or (failed_at is not None and now - failed_at > grace)):
                zygote.stdin.write("kill\n")
                zygote.stdin.flush()
                killed = True
    finally:
        if running and not killed:  # interrupted: leave no node behind
            zygote.stdin.write("kill\n")
        zygote.stdin.close()
        try:
            while (got := exits(block=True)) is not None:
                codes.update(got)
            zygote.wait(30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()
    reports = {}
    for path in sorted(run_dir.glob("node*.json")):
        key = path.stem.removeprefix("node").replace("-restart", "r")
        reports[key] = json.loads(path.read_text())
    return RingResult(run_dir, codes, reports)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        raise SystemExit(zygote_main(sys.argv[2:]))
    raise SystemExit(node_main(sys.argv[1:]))
