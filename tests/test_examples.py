"""The examples train, evaluate and export from the repository root:
``examples/llama-tiny.toml`` (text files) and ``examples/llama-hf.toml`` (a local Hugging
Face data set through ``data.name = "hf"``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ["llama-tiny", "llama-hf"])
def test_llama_examples_train_evaluate_and_export(tmp_path, example):
    """A shortened run of the example (8 steps, eval every 4), then ``trainwright export``:
    ``from_pretrained`` gives the logits of the trained pipeline's layers."""
    transformers = pytest.importorskip("transformers")
    if example == "llama-hf":
        pytest.importorskip("datasets")
    run = [sys.executable, "-m", "trainwright", "run", f"examples/{example}.toml",
           "--set", f'run.dir="{tmp_path / "runs"}"', "--set", "train.steps=8",
           "--set", "train.warmup_steps=2", "--set", "eval.every=4"]
    res = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / example
    assert (run_dir / "checkpoints" / "step_000008").is_dir()
    if example == "llama-hf":  # TensorBoard's event file, written from rank 0
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), \
            sorted(p.name for p in run_dir.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = next(r["layer_names"] for r in rows if r.get("kind") == "run")
    assert names == ["embed", *(f"model.layers.{i}" for i in range(4)), "head"]
    assert [r["step"] for r in rows if r.get("kind") == "eval"] == [4, 8]
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "trainwright", "export", str(run_dir),
                          "--to", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from trainwright import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    layers = load_model(run_dir).eval()
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, layers(x))


def test_the_hf_example_reads_its_shipped_data_set(monkeypatch):
    """``examples/llama-hf.toml`` validates, and its data (the shipped ``.jsonl`` through
    ``datasets``) packs the first document into the first window and holds documents out
    for evaluation (the default-suite stand-in for the slow run above)."""
    pytest.importorskip("datasets")
    from trainwright.config import load_config
    from trainwright.model.build import build_data, check_data

    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "examples" / "llama-hf.toml", [])
    assert (cfg.data.name, cfg.train.precision, cfg.train.lr_schedule) == ("hf", "bf16",
                                                                            "cosine")
    assert cfg.train.clip_norm > 0 and cfg.eval.every > 0 and cfg.run.checkpoint_every > 0
    assert cfg.observe.loggers == ["tensorboard"] and cfg.run.async_checkpoint
    check_data(cfg)
    data = build_data(cfg)
    x, y = data.batch(1, cfg.train.batch_size)
    assert x.shape == y.shape == (cfg.train.batch_size, cfg.model.context)
    first = json.loads((ROOT / cfg.data.dataset).read_text().splitlines()[0])["text"]
    assert bytes(x[0].tolist()) == first.encode()[: cfg.model.context]
    ex, _ = data.eval_batch(0, cfg.train.batch_size)
    trained = {bytes(r) for s in range(1, 4) for r in data.batch(s, 16)[0].tolist()}
    assert not trained & {bytes(r) for r in ex.tolist()}


def test_factory_modules_import_from_the_working_directory(tmp_path, monkeypatch):
    """The installed ``trainwright`` script does not put the working directory on the path;
    ``model.factory = "examples.llama_tiny:build"`` still loads from the repository root."""
    import sys

    from trainwright.model.build import load_factory

    (tmp_path / "my_models_for_the_cwd_test.py").write_text("def build():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_factory("my_models_for_the_cwd_test:build", "model.factory")() == 7
