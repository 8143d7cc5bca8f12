"""The local token-ring launcher: ``tokenring.nodes`` node processes on this host.

The nodes are forked from one helper process (the *zygote*) that imported torch once, so
start-up and restarts are quick. With ``tokenring.restart_killed`` a node killed by fault
injection is started again as standby. A node the ring dropped that never exits (frozen by
``SIGSTOP``, hung) is ended once every remaining member has finished, and the result names
it: the command never waits for a node the ring no longer has.
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
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainwright.config import Config

__all__ = ["launch_ring", "RingResult", "zygote_main"]

log = logging.getLogger(__name__)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _tell_launcher(line: str) -> None:
    """One protocol line on stdout, the pipe the launcher reads (not output for people)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _fork_node(run_dir: str, endpoint: str, index: str, role: str, resume: bool) -> int:
    from trainwright.run.ring_node import node_main

    pid = os.fork()
    if pid == 0:  # the node
        code = 1
        try:
            code = node_main([run_dir, index, endpoint, role] + (["--resume"] if resume else []))
        except BaseException:  # os._exit below would swallow the traceback
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def zygote_main(argv: list[str]) -> int:
    """Fork node processes on request, so torch is imported once, not once per node.

    Reads ``start KEY INDEX ROLE`` / ``kill [KEY]`` lines on stdin (``kill`` alone: every
    node), writes ``exit KEY CODE`` lines on stdout (CODE < 0: killed by that signal). Forks
    before any thread or ZeroMQ context exists here, which keeps the children sound. Ends
    when stdin closes and every child exited.
    """
    run_dir, endpoint, *flags = argv
    from trainwright.run import ring_node  # noqa: F401 - imported once, before forking

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
            words = line.split()
            if words and words[0] == "start":
                _, key, index, role = words
                children[_fork_node(run_dir, endpoint, index, role, "--resume" in flags)] = key
            elif words and words[0] == "kill":
                for pid, key in children.items():
                    if len(words) == 1 or key == words[1]:
                        os.kill(pid, signal.SIGKILL)  # also ends a stopped process
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _tell_launcher(f"exit {children.pop(pid)} {_exit_code(status)}")
    return 0


@dataclass
class RingResult:
    """Exit codes of the node processes (a restart is ``"2r"``), the nodes' reports, and the
    nodes the ring dropped (key -> what happened to them)."""

    run_dir: Path
    returncodes: dict[str, int]
    reports: dict[str, dict]
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every node that stayed in the ring exited 0 (nodes the ring dropped,
        killed-and-restarted ones included, do not fail the run; :meth:`warnings` names them)."""
        return bool(self.returncodes) and all(
            c == 0 for k, c in self.returncodes.items()
            if k not in self.dropped
            and not (c == -signal.SIGKILL and f"{k}r" in self.returncodes))

    def message(self) -> str:
        """What went wrong, from the nodes' own reports (or their exit codes)."""
        reasons = [f"node {k}: {rep['reason']}" for k, rep in self.reports.items()
                   if rep.get("reason")]
        dead = [f"node {k} was killed by {signal.Signals(-c).name}" if c < 0 else
                f"node {k} exited with code {c}" for k, c in self.returncodes.items()
                if c and k not in self.dropped]
        return "; ".join(reasons + dead + self.warnings())

    def warnings(self) -> list[str]:
        """One line per node the ring dropped."""
        return [f"node {k} {what}" for k, what in self.dropped.items()]


class _Zygote:
    """The launcher's end of the zygote's pipes."""

    def __init__(self, run_dir: Path, endpoint: str, resume: bool):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainwright.run.ring_launch", "zygote", str(run_dir),
             endpoint] + (["--resume"] if resume else []),
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.out, self.pending = self.proc.stdout.fileno(), b""

    def say(self, line: str) -> None:
        """Send one command line (``start ...`` / ``kill [KEY]``)."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def exits(self, block: bool) -> list[tuple[str, int]] | None:
        """``(key, code)`` lines from the zygote (None at its end); unbuffered reads."""
        if not block and not select.select([self.out], [], [], 0.05)[0]:
            return []
        chunk = os.read(self.out, 65536)
        if not chunk:
            return None
        *done, self.pending = (self.pending + chunk).split(b"\n")
        return [(w[1], int(w[2])) for w in (x.decode().split() for x in done)
                if len(w) == 3 and w[0] == "exit"]

    def close(self, codes: dict[str, int]) -> None:
        """Close stdin, collect the remaining exits, wait for the zygote."""
        self.proc.stdin.close()
        try:
            while (got := self.exits(block=True)) is not None:
                codes.update(got)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _report(run_dir: Path, key: str) -> dict | None:
    name = f"node{key.removesuffix('r')}{'-restart' if key.endswith('r') else ''}.json"
    try:
        return json.loads((run_dir / name).read_text())
    except (OSError, ValueError):
        return None


def _lost_events(reports: list[dict]) -> dict[int, dict]:
    return {e["node"]: e for rep in reports for e in rep.get("events", [])
            if e.get("event") == "lost"}


def _finished(run_dir: Path, codes: dict[str, int]) -> list[dict]:
    """Reports of the nodes that finished the run (exit 0, status ``done``)."""
    return [rep for k, c in codes.items() if c == 0
            and (rep := _report(run_dir, k)) is not None and rep.get("status") == "done"]


def _stragglers(done: list[dict], running: set[str], late: bool) -> dict[str, str]:
    """Nodes still running after the ring finished, and what to say about each: those the
    ring dropped as soon as every member of its last membership exited; with ``late`` (the
    grace after the first node finished is over) every one."""
    final = {i for rep in done for i in rep.get("members", [])}
    if not done or not running or (
            not late and any(int(k.removesuffix("r")) in final for k in running)):
        return {}
    lost = _lost_events(done)
    out = {}
    for k in sorted(running):
        e = lost.get(int(k.removesuffix("r")))
        why = (f"was dropped by the ring (silent for {e['quiet_s']:.1f} s; members then "
               f"{e['members']})" if e else "did not finish with the others")
        out[k] = f"{why} and was still running (frozen or hung); ended it with SIGKILL"
    return out


def launch_ring(cfg: Config, run_dir: Path, timeout_s: float | None = None,
                resume: bool = False) -> RingResult:
    """Start ``tokenring.nodes`` local node processes and wait for them.

    Args:
        cfg: validated configuration, already written to ``run_dir/config.toml``.
        run_dir: the run directory (node reports, checkpoints and ``model.pt`` go there).
        timeout_s: overall deadline; nodes still running then are killed.
        resume: node 0 starts from the run directory's latest checkpoint and sends its
            weights and optimizer state to the others.
    """
    from trainwright.dist.ports import free_port

    r = cfg.tokenring
    for old in run_dir.glob("node*.json"):  # a resumed run: reports are this run's only
        old.unlink()
    endpoint = r.rendezvous or f"tcp://127.0.0.1:{free_port()}"
    zygote = _Zygote(run_dir, endpoint, resume)
    for i in range(r.nodes):
        zygote.say(f"start {i} {i} {'host' if i == 0 else 'join'}")
    running = {str(i) for i in range(r.nodes)}
    codes: dict[str, int] = {}
    dropped: dict[str, str] = {}
    grace = 3 * (r.token_timeout_s + r.nodes * r.succession_s) + 15
    end = time.monotonic() + (timeout_s or 1e9)
    failed_at, over_at, killed = None, None, False
    try:
        while running:
            got = zygote.exits(block=False)
            if got is None:
                break
            for key, code in got:
                running.discard(key)
                codes[key] = code
                if (r.restart_killed and code == -signal.SIGKILL and not key.endswith("r")
                        and int(key) in r.kill_nodes and key not in dropped):
                    zygote.say(f"start {key}r {key} rejoin")
                    running.add(f"{key}r")
                elif code not in (0, -signal.SIGKILL) and failed_at is None:
                    failed_at = time.monotonic()
            done = _finished(run_dir, codes) if running - set(dropped) else []
            if done and over_at is None:
                over_at = time.monotonic()
            late = over_at is not None and time.monotonic() - over_at > grace
            for key, what in _stragglers(done, running - set(dropped), late).items():
                log.warning("node %s %s", key, what)
                dropped[key] = what
                zygote.say(f"kill {key}")
            now = time.monotonic()
            if not killed and (now > end or (failed_at is not None and now - failed_at > grace)):
                zygote.say("kill")
                killed = True
    finally:
        if running and not killed:  # interrupted: leave no node behind
            zygote.proc.stdin.write("kill\n")
        zygote.close(codes)
    reports = {}
    for path in sorted(run_dir.glob("node*.json")):
        key = path.stem.removeprefix("node").replace("-restart", "r")
        reports[key] = json.loads(path.read_text())
    lost = _lost_events(list(reports.values()))
    for key, code in codes.items():  # killed nodes the ring dropped and nobody restarted
        if (code == -signal.SIGKILL and key not in dropped and f"{key}r" not in codes
                and int(key.removesuffix("r")) in lost and not killed):
            dropped[key] = "was killed by SIGKILL and dropped by the ring"
    return RingResult(run_dir, codes, reports, dropped)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        raise SystemExit(zygote_main(sys.argv[2:]))
    raise SystemExit(f"usage: python -m {__spec__.name} zygote RUN_DIR ENDPOINT [--resume]")
