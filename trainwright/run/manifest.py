"""What makes a checkpoint complete: its manifest, written last, and how resume checks it.

A checkpoint is written under a temporary name, ``checkpoints/.step_000120.tmp/``; when every
rank's files and the metadata are in place, rank 0 writes ``manifest.json`` (each file's
size and CRC-32) into it and renames the folder to ``step_000120``. So:

* a folder still named ``.step_*.tmp`` is a save that never finished (the run stopped
  while saving it);
* a ``step_*`` folder whose files disagree with its manifest (or has no readable manifest)
  was damaged afterwards (a truncated copy, a deleted file, a full disk);
* resume takes the newest checkpoint that passes, names every newer one that does not in
  one line, and stops (exit 2, naming them) when none passes.

:func:`verify` checks one checkpoint; :func:`scan` every checkpoint of a run;
:func:`choose_resume` is what the launcher runs before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from trainwright.errors import ConfigError

__all__ = ["MANIFEST", "write_manifest", "verify", "CheckpointStatus", "scan",
           "resume_step", "choose_resume", "temp_dir", "final_dir", "set_aside",
           "remove_temporary", "committed_steps", "verify_run"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FINAL = re.compile(r"^step_(\d{6,})$")
_TEMP = re.compile(r"^\.step_(\d{6,})\.tmp$")


def final_dir(run_dir: Path, step: int) -> Path:
    """Where the complete checkpoint of ``step`` lives."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def temp_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written until its manifest completes it."""
    return Path(run_dir) / "checkpoints" / f".step_{step:06d}.tmp"


def _crc32(path: Path) -> str:
    crc, buf = 0, bytearray(1 << 22)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# what a manifest's files are checked by: CRC-32 (catches truncation and flipped bits, a
# checkpoint's risks, at twice SHA-256's speed); "sha256": manifests written before format 2
_CHECKSUMS = {"crc32": _crc32, "sha256": _sha256}


def write_manifest(d: Path, step: int) -> dict:
    """Record every file of the checkpoint folder ``d`` (size and CRC-32), atomically, as
    its last file. Rank 0 calls it once every rank's files are written."""
    files = {}
    for f in sorted(p for p in Path(d).iterdir() if p.is_file() and p.name != MANIFEST
                    and not p.name.endswith(".tmp")):
        files[f.name] = {"size": f.stat().st_size, "crc32": _crc32(f)}
    manifest = {"format": 2, "step": step, "files": files}
    tmp = Path(d) / f".{MANIFEST}.tmp"
    with tmp.open("w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, Path(d) / MANIFEST)
    return manifest


def verify(d: Path, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint folder ``d``, in a few words naming the file, or
    None when every file its manifest lists is there with its size (and, with
    ``checksums``, its checksum)."""
    d = Path(d)
    if _TEMP.match(d.name):
        return "incomplete: the run stopped while saving it (no manifest was written)"
    m = d / MANIFEST
    if not m.is_file():
        return f"incomplete: {m} is missing"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError) as exc:
        return f"{m} is unreadable ({type(exc).__name__})"
    for name, want in files.items():
        f = d / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f} has {size} bytes, the manifest says {want['size']}"
        kind = next((k for k in _CHECKSUMS if k in want), None)
        if kind is None:
            return f"{m} lists no checksum for {name}"
        if checksums and _CHECKSUMS[kind](f) != want[kind]:
            return f"{f} does not match its checksum"
    return None


@dataclass(frozen=True)
class CheckpointStatus:
    """One checkpoint of a run and what is wrong with it (``problem`` None: intact)."""

    step: int
    path: Path
    problem: str | None

    @property
    def intact(self) -> bool:
        """True when its files match its manifest."""
        return self.problem is None


def _folders(run_dir: Path) -> list[tuple[int, Path]]:
    ck = Path(run_dir) / "checkpoints"
    if not ck.is_dir():
        return []
    out = []
    for d in ck.iterdir():
        hit = _FINAL.match(d.name) or _TEMP.match(d.name)
        if hit and d.is_dir():
            out.append((int(hit.group(1)), d))
    # newest first; at one step the complete folder before a leftover temporary one
    return sorted(out, key=lambda sd: (-sd[0], bool(_TEMP.match(sd[1].name))))


def scan(run_dir: Path, checksums: bool = True) -> list[CheckpointStatus]:
    """Every checkpoint of ``run_dir`` (complete and temporary), newest first, verified."""
    return [CheckpointStatus(step, d, verify(d, checksums)) for step, d in _folders(run_dir)]


def _latest(run_dir: Path) -> int | None:
    """The step ``checkpoints/latest`` names (moved after each completed checkpoint; a
    user may point it back to resume from an earlier one), None when absent or unreadable."""
    try:
        return int((Path(run_dir) / "checkpoints" / "latest").read_text().strip())
    except (OSError, ValueError):
        return None


def _resumable(st: CheckpointStatus, latest: int | None) -> bool:
    return st.intact and (latest is None or st.step <= latest)


def resume_step(run_dir: Path) -> int | None:
    """The newest complete checkpoint, not past ``latest``, whose files have their
    manifest's sizes (what every rank resumes from; the launcher has checked the checksums
    and set aside the damaged ones, :func:`choose_resume`), or None when there is none."""
    latest = _latest(run_dir)
    return next((st.step for st in scan(run_dir, checksums=False) if _resumable(st, latest)),
                None)


def choose_resume(run_dir: Path, set_aside: bool = True) -> int | None:
    """The checkpoint a resumed run starts from: the newest one (not past ``latest``) whose
    files all match its manifest. Each newer checkpoint that does not is named in one
    warning line and, with ``set_aside``, renamed ``step_N.damaged`` (a temporary one
    removed), so the ranks and the run's next saves never meet it. None when the run has
    no checkpoint at all.

    Raises:
        ConfigError: the run has checkpoints and none is intact (names each one).
    """
    found, latest = scan(run_dir), _latest(run_dir)
    good = next((st for st in found if _resumable(st, latest)), None)
    bad = [st for st in found if not st.intact and (good is None or st.step > good.step)]
    if found and good is None:
        raise ConfigError(
            f"--resume {run_dir}: no intact checkpoint: "
            + "; ".join(f"step {st.step}: {st.problem}" for st in bad)
            + ". Start a new run (or restore the checkpoints folder from a copy)")
    for st in bad:
        log.warning("checkpoint of step %d is damaged (%s); resuming from step %d, the newest "
                    "intact one", st.step, st.problem, good.step)
        if set_aside:
            _set_aside(st)
    return None if good is None else good.step


def _set_aside(st: CheckpointStatus) -> None:
    if _TEMP.match(st.path.name):
        shutil.rmtree(st.path, ignore_errors=True)
        return
    set_aside(st.path)


def set_aside(d: Path) -> Path:
    """Rename the checkpoint folder ``d`` to ``<name>.damaged`` (replacing an older one)."""
    aside = d.with_name(d.name + ".damaged")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(d, aside)
    return aside


def remove_temporary(run_dir: Path) -> None:
    """Delete the folders of saves that never finished (rank 0, before its first save)."""
    for _, d in _folders(run_dir):
        if _TEMP.match(d.name):
            shutil.rmtree(d, ignore_errors=True)


def committed_steps(run_dir: Path) -> list[int]:
    """Steps of the complete (renamed) checkpoint folders, oldest first."""
    return sorted(step for step, d in _folders(run_dir) if _FINAL.match(d.name))


def verify_run(run_dir: Path) -> tuple[list[str], int]:
    """``trainwright checkpoint verify RUN_DIR``: one line per checkpoint (newest first),
    then what ``--resume`` would do; exit code 0 when every checkpoint is intact, else 1.

    Raises:
        ConfigError: ``run_dir`` has no checkpoints folder.
    """
    if not (Path(run_dir) / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir} has no checkpoints folder; pass a run directory that "
                          f"`trainwright run` printed")
    found = scan(run_dir)
    lines = [f"step {st.step}: {'intact' if st.intact else 'DAMAGED: ' + st.problem} "
             f"({st.path.name})" for st in found]
    good = next((st.step for st in found if st.intact), None)
    if good is None:
        lines.append("no intact checkpoint: --resume would stop (exit 2)")
    else:
        lines.append(f"--resume continues from step {good}")
    return lines, 0 if all(st.intact for st in found) else 1
