"""``examples/llama-tiny.toml`` trains, evaluates and exports from the repository root."""

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
def test_llama_tiny_example_trains_evaluates_and_exports(tmp_path):
    """A shortened run of the example (8 steps, eval every 4), then ``trainwright export``:
    ``from_pretrained`` gives the logits of the trained pipeline's layers."""
    transformers = pytest.importorskip("transformers")
    run = [sys.executable, "-m", "trainwright", "run", "examples/llama-tiny.toml",
           "--set", f'run.dir="{tmp_path / "runs"}"', "--set", "train.steps=8",
           "--set", "train.warmup_steps=2", "--set", "eval.every=4"]
    res = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / "llama-tiny"
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


def test_factory_modules_import_from_the_working_directory(tmp_path, monkeypatch):
    """The installed ``trainwright`` script does not put the working directory on the path;
    ``model.factory = "examples.llama_tiny:build"`` still loads from the repository root."""
    import sys

    from trainwright.model.build import load_factory

    (tmp_path / "my_models_for_the_cwd_test.py").write_text("def build():\n    return 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_factory("my_models_for_the_cwd_test:build", "model.factory")() == 7
