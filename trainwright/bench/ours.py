"""Run trainwright as one rank of a benchmark, under the same spawn harness as the peers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainwright.bench import peers
from trainwright.config import Config
from trainwright.dist import collective as coll

__all__ = ["RunRecords", "train_rank"]


@dataclass
class RunRecords:
    """What one benchmark run of trainwright left in its run directory."""

    run_dir: Path
    rows: list[dict]
    """Every metrics.jsonl row."""

    @property
    def steps(self) -> list[dict]:
        """The ``step`` rows."""
        return [r for r in self.rows if r["kind"] == "step"]

    def step_times_s(self) -> list[float]:
        """Wall time between consecutive step ends on rank 0 (everything included)."""
        start = next(r for r in self.rows if r["kind"] == "run")["time_started"]
        ends = [start] + [r["time"] for r in self.steps]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def train_rank(rank: int, world_size: int, master_port: int, threads: int,
               make_config: Callable[[Path], Config], out_path: str) -> RunRecords:
    """Join the benchmark's process group, train, and read the run's metrics back.

    Args:
        rank, world_size, master_port: as for every peer worker.
        threads: intra-op threads of this rank.
        make_config: run directory -> configuration of the run.
        out_path: this rank's result file; the run directory (shared by the ranks) is
            created next to it.
    """
    from trainwright.run.trainer import Trainer

    torch.set_num_threads(threads)
    peers.init_process_group(rank, world_size, master_port)
    run_dir = Path(out_path).parent / "trainwright_run"
    try:
        cfg = make_config(run_dir)
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
        coll.barrier()
        Trainer(cfg, run_dir).fit()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return RunRecords(run_dir, rows)
    finally:
        dist.destroy_process_group()
