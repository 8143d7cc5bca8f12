"""Checkpoints that hold a run's whole state, under global names, with
``torch.distributed.checkpoint`` (DCP).

Layout: ``RUN_DIR/checkpoints/step_000120/`` is one DCP checkpoint (``.metadata`` plus the
``*.distcp`` files every rank wrote), ``meta.json`` beside it (step, ``pp x dp``, the
partition a migration reached, a pending re-partition target), and
``RUN_DIR/checkpoints/latest`` names the last complete one. A checkpoint is written under a
temporary name and completed by its manifest, written last, then renamed into place
(:mod:`~trainwright.run.manifest`; :mod:`~trainwright.run.ckpt_writer` saves blocking or in
the background).

Every entry is named by what it is, never by who wrote it, so resuming at another
``pp x dp`` is a re-mapping: each rank asks DCP for the entries of the layers it holds.

* ``model.layer{i}.{name}``: layer ``i``'s parameters and buffers (replicas write one copy:
  DCP de-duplicates equal names);
* ``optim.layer{i}.{param}.{key}`` and ``optim.layer{i}.param_groups``: layer ``i``'s
  optimizer state, per parameter (a sharded optimizer gathers its state into this form
  first, :meth:`~trainwright.sync.base.GradSync.full_state`);
* ``extra.{name}`` (``extra.{name}.rank{r}`` when per rank): any object with
  ``state_dict()`` / ``load_state_dict()`` registered with
  :meth:`~trainwright.run.trainer.Trainer.register_state` (LR scheduler, grad scaler,
  a stateful data source);
* ``rng.rank{r}``: each rank's torch (CPU and CUDA), Python and NumPy RNG states, restored
  when the job resumes with the same number of ranks.

The data position is the step: every dataset is a function of the step number.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainwright.pipeline.stage import LayerSlot
from trainwright.run.manifest import committed_steps, set_aside, temp_dir, write_manifest

__all__ = ["layer_state", "rng_state", "extra_state", "rank_state",
           "checkpoint_meta", "write_files", "commit", "save", "write_meta", "read_meta",
           "mark_latest", "latest_step", "load_layers", "load_state", "prune"]

log = logging.getLogger(__name__)


def _dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def _opaque(value) -> tuple:
    """Wrap a non-tensor value so DCP stores it as one pickled item (it walks into dicts)."""
    return (value,)


# ----------------------------------------------------------------------------- writing

def _optimizer_entries(slot: LayerSlot) -> dict:
    opt, prefix = slot.optimizer, f"optim.layer{slot.index}"
    names = {id(p): n for n, p in slot.module.named_parameters()}
    ordered = [p for g in opt.param_groups for p in g["params"]]
    sd = opt.state_dict()
    out: dict = {f"{prefix}.param_groups": _opaque(
        [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])}
    for i, st in sd["state"].items():
        name = names[id(ordered[i])]
        for key, v in st.items():
            out[f"{prefix}.{name}.{key}"] = v if isinstance(v, torch.Tensor) else _opaque(v)
    return out


def layer_state(slots: list[LayerSlot]) -> dict:
    """Parameters, buffers and optimizer state of ``slots`` under global names."""
    out: dict = {}
    for slot in slots:
        for k, v in slot.module.state_dict().items():
            out[f"model.layer{slot.index}.{k}"] = v
        if slot.optimizer is not None:
            out.update(_optimizer_entries(slot))
    return out


def rng_state(rank: int) -> dict:
    """This rank's RNG states (torch CPU and CUDA, Python, NumPy when imported)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    np_state = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    return {f"rng.rank{rank}": _opaque((torch.get_rng_state(), cuda, random.getstate(),
                                        np_state))}


def extra_state(objects: dict[str, tuple[object, bool]], rank: int) -> dict:
    """``extra.*`` entries of the registered ``{name: (object, per_rank)}``."""
    return {_extra_key(name, per_rank, rank): _opaque(obj.state_dict())
            for name, (obj, per_rank) in objects.items()}


def _extra_key(name: str, per_rank: bool, rank: int) -> str:
    return f"extra.{name}.rank{rank}" if per_rank else f"extra.{name}"


def write_files(run_dir: Path, step: int, state: dict, *, group=None) -> Path:
    """Write this rank's ``state`` into the temporary folder of the checkpoint of ``step``
    (returned); collective over ``group`` (default: the default group) when there is one.
    Saving in the background is :class:`~trainwright.run.ckpt_writer.CheckpointWriter`'s."""
    d = temp_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # one process: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save(state, checkpoint_id=d, process_group=group, no_dist=not dist.is_initialized())
    return d


def commit(run_dir: Path, step: int, meta: dict) -> Path:
    """Rank 0, once every rank's files of ``step`` are written: ``meta.json``, then the
    manifest (:mod:`~trainwright.run.manifest`), then the rename into place; ``latest``
    moves and older checkpoints are pruned."""
    d, final = temp_dir(run_dir, step), _dir(run_dir, step)
    _write_json(d / "meta.json", {"step": step, **meta})
    write_manifest(d, step)
    if final.exists():  # a damaged one a direct resume left in place
        log.warning("checkpoint of step %d: the older folder there moved to %s", step,
                    set_aside(final))
    os.replace(d, final)
    mark_latest(run_dir, step)
    prune(run_dir)
    return final


def save(run_dir: Path, step: int, state: dict, meta: dict | None = None) -> Path:
    """Write this rank's ``state`` into the checkpoint of ``step`` and (rank 0) complete it;
    blocking, collective over the default group when there is one (every rank calls it,
    each with its own entries)."""
    write_files(run_dir, step, state)
    if not dist.is_initialized() or dist.get_rank() == 0:
        commit(run_dir, step, meta or {})
    return _dir(run_dir, step)


def checkpoint_meta(topo, partition: list[int], rebalance_target: list[int] | None) -> dict:
    """What ``meta.json`` records: the mesh, its stage-to-rank mapping and the partition (a
    pending re-partition target too)."""
    return dict(pp=topo.pp, dp=topo.dp, world_size=topo.world_size, mapping=list(topo.order),
                partition=partition, rebalance_target=rebalance_target)


def rank_state(layers: dict, objects: dict[str, tuple[object, bool]], rank: int) -> dict:
    """One rank's part of a checkpoint: its ``layers`` (:func:`layer_state`), its RNG
    states and the registered ``objects``."""
    state = dict(layers)
    state.update(rng_state(rank))
    state.update(extra_state(objects, rank))
    return state


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value) + "\n")
    os.replace(tmp, path)


def write_meta(run_dir: Path, step: int, meta: dict) -> None:
    """Rewrite ``meta.json`` of a complete checkpoint (the small facts needed before the
    layers are built: partition, mesh)."""
    _write_json(_dir(run_dir, step) / "meta.json", {"step": step, **meta})


def read_meta(run_dir: Path, step: int) -> dict:
    """``meta.json`` of a checkpoint ({} for one written before it existed)."""
    f = _dir(run_dir, step) / "meta.json"
    return json.loads(f.read_text()) if f.exists() else {}


def mark_latest(run_dir: Path, step: int) -> None:
    """Point ``latest`` at ``step`` (call after every rank's part is written)."""
    ck = Path(run_dir) / "checkpoints"
    tmp = ck / ".latest.tmp"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, ck / "latest")


def latest_step(run_dir: Path) -> int | None:
    """Step of the last complete checkpoint, or None if there is none."""
    f = Path(run_dir) / "checkpoints" / "latest"
    return int(f.read_text().strip()) if f.exists() else None


def prune(run_dir: Path, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` complete checkpoints."""
    for step in committed_steps(run_dir)[:-keep]:
        shutil.rmtree(_dir(run_dir, step), ignore_errors=True)


# ----------------------------------------------------------------------------- reading

def _template(stored: dict, key: str, live=None):
    """Where DCP loads ``key``: the live tensor (in place), or a fresh one / placeholder."""
    if live is not None:
        return live
    md = stored[key]
    if hasattr(md, "size") and hasattr(md, "properties"):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def _layer_requests(stored: dict, slots: list[LayerSlot], with_optim: bool,
                    where: str) -> dict:
    want: dict = {}
    for slot in slots:
        for k, v in slot.module.state_dict().items():
            key = f"model.layer{slot.index}.{k}"
            if key not in stored:
                raise FileNotFoundError(f"checkpoint {where} has no {key} (layer {slot.index}, "
                                        f"{slot.name}); was it written by a different model?")
            want[key] = v
        if with_optim and slot.optimizer is not None:
            prefix = f"optim.layer{slot.index}."
            want.update({k: _template(stored, k) for k in stored if k.startswith(prefix)})
    return want


def _load_optimizer(slot: LayerSlot, got: dict) -> None:
    prefix = f"optim.layer{slot.index}."
    if prefix + "param_groups" not in got:
        return
    opt = slot.optimizer
    names = {id(p): n for n, p in slot.module.named_parameters()}
    ordered = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, name in enumerate(ordered):
        pre = f"{prefix}{name}."
        st = {k[len(pre):]: (v[0] if isinstance(v, tuple) else v)
              for k, v in got.items() if k.startswith(pre) and "." not in k[len(pre):]}
        if st:
            state[i] = st
    groups = got[prefix + "param_groups"][0]
    current = opt.state_dict()["param_groups"]
    opt.load_state_dict({"state": state, "param_groups": [
        {**g, "params": c["params"]} for g, c in zip(groups, current, strict=True)]})


def load_state(run_dir: Path, step: int, slots: list[LayerSlot], *, with_optim: bool = True,
               objects: dict[str, tuple[object, bool]] | None = None,
               rank: int | None = None, mesh: tuple | None = None) -> list[str]:
    """Load what ``slots`` (and the registered ``objects``, and this rank's RNG states when
    the checkpoint was written at the same ``(pp, dp[, stage-to-rank mapping])`` mesh) need
    from the checkpoint of ``step``. Collective when a process group exists. Returns what
    was not restored.

    Raises:
        FileNotFoundError: the checkpoint lacks one of the layers (different model).
    """
    d = _dir(run_dir, step)
    if not (d / ".metadata").exists() and list(d.glob("stage_*.pt")):
        return _load_legacy(d, slots)
    stored = dcp.FileSystemReader(d).read_metadata().state_dict_metadata
    want = _layer_requests(stored, slots, with_optim, str(d))
    missing = []
    for name, (_, per_rank) in (objects or {}).items():
        key = _extra_key(name, per_rank, rank or 0)
        if key in stored:
            want[key] = None
        else:
            missing.append(name)
    meta = read_meta(run_dir, step)
    rng_key = f"rng.rank{rank}"
    same_mesh = rank is not None and mesh is not None and \
        (meta.get("pp"), meta.get("dp")) == tuple(mesh[:2]) and \
        (len(mesh) < 3 or meta.get("mapping", list(range(mesh[0]))) == list(mesh[2]))
    if same_mesh and rng_key in stored:
        want[rng_key] = None
    elif rank is not None:
        missing.append("rng")
    with warnings.catch_warnings():  # one process (load_model): DCP says so every time
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(want, checkpoint_id=d, no_dist=not dist.is_initialized())
    if with_optim:
        for slot in slots:
            if slot.optimizer is not None:
                _load_optimizer(slot, want)
    for name, (obj, per_rank) in (objects or {}).items():
        key = _extra_key(name, per_rank, rank or 0)
        if key in want:
            obj.load_state_dict(want[key][0])
    if rng_key in want:
        _set_rng(want[rng_key][0])
    return missing


def _set_rng(states: tuple) -> None:
    cpu, cuda, py, np_state = states
    torch.set_rng_state(cpu)
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if np_state is not None and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(np_state)


def load_layers(run_dir: Path, step: int, slots: list[LayerSlot]) -> None:
    """Load model (and optimizer, where ``slots`` have one) state for ``slots`` from the
    checkpoint of ``step``; one process or every rank of a group."""
    load_state(run_dir, step, slots)


def _load_legacy(d: Path, slots: list[LayerSlot]) -> list[str]:
    """Checkpoints written before DCP: one ``stage_S.pt`` per stage, keyed by layer."""
    merged: dict = {"layers": {}, "optim": {}}
    for f in sorted(d.glob("stage_*.pt")):
        state = torch.load(f, map_location="cpu", weights_only=True)
        merged["layers"].update(state["layers"])
        merged["optim"].update(state["optim"])
    for s in slots:
        if s.index not in merged["layers"]:
            raise FileNotFoundError(f"checkpoint {d} has no layer {s.index} ({s.name}); was "
                                    f"it written by a different model?")
        s.module.load_state_dict(merged["layers"][s.index])
        if s.optimizer is not None and s.index in merged["optim"]:
            s.optimizer.load_state_dict(merged["optim"][s.index])
    return ["rng", "partition"]
