"""Interleaved 1F1B (``parallel.virtual_stages``): action lists, dry run, simulator, CLI."""

from __future__ import annotations

from collections import Counter

import pytest

from trainwright.cli.main import main
from trainwright.dist.testing import run_workers
from trainwright.errors import PlanError
from trainwright.plan.simulate import Links, StageCost, simulate
from trainwright.run.launch import create_run_dir
from trainwright.schedule.actions import (
    ActionKind,
    build_schedule,
    format_grid,
    max_in_flight,
    stage_ranks,
)
from trainwright.schedule.dryrun import check_schedule

IL = "interleaved-1f1b"


@pytest.mark.timeout(180)
def test_interleaved_lists_are_deadlock_free_and_complete():
    for p in range(2, 7):
        for m in (p, 2 * p, 4 * p):
            for v in (2, 3):
                sched = build_schedule(IL, p, m, v)
                assert len(sched) == p
                check_schedule(sched)
                format_grid(sched)
                for r, acts in enumerate(sched):
                    chunks = {a.stage for a in acts if a.kind in (ActionKind.F, ActionKind.B)}
                    assert chunks == {r + k * p for k in range(v)}, (p, m, v, r)
                    for s in chunks:
                        order = [(a.kind, a.mb) for a in acts if a.stage == s and a.kind in "FB"]
                        assert [mb for k, mb in order if k == ActionKind.F] == list(range(m))
                        assert [mb for k, mb in order if k == ActionKind.B] == list(range(m))
                        for i in range(m):
                            assert order.index((ActionKind.F, i)) < order.index((ActionKind.B, i))
                    assert [a.kind for a in acts[-2:]] == [ActionKind.SYNC, ActionKind.STEP]
                    held = min((v - 1) * p + 2 * (p - 1 - r) + 1, v * m)
                    assert max_in_flight(acts) == held, (p, m, v, r)


@pytest.mark.timeout(180)
def test_zb_v_lists_are_deadlock_free_complete_and_v_shaped():
    for p in range(2, 7):
        for m in (p, 2 * p, 4 * p):
            sched = build_schedule("zb-v", p, m, 2)
            check_schedule(sched)
            format_grid(sched)
            for r, acts in enumerate(sched):
                assert {a.stage for a in acts if a.kind in "FBW"} == {r, 2 * p - 1 - r}
                for s in (r, 2 * p - 1 - r):
                    order = [(a.kind, a.mb) for a in acts if a.stage == s and a.kind in "FBW"]
                    for kind in "FBW":
                        assert [mb for k, mb in order if k == kind] == list(range(m))
                    for i in range(m):
                        assert order.index((ActionKind.F, i)) < order.index((ActionKind.B, i)) \
                            < order.index((ActionKind.W, i))
    assert stage_ranks("zb-v", 3, 2) == [0, 1, 2, 2, 1, 0]
    assert stage_ranks(IL, 3, 2) == [0, 1, 2, 0, 1, 2]


def test_interleaved_first_rank_matches_the_megatron_order():
    # p = 2, m = 4, v = 2: rank 0 warms up with (v-1)p + 2(p-1) = 4 forwards in rounds of p
    compute = [str(a) for a in build_schedule(IL, 2, 4, 2)[0] if a.kind in "FB"]
    assert compute == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0",
                       "2F3", "0B1", "2B2", "2B3", "0B2", "0B3"]


@pytest.mark.timeout(180)
def test_simulated_interleaved_bubble_is_smaller_than_1f1b():
    for p, m in ((2, 4), (2, 8), (4, 8), (4, 16), (6, 12)):
        links = Links(list(range(p)), [[1e12] * p] * p)
        one = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 1.0)] * p, links)
        assert one.step_s == pytest.approx(2 * m + 2 * (p - 1))
        for v in (2, 3):  # each chunk does 1/v of a stage's work
            il = simulate(build_schedule(IL, p, m, v), [StageCost(1 / v, 1 / v)] * p, links)
            assert sum(il.busy_s) == pytest.approx(sum(one.busy_s))
            assert max(il.bubble) < max(one.bubble), (p, m, v, il.bubble, one.bubble)
            assert il.step_s < one.step_s
        # ZB-V at the zero-bubble table's costs: a stage's F = 1, B = 2 of which W = 1
        one = simulate(build_schedule("1f1b", p, m), [StageCost(1.0, 2.0)] * p, links)
        zbv = simulate(build_schedule("zb-v", p, m, 2), [StageCost(0.5, 1.0, 0.5)] * p, links)
        assert max(zbv.bubble) < max(one.bubble) and zbv.step_s < one.step_s, (p, m)


@pytest.mark.parametrize("p, m, v", [(4, 6, 2), (2, 4, 1)])
def test_interleaved_refuses_bad_micro_batches_and_chunks(p, m, v):
    with pytest.raises(PlanError, match="multiple of parallel.pp" if v > 1 else ">= 2"):
        build_schedule(IL, p, m, v)
    with pytest.raises(PlanError, match="one stage per rank"):
        build_schedule("1f1b", 2, 4, 2)


def test_cli_schedule_prints_interleaved(capsys):
    assert main(["schedule", "--schedule", IL, "--pp", "4", "--virtual-stages", "2",
                 "--micro-batches", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["step", "r0", "r1", "r2", "r3"]
    assert "7F7" in out and "0B7" in out
    assert main(["schedule", "--schedule", IL, "--pp", "4", "--micro-batches", "6"]) == 2
    assert "multiple of parallel.pp" in capsys.readouterr().err


def _il(tiny, pp: int, v: int = 2, schedule: str = IL, **extra):
    return tiny(**{"parallel.pp": pp, "parallel.virtual_stages": v,
                   "train.schedule": f'"{schedule}"', "train.steps": 3, **extra})


def _train_and_compare(cfgs, world: int, timeout_s: int) -> list:
    from tests.helpers import check_against_reference, train_jobs
    dirs = [create_run_dir(c) for c in cfgs]
    run_workers(train_jobs, world, list(zip(cfgs, map(str, dirs), strict=True)),
                timeout_s=timeout_s)
    for cfg, run_dir in zip(cfgs, dirs, strict=True):
        label = (f"pp={cfg.parallel.pp} dp={cfg.parallel.dp} v={cfg.parallel.virtual_stages} "
                 f"m={cfg.train.micro_batches} {cfg.memory.policies}")
        try:
            check_against_reference(cfg, run_dir)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from exc
    return dirs


@pytest.mark.timeout(400)
def test_interleaved_trains_equal_to_single_process_pp2(tiny):
    # 4 layers = 2 ranks x 2 chunks of one layer; step 2 is a fast (fused) step
    cfgs = [_il(tiny, 2, **{"train.micro_batches": m}) for m in (2, 4)]
    cfgs += [_il(tiny, 2, **{"train.micro_batches": 4, "memory.policies": pol})
             for pol in ('["swap", "recompute", "keep", "recompute"]',
                         '["recompute", "swap", "swap", "keep"]')]
    cfgs.append(_il(tiny, 2, v=3, **{"model.n_blocks": 4, "train.micro_batches": 4}))
    _train_and_compare(cfgs, 2, 380)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_interleaved_trains_equal_to_single_process_pp4_and_dp2(tiny):
    cfgs = [_il(tiny, 4, **{"model.n_blocks": 6, "train.micro_batches": 4}),
            _il(tiny, 4, **{"model.n_blocks": 6, "train.micro_batches": 8}),
            _il(tiny, 2, **{"parallel.dp": 2, "train.micro_batches": 4}),
            _il(tiny, 4, schedule="zb-v", **{"model.n_blocks": 6, "train.micro_batches": 8}),
            _il(tiny, 2, schedule="zb-v", **{"parallel.dp": 2, "train.micro_batches": 4})]
    _train_and_compare(cfgs, 4, 580)


@pytest.mark.timeout(400)
def test_interleaved_and_zb_v_resume_equal_the_uninterrupted_run(tmp_path):
    from tests.helpers import assert_bitwise, resume_pair, train_recording_sparse
    from trainwright.run import checkpoint
    pairs, jobs = [], []
    for schedule in (IL, "zb-v"):
        kw = {"parallel.pp": 2, "parallel.virtual_stages": 2, "train.schedule": f'"{schedule}"',
              "train.micro_batches": 4, "train.steps": 4, "train.momentum": 0.9}
        (_, d_full, d_cut), more = resume_pair(tmp_path / schedule, 2, **kw)
        pairs.append((schedule, d_full, d_cut))
        jobs += more
    run_workers(train_recording_sparse, 2, [(c, str(d), r) for c, d, r in jobs], str(tmp_path),
                timeout_s=380)
    for schedule, d_full, d_cut in pairs:
        assert_bitwise(d_full, d_cut, f"{schedule} resume")
        assert len(checkpoint.read_meta(d_cut, 2)["partition"]) == 4  # pp * virtual_stages


@pytest.mark.timeout(400)
def test_zb_v_trains_equal_to_single_process_pp2(tiny):
    cfgs = [_il(tiny, 2, schedule="zb-v", **{"train.micro_batches": m}) for m in (2, 4)]
    cfgs += [_il(tiny, 2, schedule="zb-v", **{"train.micro_batches": 4, "memory.policies": pol})
             for pol in ('["swap", "recompute", "keep", "recompute"]',
                         '["recompute", "swap", "swap", "keep"]')]
    _train_and_compare(cfgs, 2, 380)


def test_zb_v_carries_trailing_weight_passes_up_to_the_start_up_wait():
    from trainwright.schedule.carry import carried, steady_state
    for p in range(2, 7):
        for m in (p, 2 * p, 4 * p):
            lists = build_schedule("zb-v", p, m, 2)
            for r, acts in enumerate(lists):
                trailing = 0
                while acts[-3 - trailing].kind == ActionKind.W:
                    trailing += 1
                n = min(r, trailing)
                assert carried(acts) == (n + 2 if n else 0), (p, m, r)
            steady = steady_state(lists)
            check_schedule(steady)  # the carried passes need no message: still deadlock-free
            for acts, st in zip(lists, steady, strict=True):
                assert Counter(acts) == Counter(st)
    assert carried(build_schedule(IL, 2, 4, 2)[1]) == 0  # no W to carry


@pytest.mark.timeout(300)
def test_zb_v_carry_trains_equal_and_moves_the_passes(tiny):
    """Rank 1 leaves its last W, SYNC and STEP of steps 2 and 3 to the next step (step 1
    is measured, step 4 the last); the run still equals the single-process reference."""
    import json
    cfg = _il(tiny, 2, schedule="zb-v", **{"train.micro_batches": 4, "train.steps": 4})
    [run_dir] = _train_and_compare([cfg], 2, 280)
    events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]
    for rank in (0, 1):
        for k in range(1, 5):
            got = [e["args"]["kind"] for e in sorted(events, key=lambda e: e["ts"])
                   if e["pid"] == rank and e["args"]["step"] == k]
            carried_in, carried_out = rank == 1 and k in (3, 4), rank == 1 and k in (2, 3)
            assert (got[:3] == ["W", "SYNC", "STEP"]) == carried_in, (rank, k, got[:4])
            assert (got[-2:] == ["SYNC", "STEP"]) != carried_out, (rank, k, got[-4:])
            assert got.count("W") == 8 + carried_in - carried_out, (rank, k)
            assert got.count("STEP") == 1 + carried_in - carried_out, (rank, k)


@pytest.mark.parametrize("schedule,p,m,v", [("zb-v", 2, 4, 2), ("zb-v", 4, 8, 2),
                                             (IL, 2, 4, 2), (IL, 3, 6, 3)])
def test_receives_followed_by_the_same_stream(schedule, p, m, v):
    from trainwright.pipeline.interleaved import _receives_followed, _sends_after_first

    acts = build_schedule(schedule, p, m, virtual_stages=v)
    for rank, actions in enumerate(acts):
        here = {a.stage for a in actions}
        ahead = _receives_followed(actions, here)
        recvs = [(i, a) for i, a in enumerate(actions)
                 if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
                 and (a.stage - 1 if a.kind == ActionKind.RECV_F else a.stage + 1) not in here]
        for i, a in recvs:  # ahead exactly when a later receive of the same stream follows
            later = any(b.kind == a.kind and b.stage == a.stage for j, b in recvs if j > i)
            assert (i in ahead) == later, (rank, i, a)
        assert ahead and all(actions[i].kind.startswith("RECV") for i in ahead)
    # every stream's sends after its first one find their receives posted ahead: as many
    # per stream as the receiving rank posts ahead for it
    posted, assumed = Counter(), Counter()
    for actions in acts:
        here = {a.stage for a in actions}
        for i in _receives_followed(actions, here):
            posted[(actions[i].kind[-1], actions[i].stage)] += 1
        for i in _sends_after_first(actions, here):
            a = actions[i]
            assumed[(a.kind[-1], a.stage + 1 if a.kind == ActionKind.SEND_F else a.stage - 1)] += 1
    assert posted and posted == assumed
