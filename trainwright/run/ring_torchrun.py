"""A token-ring node per process under torchrun (or SLURM): nodes on several hosts.

Every launched process is one node: its index and data shard are its ``RANK``, the node
count is ``WORLD_SIZE`` (``tokenring.nodes`` is set to it). The process with ``RANK`` 0
hosts the ring's rendezvous at ``tokenring.rendezvous`` (``tcp://HOST:PORT``, HOST an
address of rank 0's machine that the others reach); the others join it over the network.
Each node binds its own socket on the interface that routes to the rendezvous and
advertises that address. With an empty ``tokenring.rendezvous`` rank 0 binds a free port on
every interface and publishes ``tcp://MASTER_ADDR:PORT`` through torchrun's store.

The run directory is agreed through torchrun's store (rank 0 creates it) and should be on a
file system every host sees (each node writes its report there; the first node writes the
checkpoints and ``model.pt``).

A node the ring dropped that never exits (frozen) would keep its torchrun agent waiting:
every node publishes its process identity in the store, and a node that finishes ends the
dropped nodes of its own machine (same boot id, pid and process start time), so torchrun
returns (reporting that rank as failed). It does so once every surviving member has said
in the store that it finished (at most ``close_timeout_s``): torchrun stops every rank
when one is killed, so ending the frozen node earlier would stop a member still writing
its report.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

import zmq

from trainwright.config import Config
from trainwright.config.core import read_config
from trainwright.errors import ConfigError
from trainwright.run.ring_node import RingNode
from trainwright.run.worker import DistEnv, _agree_run_dir

__all__ = ["run_torchrun_node", "torchrun_config", "load_torchrun_config", "process_identity",
           "end_dropped_here"]

log = logging.getLogger(__name__)
RDZV_KEY = "tw/ring/rendezvous"
PROC_KEY = "tw/ring/proc/{}"
FINISHED_KEY = "tw/ring/finished/{}"


def process_identity(pid: int | str = "self") -> dict | None:
    """``{boot, pid, start}``: this machine's boot id, the pid and its start time (clock
    ticks since boot), which together name one process; None where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
    return {"boot": boot, "pid": int(stat.split()[0]), "start": int(fields[19])}


def end_dropped_here(store, node: RingNode) -> list[str]:
    """End the nodes this ring dropped that still run on this machine; what was done."""
    ring = node.rings[-1] if node.rings else None
    if ring is None:
        return []
    lost = {e["node"] for g in node.rings for e in g.stats.events if e.get("event") == "lost"}
    me, done = process_identity(), []
    here = {}
    for idx in sorted(lost - set(ring.epoch.members)):
        key = PROC_KEY.format(idx)
        if me is None or not store.check([key]):
            continue
        them = json.loads(store.get(key))
        if them["boot"] == me["boot"] and process_identity(them["pid"]) == them:
            here[idx] = them  # not another machine's, nor a process that is gone
    if here:
        members = [FINISHED_KEY.format(m) for m in ring.epoch.members]
        try:  # ending one stops every rank under torchrun: let the others finish first
            store.wait(members, timedelta(seconds=node.cfg.tokenring.close_timeout_s))
        except Exception as exc:  # a member died or hangs: end the dropped ones anyway
            log.warning("not every ring member said it finished (%s); ending the dropped "
                        "node(s) %s now", exc, sorted(here))
    for idx, them in here.items():
        if process_identity(them["pid"]) != them:
            continue
        try:
            os.kill(them["pid"], signal.SIGKILL)  # also ends a stopped process
        except ProcessLookupError:
            continue
        done.append(f"node {idx} was dropped by the ring and was still running (frozen or "
                    f"hung); ended it (pid {them['pid']}) with SIGKILL")
        log.warning("%s", done[-1])
    return done


def torchrun_config(cfg: Config, world_size: int) -> Config:
    """``cfg`` with ``tokenring.nodes = WORLD_SIZE`` (every launched process is a node).

    Raises:
        ConfigError: the batch does not split into that many shards, or ``min_nodes`` is
            more than the processes launched.
    """
    if cfg.tokenring.nodes == world_size:
        return cfg
    data = cfg.to_dict()
    data["tokenring"]["nodes"] = world_size
    try:
        return Config.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"under torchrun every process is a token-ring node, so "
                          f"tokenring.nodes = WORLD_SIZE = {world_size}: {exc}") from None


def load_torchrun_config(path, overrides: list[str]) -> Config:
    """:func:`~trainwright.config.load_config` for a process of a torchrun job: a token ring
    is validated with ``tokenring.nodes = WORLD_SIZE`` (one node per process); any other
    configuration is loaded as written. The file is read once and, when valid, validated
    once.

    Raises:
        ConfigError: as ``load_config``; a ring error says the node count came from torchrun.
    """
    world = int(os.environ["WORLD_SIZE"])
    data = read_config(path, overrides)
    sync, ring = data.get("sync"), data.get("tokenring", {})
    if not (isinstance(sync, dict) and sync.get("strategy") == "tokenring"
            and isinstance(ring, dict)):
        return Config.from_dict(data)  # another strategy (the default is "dense"): as written
    try:
        return Config.from_dict({**data, "tokenring": {**ring, "nodes": world}})
    except ConfigError as exc:
        Config.from_dict(data)  # an error of the config as written is reported as itself
        raise ConfigError(f"under torchrun every process is a token-ring node, so "
                          f"tokenring.nodes = WORLD_SIZE = {world}: {exc}") from None


def _rendezvous(cfg: Config, env: DistEnv, store) -> tuple[str, str]:
    """``(endpoint the nodes connect to, what rank 0 binds)``."""
    given = cfg.tokenring.rendezvous
    if given:
        return given, given
    if env.rank == 0:
        ctx = zmq.Context.instance()
        probe = ctx.socket(zmq.ROUTER)  # find a free port on every interface
        port = probe.bind_to_random_port("tcp://*")
        probe.close(0)
        endpoint = f"tcp://{env.master_addr}:{port}"
        store.set(RDZV_KEY, endpoint)
        return endpoint, f"tcp://*:{port}"
    return store.get(RDZV_KEY).decode(), ""


def run_torchrun_node(cfg: Config, resume_dir: Path | None) -> tuple[int, Path, bool]:
    """Be node ``RANK`` of a token ring spread over the torchrun job.

    Returns:
        The exit code, the run directory, and whether this node saved the model (the one
        node that announces the outputs).

    Args:
        cfg: the validated configuration (``tokenring.nodes`` is replaced by WORLD_SIZE).
        resume_dir: continue this run from its latest checkpoint (rank 0 loads it and sends
            the weights and optimizer state to the others).
    """
    env = DistEnv.from_env()
    cfg = torchrun_config(cfg, env.world_size)
    logging.basicConfig(level=logging.WARNING, format=f"[node {env.rank}] %(message)s",
                        force=True)
    timeout = cfg.tokenring.standby_timeout_s
    store = env.store(timeout, master=env.rank == 0 and not env.agent_store)
    if resume_dir is not None:
        run_dir = resume_dir
        if env.rank == 0:
            from trainwright.run.launch import create_run_dir
            create_run_dir(cfg, resume_dir)  # rewrites config.toml (nodes, steps)
    else:
        run_dir = _agree_run_dir(store, env, None, cfg)
    endpoint, bind = _rendezvous(cfg, env, store)
    if (me := process_identity()) is not None:
        store.set(PROC_KEY.format(env.rank), json.dumps(me))
    node = RingNode(cfg, run_dir, env.rank, endpoint, "host" if env.rank == 0 else "join",
                    resume=resume_dir is not None, bind=bind)
    code = node.run()
    try:
        store.set(FINISHED_KEY.format(env.rank), str(code))
    except Exception as exc:  # the store's host may be gone already
        log.warning("could not tell the store this node finished: %s", exc)
    if code == 0:
        try:
            end_dropped_here(store, node)
        except Exception as exc:  # the store's host may be gone already: nothing to end
            log.warning("could not look for dropped nodes on this host: %s", exc)
    saved = code == 0 and bool(node.rings) and node.index == node.rings[-1].epoch.first()
    return code, run_dir, saved
