"""Every collective and transfer goes through ``trainwright.dist.collective``, with its tensors
on the device of its group's backend.

Two checks: the source (no module but the helper names a ``torch.distributed`` collective),
and real multi-process runs with every ``torch.distributed`` collective wrapped by a guard
that records a call made from anywhere but the helper, or with a tensor on another device
than :func:`~trainwright.dist.collective.backend_device` names for the call's group.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainwright
from trainwright.dist import collective
from trainwright.dist.testing import run_workers

PACKAGE = Path(trainwright.__file__).parent
HELPER = PACKAGE / "dist" / "collective.py"


def _distributed_aliases(tree: ast.Module) -> tuple[set[str], list[str]]:
    """Names bound to ``torch.distributed``, and ``line name`` of each collective imported
    from it by name."""
    modules, functions = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module and node.module.startswith("torch.distributed") \
                        and a.name in collective.COLLECTIVES:
                    functions.append(f"{node.lineno} from-import {a.name}")
    return modules, functions


def _direct_uses(path: Path) -> list[str]:
    """``file:line name`` of every collective ``path`` reaches without the helper."""
    tree = ast.parse(path.read_text())
    modules, found = _distributed_aliases(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in collective.COLLECTIVES:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in modules:
            found.append(f"{node.lineno} {base.id}.{node.attr}")
        elif (isinstance(base, ast.Attribute) and base.attr == "distributed"
              and isinstance(base.value, ast.Name) and base.value.id == "torch"):
            found.append(f"{node.lineno} torch.distributed.{node.attr}")
    return [f"{path.relative_to(PACKAGE.parent)}:{f}" for f in found]


def test_no_module_calls_a_collective_but_the_helper():
    files = [p for p in PACKAGE.rglob("*.py") if p != HELPER]
    assert len(files) > 50
    direct = [use for p in files for use in _direct_uses(p)]
    assert not direct, f"call these through trainwright.dist.collective: {direct}"


def test_the_source_check_finds_a_direct_call(tmp_path):
    """The check above is not vacuous: each spelling of a direct call is found."""
    bad = tmp_path / "trainwright" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import torch.distributed as d\nimport torch\n"
                   "from torch.distributed import all_reduce\n"
                   "def f(t):\n    d.broadcast(t, 0)\n    torch.distributed.isend(t, 1)\n"
                   "    all_reduce(t)\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "trainwright"
    try:
        uses = _direct_uses(bad)
    finally:
        PACKAGE = saved
    assert len(uses) == 3 and any("d.broadcast" in u for u in uses), uses
    assert any("torch.distributed.isend" in u for u in uses), uses


# ------------------------------------------------------------- the guard on real runs
class Guard:
    """Wraps ``torch.distributed``'s collectives in this process and records misuse."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        for name in collective.COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def check(self, name: str, caller: str, args: tuple, kwargs: dict) -> None:
        """Record ``name`` called from module ``caller`` with these arguments."""
        self.calls[name] = self.calls.get(name, 0) + 1
        if caller != collective.__name__ and not caller.startswith("torch."):
            self.violations.append(f"{name} called directly from {caller}")
        want = collective.backend_device(kwargs.get("group"))
        for t in _tensors([*args, *kwargs.values()]):
            if want is not None and t.device != want:
                self.violations.append(f"{name} from {caller}: tensor on {t.device}, its "
                                       f"group's backend needs {want}")

    def _wrap(self, name: str, fn):
        def guarded(*args, **kwargs):
            self.check(name, sys._getframe(1).f_globals.get("__name__", "?"), args, kwargs)
            return fn(*args, **kwargs)
        return guarded


def _tensors(values: list) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _guarded_jobs(rank: int, world: int, jobs: list, out_dir: str) -> None:
    from trainwright.dist.probe import measure_p2p
    from trainwright.run.worker import train

    guard = Guard()
    for cfg, run_dir in jobs:
        train(cfg, Path(run_dir))
    measure_p2p(nbytes=4096, repeats=1)
    seen = dict(guard.calls)
    # the guard itself catches both mistakes: a direct call, a tensor on the wrong device
    before = len(guard.violations)
    dist.barrier()  # from this test module, not through the helper
    guard.check("all_reduce", collective.__name__, (torch.zeros(1, device="meta"),), {})
    caught = guard.violations[before:]
    del guard.violations[before:]
    Path(out_dir, f"{rank}.json").write_text(json.dumps(
        {"calls": seen, "violations": guard.violations, "caught": caught,
         "device": str(collective.backend_device())}))


@pytest.mark.timeout(240)
def test_every_collective_of_real_runs_goes_through_the_helper(tiny, tmp_path):
    """Hierarchical sync over 2 nodes x 2 ranks, then a 2 x 2 pipeline with sparse sync and
    the rebalancer's per-replica time exchange, then the point-to-point probe."""
    from trainwright.run.launch import create_run_dir

    cfgs = [tiny(**{"parallel.pp": 1, "parallel.dp": 4, "sync.strategy": '"hierarchical"',
                    "hierarchical.ranks_per_node": 2, "train.steps": 2}),
            tiny(**{"parallel.pp": 2, "parallel.dp": 2, "sync.sparse": "true",
                    "train.micro_batches": 2, "train.steps": 2, "rebalance.enabled": "true",
                    "rebalance.check_every": 1, "run.profile_every": 1})]
    jobs = [(cfg, str(create_run_dir(cfg))) for cfg in cfgs]
    run_workers(_guarded_jobs, 4, jobs, str(tmp_path), timeout_s=220)
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for r, rep in enumerate(reports):
        assert rep["violations"] == [], (r, rep["violations"])
        assert rep["device"] == "cpu"  # gloo
        assert len(rep["caught"]) == 2, rep["caught"]
        assert "barrier called directly from tests.test_collective" in rep["caught"][0]
        assert "tensor on meta" in rep["caught"][1]
    seen = set().union(*(rep["calls"] for rep in reports))
    expected = {"all_reduce", "all_gather", "isend", "irecv", "send", "recv", "barrier",
                "all_gather_object"}
    assert expected <= seen, sorted(expected - seen)
