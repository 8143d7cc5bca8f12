"""``trainwright bench straggler``: token ring vs torch DDP with one node 3x slower.

Four nodes train the same MLP (64 -> 512 -> 512 -> 10, GELU) on scikit-learn's digits
(1,797 8x8 images shipped inside the package; 360 held out for testing) with plain SGD,
the same global batches (1,436 = 4 shards of 359: the whole training set, reshuffled each
epoch, so that each node's compute per step is large against messaging and noise) and
the same number of steps. Rows:

* ``trainwright_tokenring``: ``sync.strategy = "tokenring"``, ``close_fraction = 0.75``;
* ``torch_ddp``: ``DistributedDataParallel`` over gloo (all-reduce every step);

each with and without a straggler. **How slowness is injected (pacing)**: four nodes
share two (busy) cores here, so a straggler emulated by sleeping frees CPU for the others
and hides itself (measured: a 3x sleeping rank slowed DDP only ~1.3x). Each node is
therefore paced like a node with its own device: its forward+backward is padded to
``pace_s`` (250 ms; the real forward+backward takes well under that) by idling between
forward and backward, and the slow node (index 3) is padded to ``slow_factor * pace_s``.
The padding is ``target - forward_time * r``, with ``r`` the (forward+backward)/forward
ratio (token ring: median of its last steps; DDP, whose backward contains the
all-reduce: measured on the plain model before training). In the token ring the idling
ends early when the ring closes the step without the node (the seed abandons a closed
step). With ``pace_s = 0`` the slow node instead idles ``(slow_factor - 1)`` times its
compute. Every rank runs one intra-op thread.

``samples_per_s`` counts committed samples (those whose gradients entered an update) over
the steps after one warm-up epoch; ``test_accuracy`` is measured on the held-out images
after training. Systems are interleaved and repeated; figures are medians.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["StragglerSpec", "DigitsData", "digits_data", "run", "main"]


@dataclass
class StragglerSpec:
    """Sizes of the benchmark (defaults: the published figures)."""

    nodes: int = 4
    hidden: int = 512
    batch_size: int = 1436
    epochs: int = 100
    lr: float = 1.0
    slow_factor: float = 3.0
    close_fraction: float = 0.75
    pace_s: float = 0.25
    """Forward+backward of every node padded to this (the slow node's to 3x); 0 = off."""
    seed: int = 0


class DigitsData:
    """scikit-learn digits, standardised; ``batch(step, B)`` walks reshuffled epochs."""

    def __init__(self, seed: int = 0, test: int = 360):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        self.test_idx, self.train_idx = perm[:test], perm[test:]
        mean, std = x[self.train_idx].mean(0), x[self.train_idx].std(0) + 1e-3
        self.x, self.y, self.seed = (x - mean) / std, y, seed

    def steps_per_epoch(self, batch_size: int) -> int:
        """Whole batches in one pass over the training images."""
        return len(self.train_idx) // batch_size

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step`` (1-based), the same on every call and node."""
        epoch, i = divmod(step - 1, self.steps_per_epoch(batch_size))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 100 + epoch)
        order = self.train_idx[torch.randperm(len(self.train_idx), generator=gen)]
        idx = order[i * batch_size:(i + 1) * batch_size]
        return self.x[idx], self.y[idx]

    def accuracy(self, model: nn.Module) -> float:
        """Fraction of held-out images classified correctly."""
        with torch.no_grad():
            pred = model(self.x[self.test_idx]).argmax(1)
        return float((pred == self.y[self.test_idx]).float().mean())


def digits_data(cfg) -> DigitsData:
    """``data.factory`` entry for the token-ring nodes."""
    return DigitsData(cfg.train.seed)


def _config(spec: StragglerSpec, steps: int, straggler: bool, run_dir: Path):
    from trainwright.config import load_config

    sets = {
        "sync.strategy": '"tokenring"', "train.optimizer": '"sgd"', "model.name": '"mlp"',
        "model.d_in": 64, "model.n_classes": 10, "model.d_model": spec.hidden,
        "model.n_blocks": 2, "data.factory": '"trainwright.bench.straggler:digits_data"',
        "train.batch_size": spec.batch_size, "train.steps": steps, "train.lr": spec.lr,
        "train.seed": spec.seed, "parallel.threads_per_rank": 1, "run.dir": f'"{run_dir}"',
        "run.progress": "false", "tokenring.nodes": spec.nodes,
        "tokenring.close_fraction": spec.close_fraction, "tokenring.record_hashes": "false",
        "tokenring.slow_node": spec.nodes - 1 if straggler else -1,
        "tokenring.slow_factor": spec.slow_factor, "tokenring.formation_quiet_s": 30.0,
        "tokenring.pace_s": spec.pace_s,
        "tokenring.close_timeout_s": 60.0,
    }
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _model(cfg) -> nn.Sequential:
    from trainwright.model.build import build_layers

    return nn.Sequential(*[m for _, m in build_layers(cfg)])


def _tokenring(spec: StragglerSpec, steps: int, warmup: int, straggler: bool, tmp: Path
               ) -> dict:
    from trainwright.run.launch import create_run_dir
    from trainwright.run.ring_node import launch_ring

    cfg = _config(spec, steps, straggler, tmp)
    run_dir = create_run_dir(cfg)
    result = launch_ring(cfg, run_dir, timeout_s=600)
    if not result.ok:
        raise RuntimeError(f"token ring run failed: {result.message()}")
    rep = result.reports["0"]
    t = {int(s): v for s, v in rep["close_time"].items()}
    closes = {int(s): c for s, c in rep["closes"].items()}
    committed = sum(len(closes[s]) for s in range(warmup + 1, steps + 1)) * rep["shard_samples"]
    model = _model(cfg)
    model.load_state_dict(torch.load(run_dir / "model.pt"))
    slow = spec.nodes - 1
    return {"samples_per_s": committed / (t[steps] - t[warmup]),
            "test_accuracy": DigitsData(spec.seed).accuracy(model),
            "committed_fraction": committed / ((steps - warmup) * spec.batch_size),
            "steps_with_slow_node": sum(slow in closes[s] for s in range(1, steps + 1))}


def _ddp_worker(rank: int, world: int, spec_d: dict, steps: int, warmup: int,
                straggler: bool, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainwright.dist import collective as coll
    from trainwright.model.data import shard

    spec = StragglerSpec(**spec_d)
    cfg = _config(spec, steps, straggler, Path(out).parent)
    model, data = _model(cfg), DigitsData(spec.seed)
    lossf = nn.functional.cross_entropy
    ratios = []  # (forward + backward) / forward of the plain model, robust to CPU load
    for s in range(1, 6):
        x, y = shard(data.batch(s, spec.batch_size), rank, world)
        t0 = time.perf_counter()
        loss = lossf(model(x), y)
        t1 = time.perf_counter()
        torch.autograd.grad(loss, list(model.parameters()))
        ratios.append((time.perf_counter() - t0) / (t1 - t0))
    fwd_bwd_per_fwd = statistics.median(ratios)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=spec.lr)
    coll.barrier()
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = shard(data.batch(step, spec.batch_size), rank, world)
        opt.zero_grad(set_to_none=True)
        loss = lossf(ddp(x), y)
        slow = straggler and rank == world - 1
        compute = (time.perf_counter() - t0) * fwd_bwd_per_fwd  # estimated from the forward
        if spec.pace_s:  # pad forward+backward to the device time (3x on the slow rank)
            time.sleep(max(0.0, spec.pace_s * (spec.slow_factor if slow else 1) - compute))
        elif slow:
            time.sleep((spec.slow_factor - 1) * compute)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "samples_per_s": (steps - warmup) * spec.batch_size / sum(times[warmup:]),
            "test_accuracy": data.accuracy(model), "committed_fraction": 1.0}))


def _ddp(spec: StragglerSpec, steps: int, warmup: int, straggler: bool, tmp: Path) -> dict:
    from trainwright.dist.testing import run_workers

    out = tmp / f"ddp-{time.monotonic_ns()}.json"
    try:
        run_workers(_ddp_worker, spec.nodes, asdict(spec), steps, warmup, straggler, str(out),
                    timeout_s=600)
    except AssertionError as exc:
        # gloo sometimes aborts a worker while the interpreter exits ("terminate called
        # without an active exception"), after training and the results are complete
        if not out.exists() or "Traceback" in str(exc):
            raise
        return {**json.loads(out.read_text()), "teardown_abort": str(exc)}
    return json.loads(out.read_text())


def run(spec: StragglerSpec, repeats: int = 3, steps: int | None = None) -> dict:
    """Run all four rows ``repeats`` times, interleaved; returns the benchmark JSON."""
    from trainwright.observe.progress import StepProgress

    spe = DigitsData(spec.seed).steps_per_epoch(spec.batch_size)
    steps = steps or spec.epochs * spe
    warmup = min(spe, steps // 2)
    systems = [("trainwright_tokenring", True), ("torch_ddp", True),
               ("trainwright_tokenring", False), ("torch_ddp", False)]
    got: dict[tuple[str, bool], list[dict]] = {k: [] for k in systems}
    bar = StepProgress(repeats * len(systems))
    with tempfile.TemporaryDirectory(prefix="tw-straggler-") as tmp:
        for rep in range(repeats):
            for i, (name, straggler) in enumerate(systems):
                fn = _tokenring if name == "trainwright_tokenring" else _ddp
                got[(name, straggler)].append(fn(spec, steps, warmup, straggler, Path(tmp)))
                bar.update(rep * len(systems) + i + 1, None,
                           got[(name, straggler)][-1]["samples_per_s"])
    bar.close()
    rows = []
    for (name, straggler), runs in got.items():
        row = {"system": name, "straggler": straggler,
               "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
               "test_accuracy": statistics.median(r["test_accuracy"] for r in runs),
               "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in runs],
               "test_accuracy_runs": [round(r["test_accuracy"], 4) for r in runs],
               "committed_fraction": statistics.median(r["committed_fraction"] for r in runs)}
        aborts = [r["teardown_abort"] for r in runs if "teardown_abort" in r]
        if aborts:
            row["worker_teardown_aborts"] = aborts
        if "steps_with_slow_node" in runs[0]:
            row["steps_with_slow_node_runs"] = [r["steps_with_slow_node"] for r in runs]
        rows.append(row)
    by = {(r["system"], r["straggler"]): r for r in rows}
    tr, ddp = by[("trainwright_tokenring", True)], by[("torch_ddp", True)]
    return {
        "benchmark": "straggler",
        "spec": {**asdict(spec), "steps": steps, "warmup_steps": warmup, "repeats": repeats,
                 "slow_node": spec.nodes - 1,
                 "slowness": "forward+backward padded to pace_s per node, slow_factor x pace_s on "
                              "the slow node (idling between forward and backward)"},
        "rows": rows,
        "ratio_vs_ddp_with_straggler": tr["samples_per_s"] / ddp["samples_per_s"],
        "ratio_ddp_straggler_vs_no_straggler": ddp["samples_per_s"]
        / by[("torch_ddp", False)]["samples_per_s"],
        "accuracy_gap_points_vs_ddp": 100 * (ddp["test_accuracy"] - tr["test_accuracy"]),
        "targets": {"ratio_vs_ddp_with_straggler": ">= 2.0",
                    "accuracy_gap_points_vs_ddp": "<= 1.0"},
    }


def main(args) -> dict:
    """CLI entry: ``trainwright bench straggler [--repeats N] [--steps S]``."""
    return run(StragglerSpec(), repeats=args.repeats, steps=args.steps)
