"""Tests of trainwright.observe.report: a full synthetic run, damaged or partial run dirs."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from trainwright.observe.report import load_metrics, write_report

IMG = '<img src="data:image/png;base64,'
HEADINGS = [
    "Summary",
    "Loss and throughput",
    "Pipeline timeline",
    "Activation memory per stage",
    "Compute vs idle per stage",
    "Per-layer time",
    "Per-layer saved activations",
]
LOSSES = [5.4321, 4.1234, 3.2109]
STAGES, MICRO, STEPS = 2, 4, 3
LAYER_NAMES = ["Embedding", "Block", "Block", "Block", "Block", "Head"]


def _metrics_lines(steps: int = STEPS, end: bool = True) -> list[str]:
    run = {
        "kind": "run",
        "config": {"model": {"name": "gpt", "n_blocks": 4}, "optim": {"lr": 0.01}},
        "world_size": 2,
        "pp": 2,
        "dp": 1,
        "schedule": "1f1b",
        "partition": [[0, 1, 2], [3, 4, 5]],
        "layer_names": LAYER_NAMES,
        "started": "2026-11-22T12:00:00",
        "future_key": {"ignored": True},
    }
    lines = [run]
    for s in range(1, steps + 1):
        lines.append(
            {
                "kind": "step",
                "step": s,
                "loss": LOSSES[s - 1],
                "samples_per_s": 100.0 + 10 * s,
                "step_time_s": 0.5,
                "bubble_fraction": 0.2,
                "stages": [
                    {
                        "stage": st,
                        "compute_s": 0.4 - 0.05 * st,
                        "idle_s": 0.1 + 0.05 * st,
                        "activation_peak_bytes": (MICRO - st) * 1_048_576 * s,
                        "held_microbatches_peak": MICRO - st,
                    }
                    for st in range(STAGES)
                ],
            }
        )
        lines.append({"kind": "gpu_temp", "step": s, "celsius": 60})  # unknown kind
    layers = [
        {
            "layer": i,
            "name": name,
            "stage": 0 if i < 3 else 1,
            "forward_s": 0.001 * (i + 1),
            "backward_s": 0.002 * (i + 1),
            "saved_bytes": 4096 * (i + 1),
            "output_bytes": 4096,
            "param_bytes": 65536,
        }
        for i, name in enumerate(LAYER_NAMES)
    ]
    lines.append({"kind": "layers", "step": steps, "layers": layers})
    if end:
        lines.append({"kind": "end", "steps": steps, "final_loss": LOSSES[steps - 1], "wall_s": 2})
    return [json.dumps(x) for x in lines]


def _trace(steps: int = STEPS) -> dict:
    """A 1F1B trace: rank r runs stage r; each F/B is 10 ms, each send/recv 1 ms."""
    events: list[dict] = []
    t = 0.0

    def ev(rank: int, kind: str, start: float, dur: float, step: int, mb: int | None) -> None:
        name = f"{kind}{mb}" if mb is not None else kind
        args = {"step": step, "stage": rank, "kind": kind}
        if mb is not None:
            args["mb"] = mb
        events.append(
            {"name": name, "ph": "X", "ts": start, "dur": dur, "pid": rank, "tid": 0, "args": args}
        )

    for step in range(1, steps + 1):
        f, b = 10_000.0, 20_000.0
        for mb in range(MICRO):
            ev(0, "F", t + mb * f, f, step, mb)
            ev(0, "SEND_F", t + (mb + 1) * f, 1000.0, step, mb)
            ev(1, "RECV_F", t + (mb + 1) * f, 1000.0, step, mb)
            ev(1, "F", t + (mb + 1) * f + 1000, f, step, mb)
        start_b1 = t + (MICRO + 1) * f + 1000
        for mb in range(MICRO):
            ev(1, "B", start_b1 + mb * b, b, step, mb)
            ev(1, "SEND_B", start_b1 + (mb + 1) * b, 1000.0, step, mb)
            ev(0, "RECV_B", start_b1 + (mb + 1) * b, 1000.0, step, mb)
            ev(0, "B", start_b1 + (mb + 1) * b + 1000, b, step, mb)
        end = start_b1 + (MICRO + 1) * b + 1000
        for r in range(STAGES):
            ev(r, "SYNC", end, 2000.0, step, None)
            ev(r, "STEP", end + 2000, 3000.0, step, None)
        t = end + 10_000
    meta = [
        {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} (stage {r})"}}
        for r in range(STAGES)
    ]
    return {"traceEvents": events + meta, "displayTimeUnit": "ms"}


def _write_run(tmp_path: Path, metrics: list[str], trace: dict | None) -> Path:
    (tmp_path / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    if trace is not None:
        (tmp_path / "trace.json").write_text(json.dumps(trace))
    return tmp_path


def _pngs(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'base64,([A-Za-z0-9+/=]+)"', page)]


@pytest.mark.timeout(60)
def test_full_report(tmp_path: Path) -> None:
    run = _write_run(tmp_path, _metrics_lines(), _trace())
    out = write_report(run)
    assert out == run / "report.html" and out.is_file()
    page = out.read_text()
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in page
    assert page.count(IMG) >= 4
    assert page.count(IMG) == len(HEADINGS) - 1  # every plot section drew its plot
    assert all(png.startswith(b"\x89PNG\r\n\x1a\n") for png in _pngs(page))
    summary = page.split("<h2>Loss and throughput</h2>")[0]
    for loss in (LOSSES[0], LOSSES[-1]):
        assert str(loss) in summary
    for text in ("1f1b", "stage 0: [0, 1, 2]", "Block×2", "median samples/s", "20.0%"):
        assert text in summary
    assert 'class="note"' not in page and "Could not draw" not in page
    assert "rank 1 (stage 1)" not in page  # labels live inside the PNG, not the HTML
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html", "trace.json"]


@pytest.mark.timeout(60)
def test_truncated_metrics_no_trace(tmp_path: Path) -> None:
    lines = _metrics_lines(steps=2, end=False)
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # the crash cut the layers record in half
    run = _write_run(tmp_path, lines, trace=None)
    page = write_report(str(run)).read_text()
    assert "last line is truncated" in page
    assert "No trace.json" in page
    assert "no end record" in page
    assert str(LOSSES[0]) in page and str(LOSSES[1]) in page
    assert page.count(IMG) >= 3  # loss and the two per-stage plots still render
    assert "No layer profile was recorded." in page
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "report.html"]


@pytest.mark.timeout(60)
def test_only_truncated_first_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "run", "config": {"pp": 2')
    page = write_report(tmp_path).read_text()
    assert "last line is truncated" in page
    assert "No step records" in page
    assert IMG not in page
    for heading in HEADINGS:
        assert f"<h2>{heading}</h2>" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "report.html"]


@pytest.mark.timeout(60)
def test_empty_dir_and_bad_trace(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text('{"traceEvents": [{"name": "F0", "ph": "X", "ts": 1')
    page = write_report(tmp_path).read_text()
    assert "No metrics" in page and "Cannot read trace.json" in page
    assert IMG not in page


@pytest.mark.timeout(60)
def test_partial_last_step_and_resume(tmp_path: Path) -> None:
    lines = _metrics_lines()
    lines += lines[:2]  # resumed: a second run record, step 1 logged again
    trace = _trace()
    # the crash lost step 3's STEP events on rank 1: step 2 is the last complete one
    trace["traceEvents"] = [
        e
        for e in trace["traceEvents"]
        if not (e.get("args", {}).get("step") == 3 and e["args"].get("kind") == "STEP")
    ]
    _write_run(tmp_path, lines, trace)
    page = write_report(tmp_path).read_text()
    assert "Step 2, one row per rank" in page
    assert "<td>resumes</td><td>1</td>" in page
    assert "<td>steps logged</td><td>3</td>" in page


@pytest.mark.timeout(60)
def test_load_metrics_dedupes_and_ignores_unknown(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(_metrics_lines() + ["not json", '{"kind": "end"}', "[1, 2]"]))
    m = load_metrics(path)
    assert [s["step"] for s in m.steps] == [1, 2, 3]
    assert len(m.runs) == 1 and m.layers is not None and m.end == {"kind": "end"}
    assert any("is not valid JSON" in n for n in m.notes)


@pytest.mark.timeout(60)
def test_missing_run_dir(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError):
        write_report(tmp_path / "nope")


@pytest.mark.timeout(30)
def test_progress_to_a_log_file_prints_plain_lines(capsys) -> None:
    from trainwright.observe.progress import RunProgress, StepProgress

    runs = RunProgress("bench pipeline", 3)  # pytest's stderr is not a terminal
    for i in range(1, 4):
        runs.update(i, f"run {i}: median step 1.0 ms")
    runs.close()
    steps = StepProgress(total=20)
    for step in range(1, 21):
        steps.update(step, 2.0 / step, 10.0)
    steps.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [f"bench pipeline: {i}/3 run {i}: median step 1.0 ms" for i in (1, 2, 3)]
    assert lines[3:] == [f"step {s}/20  loss {2.0 / s:.4f}  10.0 samples/s"
                         for s in range(2, 21, 2)]  # every tenth of the run, and the last
