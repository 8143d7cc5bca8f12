"""Checkpoints that never strand a run (issue 36, item 4).

* each checkpoint is completed by a manifest; a truncated ``.distcp``, a truncated manifest
  or a deleted file makes it damaged, named in one line, and resume falls back to the
  previous one, bit for bit equal to the uninterrupted run; none intact is exit 2 in one
  line; ``trainwright checkpoint verify`` says the same;
* a ``run.dir`` that cannot be created is exit 2 in one line, before any rank starts;
* ``run.async_checkpoint`` trains bit for bit as blocking saves do, and a run killed in the
  middle of an async save resumes from the previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tests.conftest import tiny_overrides
from tests.helpers import assert_bitwise
from trainwright.cli.main import main
from trainwright.errors import ConfigError
from trainwright.run import checkpoint, manifest

PP2 = {"parallel.pp": 2, "train.steps": 4, "run.checkpoint_every": 1,
       "train.micro_batches": 2, "train.momentum": 0.9}


def _damage(kind: str, d):
    """Damage the checkpoint folder ``d`` as a user (or a full disk) might."""
    if kind == "truncated distcp":
        f = sorted(d.glob("*.distcp"))[-1]
        os.truncate(f, f.stat().st_size // 2)
    elif kind == "truncated manifest":
        f = d / "manifest.json"
        os.truncate(f, f.stat().st_size - 20)
    else:  # a deleted file
        (d / ".metadata").unlink()


def _save_tiny(run_dir, step: int) -> None:
    state = {"w": torch.full((64,), float(step)), "extra.note": ({"step": step},)}
    checkpoint.save(run_dir, step, state, {"pp": 1, "dp": 1})


@pytest.mark.parametrize("kind", ["truncated distcp", "truncated manifest", "deleted file"])
def test_each_damage_is_named_and_the_previous_checkpoint_chosen(tmp_path, kind, caplog,
                                                                 capsys):
    for step in (1, 2):
        _save_tiny(tmp_path, step)
    d2 = manifest.final_dir(tmp_path, 2)
    assert (d2 / "manifest.json").is_file() and not manifest.temp_dir(tmp_path, 2).exists()
    assert [s.step for s in manifest.scan(tmp_path) if s.intact] == [2, 1]
    assert main(["checkpoint", "verify", str(tmp_path)]) == 0
    _damage(kind, d2)
    problem = manifest.verify(d2)
    assert problem and str(d2) in problem, problem
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-3].startswith("step 2: DAMAGED") and out[-1] == "--resume continues from step 1"
    with caplog.at_level(logging.WARNING):
        assert manifest.choose_resume(tmp_path) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "step 2 is damaged" in warned[0] and "resuming from step 1" in warned[0]
    assert not d2.exists() and d2.with_name("step_000002.damaged").is_dir()  # set aside
    assert manifest.resume_step(tmp_path) == 1
    # the same step saved again replaces nothing intact
    _save_tiny(tmp_path, 2)
    assert manifest.verify(d2) is None


def test_no_intact_checkpoint_is_one_config_error_naming_each(tmp_path, capsys):
    for step in (1, 2):
        _save_tiny(tmp_path, step)
    _damage("deleted file", manifest.final_dir(tmp_path, 2))
    _damage("truncated distcp", manifest.final_dir(tmp_path, 1))
    with pytest.raises(ConfigError, match=r"no intact checkpoint: step 2: .*\.metadata is "
                                          r"missing; step 1: .*__0_0\.distcp has"):
        manifest.choose_resume(tmp_path)
    assert manifest.final_dir(tmp_path, 2).is_dir()  # nothing moved
    assert main(["checkpoint", "verify", str(tmp_path)]) == 1
    assert "no intact checkpoint" in capsys.readouterr().out
    # an unfinished save (a temporary folder) is incomplete, never resumable
    shutil.copytree(manifest.final_dir(tmp_path, 1), manifest.temp_dir(tmp_path, 3))
    assert manifest.scan(tmp_path)[0].problem.startswith("incomplete: the run stopped")


def test_a_run_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path, capfd):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code = main(["run", *sum((["--set", o] for o in tiny_overrides(blocker / "runs")), [])])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: run.dir") and "Not a directory" in err[0], err
    assert "--set run.dir=PATH" in err[0]
    if os.geteuid() != 0:  # root writes anywhere: no permission test there
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        code = main(["run", *sum((["--set", o] for o in tiny_overrides(locked / "r")), [])])
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "Permission denied" in err[0], err


@pytest.mark.timeout(120)
def test_under_torchrun_an_uncreatable_run_dir_stops_every_rank_in_one_line(tmp_path):
    import subprocess
    import sys

    from trainwright.dist.ports import free_port

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    sets = [x for o in tiny_overrides(blocker / "runs") for x in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), "-m", "trainwright.cli",
                           "run", *sets], capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    ours = [x for x in proc.stderr.splitlines() if x.startswith("error: run.dir")]
    # each rank says why in one line (rank 1 does not wait for a directory that never
    # comes), and none prints a traceback of ours (torchrun's own summary follows)
    assert len(ours) == 2 and "Not a directory" in ours[0], proc.stderr[-3000:]
    assert "trainwright/" not in proc.stderr.split("ChildFailedError")[0], proc.stderr[-3000:]


def _run(tmp_path, name: str, capfd, resume=None, **kw) -> tuple[int, list[str]]:
    sets = tiny_overrides(tmp_path / "runs", **{**PP2, **kw, "run.name": f'"{name}"'})
    if resume is not None:  # the run keeps its config: the steps change, no fault again
        sets = [f"train.steps={PP2['train.steps']}", "fault.kill_rank=-1"]
    argv = ["run"] + (["--resume", str(resume)] if resume is not None else [])
    code = main(argv + sum((["--set", o] for o in sets), []))
    return code, capfd.readouterr().err.splitlines()


@pytest.mark.timeout(600)
def test_damaged_newest_checkpoint_resumes_from_the_previous_bit_for_bit(tmp_path, capfd):
    full = tmp_path / "runs" / "full"
    assert _run(tmp_path, "full", capfd)[0] == 0
    assert _run(tmp_path, "cut", capfd, **{"train.steps": 3})[0] == 0
    cut = tmp_path / "runs" / "cut"
    for kind in ("truncated distcp", "truncated manifest", "deleted file"):
        d = tmp_path / "runs" / kind.replace(" ", "_")
        shutil.copytree(cut, d)
        _damage(kind, manifest.final_dir(d, 3))
        code, err = _run(tmp_path, "", capfd, resume=d)
        assert code == 0, err
        warned = [line for line in err if "is damaged" in line]
        assert len(warned) == 1 and "step 3 is damaged" in warned[0], err
        assert "resuming from step 2" in warned[0]
        assert not any("Traceback" in line for line in err), err
        assert_bitwise(full, d, kind)
    # every checkpoint damaged: one line, exit 2, no rank started
    d = tmp_path / "runs" / "deleted_file"
    for step in manifest.committed_steps(d):
        _damage("deleted file", manifest.final_dir(d, step))
    code, err = _run(tmp_path, "", capfd, resume=d)
    assert code == 2 and len(err) == 1 and "no intact checkpoint" in err[0], err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_async_saves_train_bit_identically_and_a_kill_mid_save_resumes(tmp_path, capfd):
    assert _run(tmp_path, "sync", capfd)[0] == 0
    assert _run(tmp_path, "async", capfd, **{"run.async_checkpoint": "true"})[0] == 0
    sync, asyn = tmp_path / "runs" / "sync", tmp_path / "runs" / "async"
    assert_bitwise(sync, asyn, "async")
    assert [s.step for s in manifest.scan(asyn) if s.intact] == [4, 3]
    # rank 0 dies in step 4's save: its files written, the checkpoint not completed
    code, err = _run(tmp_path, "killed", capfd, **{
        "run.async_checkpoint": "true", "fault.kill_rank": 0, "fault.kill_step": 4,
        "fault.kill_before": '"SAVE"', "runtime.peer_timeout_s": 2.0})
    killed = tmp_path / "runs" / "killed"
    assert code != 0 and any("rank 0 was killed by SIGKILL" in line for line in err), err
    newest = manifest.scan(killed)[0]
    assert newest.step == 4 and newest.problem.startswith("incomplete"), newest
    code, err = _run(tmp_path, "", capfd, resume=killed)
    assert code == 0, err
    warned = [line for line in err if "is damaged" in line]
    assert len(warned) == 1 and "resuming from step 3" in warned[0], err
    assert_bitwise(sync, killed, "killed mid-save")


def test_latest_pointed_back_caps_the_resume(tmp_path):
    """``checkpoints/latest`` pointed back by hand resumes from there, not from a newer
    intact checkpoint (tests rewind a run this way)."""
    for step in (1, 2):
        _save_tiny(tmp_path, step)
    assert manifest.resume_step(tmp_path) == 2
    checkpoint.mark_latest(tmp_path, 1)
    assert manifest.resume_step(tmp_path) == 1 == manifest.choose_resume(tmp_path)
    assert manifest.final_dir(tmp_path, 2).is_dir()  # intact: not set aside


def test_a_manifest_written_with_sha256_before_format_2_still_verifies(tmp_path):
    import hashlib
    import json

    _save_tiny(tmp_path, 1)
    d = manifest.final_dir(tmp_path, 1)
    m = json.loads((d / manifest.MANIFEST).read_text())
    assert m["format"] == 2 and all("crc32" in f for f in m["files"].values())
    for name, f in m["files"].items():  # what format 1 recorded
        del f["crc32"]
        f["sha256"] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / manifest.MANIFEST).write_text(json.dumps({**m, "format": 1}))
    assert manifest.verify(d) is None
    f = sorted(d.glob("*.distcp"))[-1]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit's worth: same size, other bytes
    f.write_bytes(bytes(data))
    assert "does not match its checksum" in manifest.verify(d)
