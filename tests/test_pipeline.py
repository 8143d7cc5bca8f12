"""Pipeline parallel training equals single-process training (gloo, local ranks).

Each test spawns one group of workers and runs several configurations inside it: process
start-up (importing torch) dominates on small machines, and the runtime builds fresh mesh
groups per job, so nothing leaks from one configuration to the next.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import check_against_reference, step_rows, train_jobs
from trainwright.config import Config
from trainwright.dist.testing import run_workers
from trainwright.run.launch import create_run_dir


def _check_held_microbatches(cfg: Config, run_dir: Path) -> None:
    p, m = cfg.parallel.pp, cfg.train.micro_batches
    for row in step_rows(run_dir):
        for st in row["stages"]:
            held = st["held_microbatches_peak"]
            if cfg.train.schedule == "1f1b":
                assert held <= p - st["stage"], (row["step"], st)
                assert held == min(p - st["stage"], m)
            else:
                assert held == m
            assert st["activation_peak_bytes"] > 0


def _matrix(tiny, world: int) -> list[Config]:
    cfgs = [tiny(**{"parallel.pp": world, "train.schedule": f'"{s}"', "train.micro_batches": mb})
            for s in ("gpipe", "1f1b") for mb in (1, 4, 8)]
    if world == 4:
        cfgs += [tiny(**{"parallel.pp": 2, "parallel.dp": 2, "train.schedule": f'"{s}"',
                         "train.micro_batches": 4}) for s in ("gpipe", "1f1b")]
        # AdamW on the MLP: in attention the key bias has an exactly-zero gradient, and Adam
        # turns float noise there into full-size steps, so the GPT cannot be compared tightly
        cfgs.append(tiny(**{"parallel.pp": 2, "parallel.dp": 2, "train.optimizer": '"adamw"',
                            "train.lr": 0.01, "train.micro_batches": 2, "model.name": '"mlp"',
                            "model.n_blocks": 3}))
    return cfgs


def _factory_matrix(tiny, world: int) -> list[Config]:
    user = {"data.factory": '"tests.factories:Regression"', "train.loss": '"mse"',
            "parallel.pp": world}
    return [tiny(**user, **{"model.factory": '"tests.factories:skipnet"'}),
            tiny(**user, **{"model.factory": '"tests.factories:sequential_mlp"',
                            "train.schedule": '"gpipe"'})]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_single_process(tiny, world):
    cfgs = _matrix(tiny, world) + _factory_matrix(tiny, world)
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(train_jobs, world, list(zip(cfgs, map(str, dirs), strict=True)), timeout_s=400)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        label = (f"pp={cfg.parallel.pp} dp={cfg.parallel.dp} {cfg.train.schedule} "
                 f"m={cfg.train.micro_batches} {cfg.train.optimizer} {cfg.model.factory}")
        try:
            check_against_reference(cfg, run_dir)
            _check_held_microbatches(cfg, run_dir)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc


def _trainers_release_groups(rank: int, world: int, jobs: list[tuple[Config, str]]) -> None:
    from torch.distributed import distributed_c10d as c10d

    from trainwright.run.trainer import Trainer

    before = len(c10d._world.pg_map)
    for cfg, run_dir in jobs:
        trainer = Trainer(cfg, Path(run_dir))
        trainer.fit()
        assert len(c10d._world.pg_map) > before  # its pipeline, control and replica groups
        trainer.close()
        assert trainer.topo.pp_group is None and trainer.topo.dp_group is None
        assert len(c10d._world.pg_map) == before, "a closed trainer left process groups"


@pytest.mark.timeout(120)
def test_closed_trainer_releases_its_process_groups(tiny):
    # a benchmark builds ~90 trainers in two processes: each must give its groups back
    cfgs = [tiny(**{"parallel.pp": 2, "train.schedule": '"1f1b"'}),
            tiny(**{"parallel.pp": 2, "train.schedule": '"zb-v"', "parallel.virtual_stages": 2})]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(_trainers_release_groups, 2, list(zip(cfgs, map(str, dirs), strict=True)),
                timeout_s=100)

