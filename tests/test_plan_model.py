"""Plan the user's own model, then run the plan (issue 33).

* a stage-to-rank mapping (``parallel.mapping``) trains equal to the one-process reference:
  send/receive peers and data-parallel groups follow the permutation;
* ``trainwright plan --model SPEC`` for a Hugging Face ``config.json`` (Llama-style 8 B and
  GPT-2, written here, built on the meta device) and for small models measured for real;
* ``trainwright run --plan`` runs exactly the plan's choices and refuses a plan for other
  devices or another model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import check_against_reference
from trainwright.config import Config
from trainwright.dist.testing import run_workers
from trainwright.run.launch import create_run_dir


def _train_recording_layers(rank: int, world: int, jobs: list[tuple[Config, str]]) -> None:
    """``run_workers`` target: train each job; write which layers this rank held."""
    from trainwright.run.trainer import Trainer

    for cfg, run_dir in jobs:
        trainer = Trainer(cfg, Path(run_dir))
        held = [slot.index for slot in trainer.slots]
        trainer.fit()
        trainer.close()
        Path(run_dir, f"layers_{rank}.json").write_text(json.dumps(held))


def _run_row(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "run")


@pytest.mark.timeout(240)
def test_permuted_mapping_trains_equal_to_reference(tiny):
    cfgs = [tiny(**{"parallel.pp": 4, "parallel.mapping": "[2, 0, 3, 1]",
                    "train.schedule": '"1f1b"', "train.micro_batches": 4}),
            tiny(**{"parallel.pp": 2, "parallel.dp": 2, "parallel.mapping": "[1, 0]",
                    "train.micro_batches": 2, "model.name": '"mlp"', "model.n_blocks": 3})]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(_train_recording_layers, 4, list(zip(cfgs, map(str, dirs), strict=True)),
                timeout_s=220)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        check_against_reference(cfg, run_dir)
        pp, order, parts = cfg.parallel.pp, cfg.parallel.mapping, cfg.partition()
        for rank in range(cfg.world_size):
            stage = order.index(rank % pp)
            first = sum(parts[:stage])
            held = json.loads((run_dir / f"layers_{rank}.json").read_text())
            assert held == list(range(first, first + parts[stage])), (rank, stage, held)
        assert _run_row(run_dir)["mapping"] == order
