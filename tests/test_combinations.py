"""Combinations of features that are refused before any process starts: each names why and
what to use instead, exits 2 and writes nothing (``docs/combinations.md`` lists them all)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import tiny_overrides
from trainwright.cli import main
from trainwright.config import load_config
from trainwright.errors import ConfigError, PlanError

REFUSED = [  # (overrides, what the one line must say): every cross-key rule of config/core.py
    (["sync.sparse=true", 'sync.strategy="hierarchical"'],
     r"sync.sparse = true works with sync.strategy = \"dense\""),
    (["sync.sparse=true", 'sync.strategy="tokenring"'], r"set sync.sparse = false"),
    (["memory.peer_swap=true"], r"set a limit"),
    (["memory.peer_swap=true", 'memory.limit="8MB"', 'memory.policies=["keep"]'],
     r"remove memory.policies"),
    (["memory.peer_swap=true", 'memory.limit="8MB"', "rebalance.at_step=2", "rebalance.to=[3, 3]"],
     r"layers cannot migrate"),
    (['sync.strategy="tokenring"', "train.batch_size=30", 'train.optimizer="sgd"'],
     r"does not split into tokenring.nodes"),
    (["rebalance.enabled=true", "train.micro_batches=1"], r"needs train.micro_batches >= 2"),
    (["rebalance.enabled=true", "rebalance.switch_mb=3"], r"rebalance.switch_mb = 3 must be in"),
    (["rebalance.at_step=2"], r"rebalance.at_step and rebalance.to go together"),
    (["rebalance.at_step=2", "rebalance.to=[6]"], r"rebalance.to = \[6\] must be 2"),
    (["parallel.dp=3"], r"does not split over parallel.dp = 3"),
    (["fault.kill_rank=5"], r"fault.kill_rank = 5 is not a rank of this job"),
    (['sync.strategy="tokenring"', 'train.optimizer="sgd"', "rebalance.enabled=true"],
     r"no stages to migrate layers between"),
    (['sync.strategy="tokenring"', 'train.optimizer="sgd"', "memory.peer_swap=true",
      'memory.limit="8MB"'], r"no stages to lend activation memory to"),
    (['train.schedule="zb-h1"', "memory.peer_swap=true", 'memory.limit="8MB"'],
     r"peer_swap = true works with train.schedule = \"1f1b\" or \"gpipe\", not 'zb-h1'"),
    (['train.schedule="zb-h2"', "rebalance.enabled=true"],
     r"live migration .* works with train.schedule = \"1f1b\" or \"gpipe\", not 'zb-h2'"),
    (['train.schedule="zb-h1"', 'rebalance.edits="tests.factories:insert_heavy"'],
     r"live migration .* not 'zb-h1'"),
    (['model.factory="tests.factories:number_across_layers"'],
     r"model.factory = .*only tensors cross the cuts.*wrap the submodules"),
    # interleaved 1F1B (parallel.virtual_stages): config/interleaved_rules.py
    (['train.schedule="interleaved-1f1b"'], r"needs parallel.virtual_stages >= 2"),
    (["parallel.virtual_stages=2"], r"virtual_stages = 2 needs train.schedule = "
                                    r"\"interleaved-1f1b\" or \"zb-v\""),
    (['train.schedule="zb-v"', "parallel.virtual_stages=3"],
     r"two chunks per rank in a V; set parallel.virtual_stages = 2, not 3"),
    (['train.schedule="zb-v"', "parallel.virtual_stages=2", "rebalance.enabled=true"],
     r"live migration .* not 'zb-v'"),
    (["parallel.virtual_stages=65"], r"parallel.virtual_stages = 65 must be in 1 .. 64"),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=2",
      "train.micro_batches=1"], r"micro_batches to be a multiple of parallel.pp = 2"),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=64"],
     r"parallel.pp \* parallel.virtual_stages = 128 stages is more than the model's"),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=2",
      "memory.peer_swap=true", 'memory.limit="8MB"'],
     r"peer_swap = true works with train.schedule = \"1f1b\" or \"gpipe\""),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=2",
      "rebalance.enabled=true"], r"live migration .* not 'interleaved-1f1b'"),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=2", "eval.every=2"],
     r"eval.every works with one stage per rank, not train.schedule = 'interleaved-1f1b'"),
    (['train.schedule="interleaved-1f1b"', "parallel.virtual_stages=2", "parallel.pp=1"],
     r"needs parallel.pp >= 2, got 1"),
]


def _assert_refused(argv: list[str], message: str, capsys, root) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert not (root / "runs").exists(), "nothing may be written for a refused combination"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra, message", REFUSED)
def test_refused_combination_is_one_line_and_exit_2(extra, message, tmp_path, capsys):
    argv = ["run"]
    for item in [f'run.dir="{tmp_path / "runs"}"', *extra]:
        argv += ["--set", item]
    _assert_refused(argv, message, capsys, tmp_path)


def _saved_run(tmp_path, **extra):
    """A run directory with only its config.toml, as a resume finds it."""
    cfg = load_config(None, tiny_overrides(tmp_path / "runs", **extra))
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(cfg.to_toml())
    return run_dir


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, kind, message", [
    ({"rebalance.edits": '"tests.factories:insert_heavy"'}, "model_edit",
     r"edited its model at step 3 .*start a new run"),
])
def test_refused_resume(extra, kind, message, tmp_path, capsys):
    run_dir = _saved_run(tmp_path, **extra)
    if kind:  # what the first run recorded when its layers moved
        (run_dir / "metrics.jsonl").write_text(
            '{"kind": "step", "step": 2}\n' + f'{{"kind": "{kind}", "step": 3}}\n{{"kin')
    before = sorted((p.name, p.stat().st_size) for p in run_dir.iterdir())
    _assert_refused(["run", "--resume", str(run_dir)], message, capsys, tmp_path)
    assert sorted((p.name, p.stat().st_size) for p in run_dir.iterdir()) == before


def test_pipeline_sync_for_the_ring_names_the_launcher(tiny):
    """A Trainer built by hand for the ring (not through the CLI) gets the same advice,
    not a NotImplementedError."""
    from trainwright.sync import make_grad_sync

    cfg = tiny(**{"sync.strategy": '"tokenring"', "tokenring.nodes": 2})
    with pytest.raises(ConfigError, match="trainwright run --set sync.strategy=tokenring"):
        make_grad_sync(cfg, None)


def test_number_between_layers_is_a_plan_error():
    """The graph cutter's refusal, below the config (what the factory check reports)."""
    from tests.factories import number_across_layers
    from trainwright.model.graph import layers_from_export

    model, args = number_across_layers()
    with pytest.raises(PlanError, match="needs .* from an earlier layer"):
        layers_from_export(model, args, dynamic_batch=True)


def test_no_not_implemented_error_in_the_package():
    """Every unsupported combination is refused at start with a ConfigError instead."""
    from pathlib import Path

    import trainwright

    root = Path(trainwright.__file__).parent
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if "NotImplementedError" in line]
    assert not hits, hits


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pairs_without_a_test_of_their_own_equal_the_reference(tiny):
    """Pairs of docs/combinations.md that no other test trains: GPipe with sparse and with
    hierarchical sync, fixed recompute / swap policies with live migration and with sparse or
    hierarchical sync; each run equals the single-process reference."""
    from tests.helpers import check_against_reference, train_jobs
    from trainwright.dist.testing import run_workers
    from trainwright.run.launch import create_run_dir

    base = {"parallel.pp": 2, "parallel.dp": 2, "train.schedule": '"gpipe"',
            "train.micro_batches": 2, "train.steps": 3}
    cfgs = [tiny(**base, **{"sync.sparse": "true", "memory.policies": '["recompute"]',
                            "rebalance.at_step": 2, "rebalance.to": "[1, 3]"}),
            tiny(**base, **{"sync.strategy": '"hierarchical"', "hierarchical.ranks_per_node": 1,
                            "hierarchical.align": 16, "memory.policies": '["swap"]'}),
            tiny(**{**base, "train.schedule": '"1f1b"'},
                 **{"memory.policies": '["swap", "keep", "recompute", "keep"]',
                    "rebalance.at_step": 2, "rebalance.to": "[3, 1]"})]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(train_jobs, 4, list(zip(cfgs, map(str, dirs), strict=True)), timeout_s=280)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        check_against_reference(cfg, run_dir)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        moves = [r["new"] for r in rows if r["kind"] == "repartition"]
        assert moves == ([cfg.rebalance.to] if cfg.rebalance.at_step else []), moves
