"""``data.name = "hf"``: Hugging Face data sets packed into windows (issue 36, item 3).

* pp = 2 x dp = 2 from a ``save_to_disk`` folder and from a ``.jsonl`` file equals the
  one-process reference over the same windows, and a resumed run equals the uninterrupted
  one bit for bit (one group of four gloo ranks runs all six jobs);
* the position in the checkpoint continues a stream without re-reading what came before;
* replicas read disjoint documents, held-out documents are never trained on;
* bad input (no ``datasets``, a missing path, a wrong ``text_field``) is one line.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

from tests.helpers import (
    assert_bitwise,
    check_against_reference,
    resume_pair,
    run_recording_sparse,
    tiny_config,
)
from trainwright.errors import ConfigError

datasets = pytest.importorskip("datasets")

from trainwright.model.hf_data import HFWindows, check_text_field  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()


def _docs(n: int = 120) -> list[dict]:
    """Documents of varied length whose text names their index (so a window tells which
    document it came from)."""
    return [{"id": i, "body": f"<{i}> " + " ".join(WORDS[(i * k) % len(WORDS)]
                                                   for k in range(3 + i % 11))}
            for i in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    docs = _docs()
    datasets.Dataset.from_list(docs).save_to_disk(str(root / "saved"))
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return {"folder": str(root / "saved"), "jsonl": str(root / "docs.jsonl")}


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def _source(spec: str, parts: int = 2, val: float = 0.0) -> HFWindows:
    return HFWindows(spec, "body", _bytes, None, 16, parts=parts, val_fraction=val)


def _doc_ids(windows: torch.Tensor) -> set[int]:
    text = b"".join(bytes(r) for r in windows.tolist()).decode(errors="replace")
    return {int(part.split(">")[0]) for part in text.split("<")[1:] if ">" in part
            and part.split(">")[0].isdigit()}


@pytest.mark.parametrize("kind", ["folder", "jsonl"])
def test_the_checkpointed_position_continues_without_re_reading(sources, kind):
    whole = _source(sources[kind])
    want = [whole.share(s, 8, 1, 2) for s in range(1, 7)]
    first = _source(sources[kind])
    for s in range(1, 4):
        first.share(s, 8, 1, 2)
    state = first.state_dict()
    resumed = _source(sources[kind])
    resumed.load_state_dict(state)
    for s in range(4, 7):
        got = resumed.share(s, 8, 1, 2)
        torch.testing.assert_close(got, want[s - 1], rtol=0, atol=0)
    # only the documents of steps 4-6 were read (a replay from the start reads them all)
    read, total = resumed._streams[(1, 2)].documents, whole._streams[(1, 2)].documents
    assert 0 < read < total - first._streams[(1, 2)].documents + 2, (read, total)
    # without a saved position the stream re-reads from its start: same windows
    replay = _source(sources[kind])
    torch.testing.assert_close(replay.share(5, 8, 1, 2), want[4], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["folder", "jsonl"])
def test_replicas_read_their_own_documents_and_never_the_held_out_ones(sources, kind):
    src = _source(sources[kind], val=0.2)
    seen = [set(), set()]
    for step in range(1, 5):
        for r in range(2):
            x, y = src.share(step, 8, r, 2)
            assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
            seen[r] |= _doc_ids(torch.cat([x, y[:, -1:]], 1))
    assert seen[0] and seen[1] and not seen[0] & seen[1], seen
    held = _doc_ids(torch.cat(src.eval_batch(0, 16)))
    assert held and not held & (seen[0] | seen[1]), held
    # the global batch is the replicas' shares in order
    x, _ = src.batch(2, 8)
    torch.testing.assert_close(x, torch.cat([src.share(2, 8, r, 2)[0] for r in range(2)]))


def test_parquet_files_give_the_same_windows_as_jsonl(sources, tmp_path):
    datasets.Dataset.from_list(_docs()).to_parquet(str(tmp_path / "docs.parquet"))
    got = _source(str(tmp_path / "docs.parquet")).batch(3, 8)
    torch.testing.assert_close(got, _source(sources["jsonl"]).batch(3, 8), rtol=0, atol=0)


def test_with_files_that_divide_by_dp_each_replica_reads_only_its_own(tmp_path):
    docs = _docs()
    for k, part in enumerate((docs[:60], docs[60:])):
        (tmp_path / f"part{k}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in part))
    src = _source(str(tmp_path / "*.jsonl"))
    for r, ids in ((0, range(60)), (1, range(60, 120))):
        seen = set()
        for step in range(1, 4):
            x, y = src.share(step, 8, r, 2)
            seen |= _doc_ids(torch.cat([x, y[:, -1:]], 1))
        assert seen and seen <= set(ids), (r, seen)
        assert src._streams[(r, 2)].dataset.n_shards == 1  # one file opened, not both


def test_a_saved_dataset_dict_trains_on_its_train_split(tmp_path):
    docs = _docs()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(docs[:60]),
                          "test": datasets.Dataset.from_list(docs[60:])}
                         ).save_to_disk(str(tmp_path / "dd"))
    x, y = _source(str(tmp_path / "dd"), parts=1).share(1, 4)
    assert _doc_ids(torch.cat([x, y[:, -1:]], 1)) <= set(range(60))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)}
                         ).save_to_disk(str(tmp_path / "only_test"))
    with pytest.raises(ConfigError, match=r"no \"train\"; point data.dataset at one split"):
        _source(str(tmp_path / "only_test")).share(1, 4)


def test_documents_without_text_are_skipped_and_non_text_is_one_line(tmp_path):
    rows = [{"text": "alpha beta"}, {"text": None}, {"text": "gamma delta"}]
    (tmp_path / "gaps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    x, y = HFWindows(str(tmp_path / "gaps.jsonl"), "text", _bytes, None, 19).share(1, 1)
    assert bytes(torch.cat([x[0], y[0, -1:]]).tolist()) == b"alpha betagamma delt"
    (tmp_path / "nums.jsonl").write_text('{"text": "fine"}\n{"text": 7}\n')
    with pytest.raises(ConfigError, match="holds int in a document; set it to a column"):
        HFWindows(str(tmp_path / "nums.jsonl"), "text", _bytes, None, 8).share(1, 1)


def test_text_files_give_one_document_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond one\n")
    src = HFWindows(str(tmp_path / "a.txt"), "text", _bytes, 0, 8)
    windows = [torch.cat([x[0], y[0, -1:]]) for x, y in (src.share(s, 1) for s in (1, 2, 3, 4))]
    # windows of context + 1 tokens, back to back; documents end with the EOS id (0 here)
    assert bytes(torch.cat(windows).tolist()) == b"first paragraph\nstill first\x00second o"


def test_a_wrong_text_field_names_the_columns(sources):
    with pytest.raises(ConfigError, match=r"data.text_field = 'text' is not a column .*"
                                          r"columns: id, body"):
        check_text_field(sources["jsonl"], "text")


def test_too_little_text_for_a_replica_is_refused_before_the_start(tmp_path):
    from trainwright.model.build import check_data

    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "a single short document"}))
    cfg = tiny_config(tmp_path, **{"data.name": '"hf"', "data.val_fraction": 0.0,
                                   "data.dataset": f'"{tmp_path / "one.jsonl"}"',
                                   "parallel.dp": 2, "train.micro_batches": 2})
    with pytest.raises(ConfigError, match="too few training documents for one window"):
        check_data(cfg)


def _run_cli(tmp_path, *sets, env=None):
    cmd = [sys.executable, "-m", "trainwright", "run", "--set", "data.name=\"hf\"",
           "--set", f'run.dir="{tmp_path}"', "--set", "train.steps=1", *sets]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170, env=env)


def test_bad_hf_input_is_one_line_and_exit_2(sources, tmp_path):
    missing = _run_cli(tmp_path, "--set", f'data.dataset="{tmp_path / "nope.jsonl"}"')
    field = _run_cli(tmp_path, "--set", f'data.dataset="{sources["jsonl"]}"')
    for res, words in ((missing, "does not exist; give a folder written by "
                                 "Dataset.save_to_disk"),
                       (field, "data.text_field = 'text' is not a column")):
        assert res.returncode == 2, res.stderr[-2000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], res.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_without_datasets_the_config_error_names_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the datasets package; pip install "
                                          r"'trainwright\[hf-data\]'"):
        tiny_config(tmp_path, **{"data.name": '"hf"', "data.dataset": f'"{tmp_path}"'})


@pytest.mark.timeout(600)
def test_pp2_dp2_equals_the_reference_and_resumes_bit_for_bit(sources, tmp_path):
    jobs, checks = [], []
    for kind, spec in sources.items():
        kw = {"data.name": '"hf"', "data.dataset": f'"{spec}"', "data.text_field": '"body"',
              "parallel.pp": 2, "parallel.dp": 2, "train.micro_batches": 2,
              "train.steps": 4}
        (full, d_full, d_cut), more = resume_pair(tmp_path / kind, 2, **kw)
        jobs += more
        checks.append((kind, full, d_full, d_cut))
    run_recording_sparse(tmp_path, jobs, 560)
    for kind, full, d_full, d_cut in checks:
        check_against_reference(full, d_full)
        assert_bitwise(d_full, d_cut, kind)
        # every rank saved its own replica's position (what the resume continued from)
        stored = torch.distributed.checkpoint.FileSystemReader(
            d_cut / "checkpoints" / "step_000002").read_metadata().state_dict_metadata
        assert {f"extra.data.rank{r}" for r in range(4)} <= set(stored), sorted(stored)
