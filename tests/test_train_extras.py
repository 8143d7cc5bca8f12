"""Mixed precision, clipping, LR schedules, evaluation and text data against plain torch.

The reference (``tests/torch_reference.py``) is written with torch alone on
``nn.Sequential`` of the same layers and the same global batches; the pipeline runs spawn
gloo workers and several configurations share one group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import tiny_overrides
from tests.helpers import train_jobs
from tests.torch_reference import check_against_torch, metric_rows, reference, torch_scheduler
from trainwright.config import load_config
from trainwright.dist.testing import run_workers
from trainwright.run.api import load_model
from trainwright.run.launch import create_run_dir
from trainwright.run.lr import LRClock
from trainwright.run.trainer import Trainer
from trainwright.run.worker import train

# ----------------------------------------------------------------------------- pipelines

def _text_folder(root: Path) -> Path:
    folder = root / "corpus"
    (folder / "sub").mkdir(parents=True)
    words = "the quick brown fox jumps over a lazy dog while pipelines train models".split()
    for i in range(3):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(400))
        (folder / ("sub" if i == 2 else "") / f"part{i}.txt").write_text(text + "\n")
    return folder


def _pp2_configs(root: Path) -> dict:
    def tiny(**extra):
        return load_config(None, tiny_overrides(root / "runs", **extra))

    common = {"train.steps": 5, "train.lr_schedule": '"cosine"', "train.warmup_steps": 2,
              "train.min_lr": 0.01, "train.clip_norm": 0.3, "eval.every": 2, "eval.batches": 2}
    return {
        "fp32": tiny(**common),                                              # fp32, 1F1B
        "text": tiny(**common, **{"data.name": '"text"', "train.schedule": '"gpipe"',
                                  "data.path": f'"{_text_folder(root)}"'}),
        "bf16": tiny(**{**common, "train.precision": '"bf16"',
                        "memory.policies": '["recompute"]'}),
        "migrated": tiny(**{**common, "train.lr_schedule": '"linear"', "rebalance.at_step": 2,
                            "rebalance.to": "[1, 3]", "train.momentum": 0.9,
                            "train.min_lr": 0.0}),          # + migration with momentum state
        "fp16": tiny(**{"train.precision": '"fp16"', "train.steps": 3}),
        "fp16_clip": tiny(**{**common, "train.precision": '"fp16"'}),
        "resumed": tiny(**{**common, "train.steps": 4, "run.checkpoint_every": 2,
                           "eval.every": 0, "train.momentum": 0.9}),
    }


def _pp2_worker(rank: int, world: int, jobs: dict) -> None:
    import torch.distributed as dist

    from trainwright.run import checkpoint

    for name, (cfg, run_dir) in jobs.items():
        if name == "fp16":
            _fp16_inf_job(rank, world, cfg, run_dir)
            continue
        train(cfg, Path(run_dir))
        if name == "resumed":  # go back to the checkpoint of step 2 and resume from there
            if rank == 0:
                checkpoint.mark_latest(Path(run_dir), 2)
            dist.barrier()
            train(cfg, Path(run_dir), resume=True)


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory):
    """Every pp=2 configuration of this module, trained in one group of 2 workers."""
    root = tmp_path_factory.mktemp("pp2")
    jobs = {name: (cfg, str(create_run_dir(cfg))) for name, cfg in _pp2_configs(root).items()}
    run_workers(_pp2_worker, 2, jobs, timeout_s=400)
    return {name: (cfg, Path(d)) for name, (cfg, d) in jobs.items()}


@pytest.mark.timeout(480)
def test_fp32_clip_cosine_eval_equal_plain_torch(pp2_runs):
    """pp=2, 1F1B: clipping, warm-up + cosine, eval every 2 steps: losses, lr and grad norm
    per step, eval losses and parameters equal the torch reference; the report shows eval."""
    from trainwright.observe.report import write_report

    check_against_torch(*pp2_runs["fp32"])
    html = write_report(pp2_runs["fp32"][1]).read_text()
    assert "last eval loss" in html


@pytest.mark.timeout(480)
def test_text_folder_run_equals_plain_torch(pp2_runs):
    check_against_torch(*pp2_runs["text"])


@pytest.mark.timeout(480)
def test_bf16_with_recompute_equals_autocast_reference(pp2_runs):
    """Autocast in every layer's forward and in its recompute: loss within 1e-3 relative."""
    check_against_torch(*pp2_runs["bf16"], loss_rtol=1e-3, param_tol=2e-2)


@pytest.mark.timeout(480)
def test_fp16_with_loss_scaling_equals_gradscaler_reference(pp2_runs):
    """fp16 autocast + GradScaler on the reference, agreed scaling in the pipeline."""
    check_against_torch(*pp2_runs["fp16_clip"], loss_rtol=1e-3, param_tol=2e-2)


@pytest.mark.timeout(480)
def test_schedule_survives_a_live_migration(pp2_runs):
    cfg, run_dir = pp2_runs["migrated"]
    check_against_torch(cfg, run_dir)
    assert [r["step"] for r in metric_rows(run_dir, "repartition")] == [2]


@pytest.mark.timeout(480)
def test_resume_continues_the_schedule(pp2_runs):
    """Resumed from step 2 of 4: steps 3-4 get the same lr (and loss) as the first time, and
    the final weights equal the reference's."""
    cfg, run_dir = pp2_runs["resumed"]
    rows = metric_rows(run_dir, "step")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 3, 4]
    for a, b in ((rows[2], rows[4]), (rows[3], rows[5])):
        assert a["lr"] == b["lr"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    ref = reference(cfg)
    torch.testing.assert_close(torch.tensor([r["lr"] for r in rows[4:]], dtype=torch.float64),
                               torch.tensor(ref["lr"][2:], dtype=torch.float64))
    for (name, a), (_, b) in zip(load_model(run_dir).named_parameters(),
                                 ref["model"].named_parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")


def _dp2_configs(tiny) -> list:
    common = {"parallel.pp": 2, "parallel.dp": 2, "train.steps": 3, "train.clip_norm": 0.3,
              "train.lr_schedule": '"cosine"', "train.warmup_steps": 0}
    return [tiny(**common),
            tiny(**common, **{"sync.sparse": "true", "sync.sparse_path": '"allgather"'}),
            tiny(**common, **{"sync.strategy": '"hierarchical"',
                              "hierarchical.weights": "[1, 3]"}),
            # a torch Dataset pair from data.factory, sharded per replica, with evaluation
            tiny(**{**common, "data.factory": '"tests.factories:regression_datasets"',
                    "model.factory": '"tests.factories:sequential_mlp"', "train.loss": '"mse"',
                    "train.clip_norm": 0.0, "eval.every": 2, "eval.batches": 2})]


@pytest.mark.timeout(480)
def test_clip_norm_over_replicas_with_dense_sparse_and_hierarchical_sync(tiny):
    """pp=2 x dp=2: the logged norm is clip_grad_norm_'s on the reference, and the clipped
    training equals it, with dense, sparse (row) and hierarchical (sharded) gradients; a
    Dataset from data.factory trains and evaluates as the reference does."""
    jobs = [(cfg, str(create_run_dir(cfg))) for cfg in _dp2_configs(tiny)]
    run_workers(train_jobs, 4, jobs, timeout_s=450)
    for cfg, run_dir in jobs:
        check_against_torch(cfg, Path(run_dir))


def _fp16_inf_job(rank: int, world: int, cfg, run_dir: str) -> None:
    trainer = Trainer(cfg, run_dir)
    inner, now = trainer.sync, [0]
    real_sync = inner.sync

    def sync_then_poison(params):  # fault injection: an overflow on stage 1 in step 2
        real_sync(params)
        if trainer.topo.stage == 1 and now[0] == 2:
            params[0].grad.view(-1)[0] = float("inf")

    inner.sync = sync_then_poison
    snaps, scales = {}, {}
    for step in range(1, cfg.train.steps + 1):
        now[0] = step
        trainer.train_step(step)
        snaps[step] = [p.detach().clone() for p in trainer.stage.parameters()]
        scales[step] = trainer.rules.scaler.get_scale()
    trainer.finish()
    for a, b in zip(snaps[1], snaps[2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # no stage stepped in step 2
    assert any(not torch.equal(a, b) for a, b in zip(snaps[2], snaps[3], strict=True))
    assert scales[2] == scales[1] / 2 == scales[3], scales  # backed off alike everywhere


@pytest.mark.timeout(480)
def test_fp16_overflow_on_one_stage_skips_the_step_everywhere(pp2_runs):
    """An inf injected into stage 1's gradient in step 2: no stage steps (checked inside the
    workers), every scaler backs off, and the metrics say so."""
    rows = metric_rows(pp2_runs["fp16"][1], "step")
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert rows[1]["loss_scale"] == 2.0 * rows[2]["loss_scale"]


# ----------------------------------------------------------------------------- one process

@pytest.mark.parametrize("schedule, warmup", [("constant", 3), ("cosine", 0), ("cosine", 4),
                                              ("linear", 2)])
def test_lr_clock_equals_torch_scheduler_and_resumes(schedule, warmup):
    cfg = load_config(None, [f"train.lr_schedule={schedule}", f"train.warmup_steps={warmup}",
                             "train.steps=12", "train.lr=0.1", "train.min_lr=0.001"])
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    ref, clock, want, got = torch_scheduler(cfg.train, opt), LRClock(cfg.train), [], []
    for step in range(1, 13):
        want.append(opt.param_groups[0]["lr"])
        got.append(clock.lr)
        opt.step()
        ref.step()
        clock.advance()
        if step == 5:  # a resume from the checkpoint of step 5
            state = clock.state_dict()
            clock = LRClock(cfg.train, 5)
            clock.load_state_dict(state)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64))
    assert got[-1] == pytest.approx(0.001 if schedule != "constant" else 0.1)


def test_text_windows_split_and_shares(tmp_path):
    from trainwright.model.text_data import TokenWindows, read_text_tokens

    folder = _text_folder(tmp_path)
    ids = read_text_tokens(str(folder))
    assert ids.numel() == sum(f.stat().st_size for f in folder.rglob("*.txt"))
    ids = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    data = TokenWindows(lambda: ids, context=8, seed=3, val_fraction=0.25)
    x, y = data.batch(4, 8)
    split = ids.numel() - int(ids.numel() * 0.25)
    assert x.shape == (8, 8) and torch.equal(x[:, 1:], y[:, :-1])
    for r in range(2):
        xs, ys = data.share(4, 8, r, 2, inputs=r == 0, targets=r == 1)
        assert (xs is None) == (r == 1) and (ys is None) == (r == 0)
        torch.testing.assert_close(xs if r == 0 else ys, (x if r == 0 else y)[r * 4:(r + 1) * 4])
    # every held-out window lies in the last quarter, every training window before it
    windows = ids.unfold(0, 8, 1)

    def starts(rows):
        return [int((windows == row).all(1).nonzero()[0]) for row in rows]

    assert min(starts(data.eval_batch(0, 32)[0])) >= split
    assert max(starts(torch.cat([data.batch(s, 32)[1] for s in range(1, 4)]))) < split - 1


def test_tokenizers_file_and_dataset_factory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from torch.utils.data import DistributedSampler, TensorDataset

    from trainwright.model.text_data import DatasetBatches, read_text_tokens

    folder = _text_folder(tmp_path)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(f) for f in sorted(folder.rglob("*.txt"))],
              trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tok.json"))
    ids = read_text_tokens(str(folder / "*.txt"), str(tmp_path / "tok.json"))
    assert ids.numel() == 800 and int(ids.max()) < tok.get_vocab_size()
    cfg = load_config(None, ["data.name=text", f'data.path="{folder}"',
                             f'data.tokenizer="{tmp_path / "tok.json"}"', "parallel.pp=1"])
    from trainwright.model.build import vocab_size
    assert vocab_size(cfg) == tok.get_vocab_size()
    # the same tokenizer as a transformers folder, loaded by AutoTokenizer (no download)
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[UNK]").save_pretrained(
        tmp_path / "hf_tok")
    hf_ids = read_text_tokens(str(folder / "*.txt"), str(tmp_path / "hf_tok"))
    assert hf_ids.tolist() == [*ids[:400].tolist(), 0, *ids[400:].tolist(), 0]
    # a map-style Dataset: replica r's rows are DistributedSampler's indices for the epoch
    ds = TensorDataset(torch.arange(10.0)[:, None], torch.arange(10))
    batches = DatasetBatches(ds, seed=5, parts=2)
    for step in (1, 2, 3):  # 2 per replica per step, 5 per epoch: step 3 crosses epochs
        for r in range(2):
            s = DistributedSampler(ds, 2, r, shuffle=True, seed=5, drop_last=True)
            order = []
            for epoch in range(2):
                s.set_epoch(epoch)
                order += list(s)
            _, y = batches.share(step, 4, r, 2)
            assert y.tolist() == order[(step - 1) * 2: step * 2]
    # an IterableDataset: replica r takes every 2nd item from r on, in order
    stream = DatasetBatches(_Count(), parts=2)
    assert stream.share(2, 4, 1, 2)[1].tolist() == [5, 7]
    assert stream.batch(2, 4)[1].tolist() == [4, 6, 5, 7]
    assert stream.share(1, 4, 0, 2)[1].tolist() == [0, 2]  # a resumed reader starts over


class _Count(torch.utils.data.IterableDataset):
    def __iter__(self):
        return ((torch.tensor([float(i)]), torch.tensor(i)) for i in range(100))


BAD_DATA = [
    (["data.name=text", 'data.path="/no/such/dir/*.txt"'], r"^error: data.path = .* matches no"),
    (["data.name=text", "data.path=PATH", 'data.tokenizer="BADTOK"'],
     r"^error: data.tokenizer = .* cannot be loaded"),
    (["train.lr_schedule=cosine", "train.warmup_steps=5", "train.steps=5"],
     r"^error: train.warmup_steps = 5 leaves no step"),
    (["train.precision=fp16", "sync.strategy=hierarchical", "parallel.dp=2"],
     r'^error: train.precision = "fp16"'),
    (['data.factory="tests.factories:Regression"', "eval.every=2"],
     r"^error: eval.every > 0 needs held-out data"),
    (["train.clip_norm=0.5", "sync.strategy=tokenring", "train.optimizer=sgd"],
     r'^error: train.clip_norm is not available with sync.strategy = "tokenring"'),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets, message", BAD_DATA)
def test_bad_data_and_training_keys_are_one_line_exit_2(sets, message, tmp_path, capsys):
    import re

    from trainwright.cli import main

    folder = _text_folder(tmp_path / "in")
    bad_tok = tmp_path / "in" / "tok.json"
    bad_tok.write_text("{not a tokenizer")
    out = tmp_path / "runs"
    sets = [s.replace("PATH", f'"{folder}"').replace("BADTOK", str(bad_tok)) for s in sets]
    argv = ["run", *[a for s in sets for a in ("--set", s)], "--set", f'run.dir="{out}"']
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists(), "nothing may be written for a bad config"


def test_update_state_round_trip_and_changed_schedule():
    """The state a checkpoint keeps (Trainer.register_state) continues the schedule and the
    loss scale; a resume that raised train.steps follows the new curve instead."""

    from trainwright.run.update import UpdateRules

    cfg = load_config(None, ["train.lr_schedule=cosine", "train.warmup_steps=2",
                             "train.steps=8", "train.precision=fp16", "parallel.pp=1"])
    cpu = torch.device("cpu")
    first = UpdateRules(cfg, None, 0, cpu)
    for _ in range(3):  # the optimizer step's bookkeeping, no parameters to update
        first.unscale_and_agree([], {})
        first.advance()
    first.scaler.update(new_scale=123.0)
    again = UpdateRules(cfg, None, 3, cpu)
    again.load_state_dict(first.state_dict())
    assert again.lr.lr == first.lr.lr and again.scaler.get_scale() == 123.0
    longer = load_config(None, ["train.lr_schedule=cosine", "train.warmup_steps=2",
                                "train.steps=16", "train.precision=fp16", "parallel.pp=1"])
    extended = UpdateRules(longer, None, 3, cpu)
    extended.load_state_dict(first.state_dict())
    assert extended.lr.lr == LRClock(longer.train, 3).lr != first.lr.lr
