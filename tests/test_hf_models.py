"""Bring your own model: Hugging Face GPT-2 / Llama through ``model.factory``, tied weights
across stages (and through a live migration), export back to ``from_pretrained``.

Every parallel run is checked against single-process training of the same layers on the
same batches (``torch.testing.assert_close``). Capturing a model with ``torch.export`` takes
seconds per process on a loaded 2-core machine, so the matrix captures each model once here
and hands the workers the pickled layers (``Trainer(layers=...)``); the capture itself is
tested on its own (chain output equals the model's), and the export test trains through
``trainwright.fit``, where every rank captures the model from the factory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from trainwright.cli.main import main as cli
from trainwright.config import Config
from trainwright.dist.testing import run_workers
from trainwright.dist.topology import Topology
from trainwright.model.build import build_layers, build_model
from trainwright.model.hf import output_tensor
from trainwright.pipeline.stage import LayerSlot
from trainwright.run import checkpoint
from trainwright.run.launch import create_run_dir
from trainwright.run.reference import train_reference
from trainwright.run.trainer import Trainer, TrainerOptions

HF = {"model.context": 8, "train.batch_size": 16, "train.micro_batches": 4}


def _cfg(tiny, factory: str, **extra) -> Config:
    return tiny(**HF, **{"model.factory": f'"tests.hf_models:{factory}"'}, **extra)


def _chain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


# ------------------------------------------------------------------ capture: cut at blocks
def test_auto_cuts_gpt2_and_llama_at_their_blocks(tiny):
    from tests import hf_models

    ids = torch.randint(0, hf_models.VOCAB, (3, 8))
    for factory, blocks in (("gpt2", "transformer.h"), ("llama", "model.layers")):
        cfg = _cfg(tiny, factory)
        named, model = build_model(cfg)
        assert [n for n, _ in named] == ["embed", f"{blocks}.0", f"{blocks}.1", "head"]
        torch.testing.assert_close(_chain([m for _, m in named], ids), model(ids).logits)
    llama = model.config
    assert llama.num_key_value_heads < llama.num_attention_heads  # grouped-query attention


def test_output_rule_picks_logits_or_first_output(tiny):
    from transformers.modeling_outputs import CausalLMOutput

    t = torch.ones(2)
    assert output_tensor(t) is t
    assert output_tensor((t, torch.zeros(1))) is t
    assert output_tensor(CausalLMOutput(loss=None, logits=t)) is t
    assert output_tensor({"hidden": t, "other": 1}) is t
    assert output_tensor(((t,),)) is t
    for bad in (None, "x", (), {"note": "x"}, [None, t]):
        assert output_tensor(bad) is None
    named, model = build_model(_cfg(tiny, "tuple_out"))
    ids = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(_chain([m for _, m in named], ids), model(ids)[0])


def test_forward_without_tensor_is_refused(tiny, tmp_path, capsys):
    run_dir = tmp_path / "never"
    code = cli(["run", "--set", "model.factory=\"tests.hf_models:no_tensor\"",
                "--set", f"run.dir=\"{run_dir}\""])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model.factory" in err and "no tensor" in err and "NoTensor" in err
    assert not run_dir.exists()


@pytest.mark.parametrize("extra, key", [
    ({"rebalance.edits": '"tests.factories:insert_heavy"'}, "rebalance.edits"),
    ({"sync.strategy": '"hierarchical"', "parallel.dp": 2}, "sync.strategy"),
])
def test_ties_with_a_config_that_cannot_keep_them_are_refused(tmp_path, capsys, extra, key):
    run_dir = tmp_path / "never"
    sets = {"model.factory": '"tests.hf_models:tied_sequential"', "run.dir": f'"{run_dir}"',
            "model.context": 8, **extra}
    code = cli(["run", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {key}") and "tied" in err
    assert not run_dir.exists()


# ------------------------------------------------------------------ training equals reference
_CACHE: dict[tuple, Path] = {}


def _captured_layers(cfg: Config, where: Path) -> Path:
    """The config's layers, captured once per model and pickled for the workers."""
    key = (cfg.model.factory, cfg.model.context, cfg.train.seed, cfg.model.group_by)
    if key not in _CACHE or not _CACHE[key].exists():
        path = where / f"layers_{len(_CACHE)}_{cfg.model.factory.split(':')[1]}.pt"
        torch.save(build_layers(cfg), path)
        _CACHE[key] = path
    return _CACHE[key]


def _load(path: Path) -> list[tuple[str, nn.Module]]:
    return torch.load(path, weights_only=False)


def _train_cached(rank: int, world: int, jobs: list[tuple[Config, str, str]]) -> None:
    for cfg, run_dir, path in jobs:
        Trainer(cfg, Path(run_dir),
                options=TrainerOptions(layers=lambda p=path: _load(Path(p)))).fit()


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "step"]


def _trained(cfg: Config, run_dir: Path, path: Path) -> nn.Sequential:
    named = _load(path)
    checkpoint.load_layers(run_dir, cfg.train.steps,
                           [LayerSlot(i, n, m) for i, (n, m) in enumerate(named)])
    return nn.Sequential(*(m for _, m in named))


def _check(cfg: Config, run_dir: Path, path: Path) -> None:
    ref, ref_losses = train_reference(cfg, layers=[m for _, m in _load(path)])
    got = _trained(cfg, run_dir, path)
    for (name, a), (_, b) in zip(got.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(ref_losses))
    _check_copies_identical(run_dir, cfg.train.steps, path)


def _check_copies_identical(run_dir: Path, step: int, path: Path) -> None:
    """Every stage's copy of a tied weight, as checkpointed, is bit-for-bit the same."""
    from trainwright.model.ties import find_ties, untie

    named = _load(path)
    ties = find_ties(named)
    untie(named, ties)  # one tensor per layer, so each layer's saved copy loads apart
    checkpoint.load_layers(run_dir, step, [LayerSlot(i, n, m) for i, (n, m) in enumerate(named)])
    for tie in ties:
        (i0, p0), *others = tie.members
        for index, pname in others:
            assert torch.equal(named[index][1].get_parameter(pname),
                               named[i0][1].get_parameter(p0)), tie
    assert bool(ties) == ("tied" in path.name or "gpt2" in path.name), (path.name, ties)


_MIGRATE = {"rebalance.at_step": 3, "train.steps": 5}
_MATRIX = {
    4: [("gpt2", {"parallel.pp": 4}),
        ("llama", {"parallel.pp": 4, "train.schedule": '"gpipe"'}),
        ("gpt2", {"parallel.pp": 2, "parallel.dp": 2, "memory.policies": '["recompute"]'}),
        ("llama", {"parallel.pp": 2, "parallel.dp": 2}),
        # the tied head moves from stage 3 to stage 2: the tie's group becomes stages {0, 2}
        ("tied_sequential", {"parallel.pp": 4, "parallel.partition": "[1, 1, 2, 2]",
                             "rebalance.to": "[1, 1, 3, 1]", **_MIGRATE})],
    2: [("gpt2", {"parallel.pp": 2, "train.schedule": '"gpipe"', "train.steps": 5}),
        ("llama", {"parallel.pp": 2, "memory.policies": '["recompute"]'}),
        ("llama_tied", {"parallel.pp": 2, "train.optimizer": '"adamw"', "train.lr": 0.01,
                        "train.steps": 5}),
        # the tied head moves to stage 0, next to the embedding: the tie becomes local
        ("tied_sequential", {"parallel.pp": 2, "train.optimizer": '"adamw"',
                             "train.lr": 0.01, "rebalance.to": "[5, 1]", **_MIGRATE}),
        # two chunks per rank, the head (layer 4) on model stage 2: with ZB-V's V placement
        # that is rank 1 (the tie spans ranks), interleaved round-robin puts it on rank 0
        ("tied_sequential", {"parallel.pp": 2, "train.schedule": '"zb-v"',
                             "parallel.virtual_stages": 2, "parallel.partition": "[1, 2, 2, 1]"}),
        ("tied_sequential", {"parallel.pp": 2, "train.schedule": '"interleaved-1f1b"',
                             "parallel.virtual_stages": 2, "parallel.partition": "[1, 2, 2, 1]"})],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_hf_and_tied_models_train_like_one_process(tiny, tmp_path, world):
    cfgs = [_cfg(tiny, f, **extra) for f, extra in _MATRIX[world]]
    paths = [_captured_layers(c, tmp_path) for c in cfgs]
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(_train_cached, world, [(c, str(d), str(p)) for c, d, p in
                                       zip(cfgs, dirs, paths, strict=True)], timeout_s=560)
    for (factory, extra), cfg, run_dir, path in zip(_MATRIX[world], cfgs, dirs, paths,
                                                    strict=True):
        try:
            _check(cfg, run_dir, path)
        except AssertionError as exc:
            raise AssertionError(f"{factory} {extra}: {exc}") from exc
        if "rebalance.to" in extra:  # the head (layer 4) did move
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            reps = [r for r in rows if r["kind"] == "repartition"]
            assert reps and reps[-1]["new"] == cfg.rebalance.to, reps
            assert any(4 in mv["layers"] for r in reps for mv in r["moves"]), reps


def test_one_stage_steps_a_shared_weight_once(tiny, tmp_path):
    cfg = _cfg(tiny, "tied_sequential", **{"parallel.pp": 1, "train.optimizer": '"adamw"',
                                           "train.lr": 0.01, "train.steps": 5})
    trainer = Trainer(cfg, create_run_dir(cfg),
                      options=TrainerOptions(mesh=Topology(pp=1, dp=1, rank=0)))
    shared = trainer.slots[0].module.weight
    assert trainer.slots[4].module.weight is shared  # one object on one stage
    holders = [s.index for s in trainer.slots if s.optimizer is not None and any(
        p is shared for g in s.optimizer.param_groups for p in g["params"])]
    assert holders == [0]
    trainer.fit()
    ref, ref_losses = train_reference(cfg)
    torch.testing.assert_close(shared, ref[0].weight)
    torch.testing.assert_close(torch.tensor(_losses(trainer.run_dir)), torch.tensor(ref_losses))


# ------------------------------------------------------------------ export
@pytest.mark.timeout(600)
def test_export_gives_a_from_pretrained_folder_with_the_trained_weights(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    import trainwright
    from tests.conftest import tiny_overrides

    run_dir = trainwright.fit(overrides=tiny_overrides(tmp_path / "runs", **HF, **{
        "model.factory": '"tests.hf_models:gpt2"', "parallel.pp": 2}))
    out = tmp_path / "exported"
    assert cli(["export", str(run_dir), "--to", str(out)]) == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors"}
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(hf, GPT2LMHeadModel)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # still tied
    ids = torch.randint(0, 256, (3, 8))
    pipeline = trainwright.load_model(run_dir)  # the trained layers as nn.Sequential
    with torch.no_grad():
        expected = pipeline(ids)
        torch.testing.assert_close(hf(ids).logits, expected)
        original = trainwright.load_model(run_dir, original=True)
        assert isinstance(original, GPT2LMHeadModel)
        torch.testing.assert_close(original(ids).logits, expected)
    capsys.readouterr()
    assert cli(["export", str(run_dir), "--to", str(out)]) == 2  # not empty: nothing written
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--to" in err, err


def test_a_tie_counts_once_in_a_global_norm(tiny):
    """Copies that all hold the whole gradient: skipping ``duplicate_copies`` gives the
    single-process model's gradient norm (what global clipping needs)."""
    from trainwright.model.ties import find_ties, untie
    from trainwright.pipeline.tied import duplicate_copies

    cfg = _cfg(tiny, "tied_sequential")
    shared = build_layers(cfg)
    ids = torch.randint(0, 256, (4, 8))
    _chain([m for _, m in shared], ids).square().mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(nn.Sequential(*(m for _, m in shared))
                                              .parameters(), float("inf"))
    ties = find_ties(shared)
    slots = [LayerSlot(i, n, m) for i, (n, m) in enumerate(shared)]
    assert duplicate_copies(ties, slots) == []  # one object on one stage counts once
    copies = build_layers(cfg)
    untie(copies, ties)
    _chain([m for _, m in copies], ids).square().mean().backward()
    tied = [m.get_parameter(p) for i, p in ties[0].members for m in [copies[i][1]]]
    total = sum(p.grad for p in tied)
    for p in tied:  # what TiedGradSync hands every copy
        p.grad = total.clone()
    slots = [LayerSlot(i, n, m) for i, (n, m) in enumerate(copies)]
    skip = {id(p) for p in duplicate_copies(ties, slots)}
    assert skip == {id(tied[1])}
    norm = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(p.grad) for _, m in copies for p in m.parameters()
        if id(p) not in skip]))
    torch.testing.assert_close(norm, ref_norm)
