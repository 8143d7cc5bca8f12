"""The footprint model, on literal tables: the schedule walk, its terms, and fit_plan."""

from __future__ import annotations

import pytest

from trainwright.errors import PlanError
from trainwright.plan.fit import fit_plan
from trainwright.plan.footprint import (
    LayerTerms,
    arrivals,
    stage_footprint,
    static_bytes,
    walk,
)
from trainwright.plan.memory import InFlight, LayerMem
from trainwright.schedule.actions import build_schedule, max_in_flight, max_waiting_w


def _layers(chunk: int = 0) -> list[LayerTerms]:
    # work > kept > saved; output 10, input 10 (a block-like layer)
    return [LayerTerms(0, work=100, kept=60, saved=50, output_bytes=10, input_bytes=10,
                       param_bytes=1000, chunk=chunk),
            LayerTerms(1, work=300, kept=210, saved=200, output_bytes=10, input_bytes=10,
                       param_bytes=2000, chunk=chunk)]


def _one_stage(schedule: str, m: int) -> list:
    return build_schedule(schedule, 1, m)[0]


def test_gpipe_keep_peaks_at_the_last_forward_working_set():
    # one stage, GPipe, 3 micro-batches: input 10 + kept 60 + 210 per micro-batch held;
    # the last forward's layer 1 runs with 2 micro-batches held and 10 + 60 of its own
    peak, host, moment = walk(_layers(), {}, _one_stage("gpipe", 3))
    assert peak == 2 * 280 + 10 + 60 + 300 and host == 0
    assert "F2 layer 1" in moment


def test_the_loss_stage_holds_every_micro_batchs_targets_and_loss_all_step():
    from dataclasses import replace

    layers = _layers()
    layers[-1] = replace(layers[-1], target_bytes=7)
    for name in ("gpipe", "1f1b"):
        plain = walk(_layers(), {}, _one_stage(name, 3))[0]
        # targets (7) and the loss value (the layer's output, 10) of each micro-batch
        assert walk(layers, {}, _one_stage(name, 3))[0] == plain + 3 * (7 + 10)


def test_the_first_stage_holds_the_steps_inputs_all_step():
    # 1F1B on one stage: one micro-batch at a time, yet all 3 inputs (10 each) are the
    # step's batch, read before the first F: 30 at every moment, not 10 a held one
    peak, _, moment = walk(_layers(), {}, _one_stage("1f1b", 3))
    assert peak == 3 * 10 + 60 + 300 and "layer 1" in moment


def test_a_sent_output_outlives_its_micro_batchs_w_until_sync():
    """ZB-H1 pp 4 x 8, stage 1, one layer whose only bytes are its output (1000), sent on.
    The runtime keeps every sent output until SYNC, past its micro-batch's W (metered on
    this schedule, all swapped: stages 1 and 2 held one output per micro-batch whose W was
    done, 4 and 5 x 128 KiB the walk had missed). At RECV_B5: W0-W3 done, their 4 outputs
    still sent; mb 4-7 held; mb 4's gradient (kept for W4) and mb 5's: 10 outputs (6 when
    the sent ones went with their W)."""
    o = 1000
    layer = [LayerTerms(0, work=0, kept=o, saved=0, output_bytes=o, input_bytes=0, w_held=0,
                        chunk=1)]
    actions = build_schedule("zb-h1", 4, 8)[1]
    assert walk(layer, {}, actions, send_header=0)[:3:2] == (10 * o, "1RECV_B5")


def test_recompute_holds_outputs_and_rebuilds_during_backward():
    pol = {0: "recompute", 1: "recompute"}
    peak, _, moment = walk(_layers(), pol, _one_stage("gpipe", 3))
    held = 10 + 10 + 10  # input, two outputs per micro-batch
    # backward of the last micro-batch: layer 1 recomputed (work 300) with all held
    assert peak == 3 * held + 300 and "recompute" in moment


def test_swap_moves_saved_bytes_to_the_host_and_copy_back_brings_them():
    pol = {1: "swap"}
    peak, host, _ = walk(_layers(), pol, _one_stage("gpipe", 2))
    assert host == 2 * 200
    assert peak == (10 + 60 + 10) + 10 + 60 + 300  # layer 1's working set still counts
    back, _, _ = walk(_layers(), pol, _one_stage("gpipe", 2), copy_back=True)
    assert back >= peak


def test_copy_back_counts_the_next_swapped_layer_already_coming_back():
    lay = [LayerTerms(0, work=20, kept=60, saved=50, output_bytes=10, input_bytes=10),
           LayerTerms(1, work=30, kept=210, saved=200, output_bytes=10, input_bytes=10)]
    both = {0: "swap", 1: "swap"}
    sched = _one_stage("gpipe", 1)
    # held: the input and both outputs (30); layer 1's backward has its 200 back and layer
    # 0's 50 on the way (the store prefetches the next layer down)
    peak, _, moment = walk(lay, both, sched, copy_back=True)
    assert peak == 30 + 200 + 50 and "B0 layer 1" in moment
    assert walk(lay, {1: "swap"}, sched, copy_back=True)[0] == 10 + 60 + 10 + 200
    assert walk(lay, both, sched)[0] == 10 + 10 + 30  # a CPU reads the host copy in place


def test_receives_posted_ahead_exist_one_message_early_and_go_with_their_use():
    sched = build_schedule("1f1b", 2, 4)
    got = arrivals(sched[1])
    # each stream's next receive is posted when the one before it returns (comm's [Note:
    # receives posted ahead]): RECV_F1 with RECV_F0 at the start, RECV_F2 at RECV_F1, ...
    assert {i: [a.mb for a in acts] for i, acts in got.items()} == {0: [0, 1], 4: [2], 8: [3]}
    lay = _layers(chunk=1)
    late, _, late_at = walk(lay, {}, sched[1], send_header=0)
    early, _, early_at = walk(lay, {}, sched[1], arrive=got, send_header=0)
    # the last stage holds one micro-batch (60 + working set 300) and, by its fourth
    # forward, three sent input gradients (10 each) that live until SYNC waits for them.
    # Not posted ahead (the single-chunk runtime), each input is held by its segment from
    # its receive: one at a time
    assert late == 10 + 3 * 10 + 60 + 300 and "F3" in late_at
    # posted ahead (the interleaved runtime), the next input exists one receive early and
    # is released with its segment too, not kept until SYNC (metered: ZB-V pp 4 x 8, rank
    # 0 held 2 of its last chunk's 8 inputs at its peak): two inputs at F2, F3 alike
    assert early == 2 * 10 + 2 * 10 + 60 + 300 and "F2" in early_at


def test_a_hand_over_between_two_chunks_of_a_rank_is_one_tensor_and_no_message():
    from trainwright.schedule.base import Action

    # ZB-V's turn: chunk 1's output is chunk 2's input on the same rank, chunk 2's input
    # gradient chunk 1's received one. The runtime hands each over in memory (no copy, no
    # header, no pending send); metered: ZB-V pp 2 x 8 rank 1 held 1.8 MB less than the
    # walk that counted them as messages
    one = LayerTerms(0, work=100, kept=60, saved=50, output_bytes=10, input_bytes=10, chunk=1)
    two = LayerTerms(1, work=300, kept=210, saved=200, output_bytes=10, input_bytes=10,
                     chunk=2)
    acts = [Action(c, k, 0) for c, k in [  # chunk 1 is the model's first: no input received
        (1, "F"), (1, "SEND_F"), (2, "RECV_F"), (2, "F"), (2, "SEND_F"), (2, "RECV_B"),
        (2, "B"), (2, "SEND_B"), (1, "RECV_B"), (1, "B")]]
    acts.append(Action(1, "SYNC"))
    peak, _, moment = walk([one, two], {}, acts, send_header=520)
    # the step's input and chunk 1's kept bytes (its output among them), chunk 2's kept
    # bytes, the header of chunk 2's send to the next rank, and the gradient from there
    # with its header buffer while it arrives
    assert peak == 10 + 60 + 210 + 520 + 10 + 520 and "2RECV_B0" in moment


def test_every_send_holds_its_header_until_sync_and_a_receive_its_own_while_it_lasts():
    from trainwright.dist.comm import HEADER_LEN
    from trainwright.plan.footprint import SEND_HEADER_BYTES

    assert SEND_HEADER_BYTES == HEADER_LEN * 8  # the comm layer's int64 header
    # 1F1B's last stage of 2, 4 micro-batches: after B3 its four input gradients (10 B each)
    # and their four headers wait for SYNC; that outgrows the forward's working set. RECV_F3
    # reaches as high first: three sends pending, the input (10) and, while the payload
    # arrives, the receive's header buffer (520; metered: ZB-H2 pp 4 x 8 rank 0 peaked in
    # RECV_B2 at the walk's peak + 520 B)
    sched = build_schedule("1f1b", 2, 4)[1]
    peak, _, moment = walk(_layers(chunk=1), {}, sched, send_header=520)
    assert peak == 4 * (10 + 520) == 3 * (10 + 520) + 10 + 520 and "RECV_F3" in moment
    # posted ahead (the interleaved runtime), each header buffer is held from its post until
    # its receive returns: RECV_F1's, posted when RECV_F0 returns, while F0 runs
    from dataclasses import replace

    from trainwright.schedule.base import Action

    acts = [Action(1, k, mb) for k, mb in [("RECV_F", 0), ("F", 0), ("RECV_F", 1), ("F", 1)]]
    big = [_layers(chunk=1)[0], replace(_layers(chunk=1)[1], work=3000)]
    peak, _, moment = walk(big, {}, acts, arrive=arrivals(acts), send_header=520)
    assert peak == 10 + 10 + 520 + 60 + 3000 and "F0 layer 1" in moment


def test_a_backward_measured_by_the_allocator_is_walked_with_its_incoming_gradient():
    from dataclasses import replace

    sched = _one_stage("gpipe", 1)
    plain, _, _ = walk(_layers(), {}, sched)  # the forward's working set: 10 + 60 + 300
    assert plain == 370
    # layer 0's backward allocates 500 B (its gradients and workspace) while layer 1's
    # output gradient (10 B) is alive; the top layer's backward takes 50 B
    got = [replace(_layers()[0], back_work=500), replace(_layers()[1], back_work=50)]
    peak, _, moment = walk(got, {}, sched)
    # at layer 0's backward: its input 10 and kept 60 still held (layer 1's released)
    assert peak == 10 + 60 + 500 + 10 and "B0 layer 0" in moment
    # recomputed: the rebuilt kept bytes are held during the backward as well (layer 0's
    # first output went with layer 1's segment, whose input it was)
    peak, _, _ = walk(got, {0: "recompute", 1: "recompute"}, sched)
    assert peak == 10 + 60 + 500 + 10


def test_a_recomputed_layers_output_and_the_received_gradient_go_before_its_recompute():
    """Stage 0 of 2, GPipe, one micro-batch, both layers recomputed. Metered (1F1B pp 4 x 8,
    a stage of three recomputed layers, the live meter's allocations at the peak by layer):
    during a layer's recompute its first output (the input of the layer above, released
    with that layer's segment) and the gradient received for the stage's top layer (freed
    once that layer's backward is done) were gone; the walk had counted both, 2 x 64 KiB."""
    sched = build_schedule("gpipe", 2, 1)[0]
    lay = [LayerTerms(0, work=1000, kept=60, saved=50, output_bytes=10, input_bytes=10,
                      work_nograd=50),
           LayerTerms(1, work=300, kept=210, saved=200, output_bytes=10, input_bytes=10,
                      work_nograd=50)]
    peak, _, moment = walk(lay, {0: "recompute", 1: "recompute"}, sched, send_header=0)
    # the step's input (10) and the pending send of layer 1's output (10), and the recompute
    assert peak == 10 + 10 + 1000 and "B0 layer 0 (recompute)" in moment


def test_a_split_backward_keeps_only_what_the_weight_side_needs_until_w():
    from dataclasses import replace

    # ZB-H1's last stage, 3 micro-batches: F0 B0 F1 B1 W0 W1 F2 B2 W2 (receives and sends
    # around them); micro-batch 0 is held from its B until W0 while F1 runs
    sched = build_schedule("zb-h1", 2, 3)[1]
    lay = _layers(chunk=1)
    # not measured: everything the forward kept stays until W. At F1's layer 1: micro-batch
    # 0's input, kept 60 + 210 and sent input gradient (10 + 270 + 10), micro-batch 1's
    # input and kept 60 (70), layer 1's working set 300
    peak, _, moment = walk(lay, {}, sched, send_header=0)
    assert peak == 290 + 70 + 300 and "F1 layer 1" in moment
    # measured: B leaves layer 1's weight side 20 B and its input (layer 0's output, 10),
    # layer 0's 30 B: micro-batch 0 holds 10 + 30 + 10 + 20 after B, plus its sent 10
    split = [replace(lay[0], w_held=30), replace(lay[1], w_held=20, w_keeps_input=True)]
    peak, _, moment = walk(split, {}, sched, send_header=0)
    assert peak == 80 + 70 + 300 and "F1 layer 1" in moment
    # the model's first stage runs its whole backward at W: nothing changes there
    first = build_schedule("zb-h1", 2, 3)[0]
    assert walk(_layers(), {}, first) == walk([replace(x, w_held=0) for x in _layers()], {},
                                              first)


def test_a_recomputed_layers_output_kept_for_w_is_its_first_forwards():
    from dataclasses import replace

    from trainwright.schedule.base import Action

    # recomputed under a split backward: what W needs of each layer (w_held) stays from B
    # until W; layer 1's W needs its input too, layer 0's output, which the recompute
    # segment holds already (its first forward's, the segment's input): not a second one
    # (metered: ZB-H2 pp 2 x 4, all recomputed, held one block output less per layer)
    lay = [replace(_layers(chunk=1)[0], w_held=30),
           replace(_layers(chunk=1)[1], w_held=20, w_keeps_input=True)]
    acts = [Action(1, k, mb) for k, mb in [
        ("RECV_F", 0), ("F", 0), ("B", 0), ("SEND_B", 0), ("RECV_F", 1), ("F", 1), ("W", 0),
        ("B", 1), ("SEND_B", 1), ("W", 1)]]
    acts.append(Action(1, "SYNC"))
    peak, _, moment = walk(lay, {0: "recompute", 1: "recompute"}, acts, send_header=0)
    # micro-batch 0 after B: input 10, both first-forward outputs 10 + 10, W's 30 + 20 and
    # the sent input gradient 10; micro-batch 1: input 10, layer 0's output 10, layer 1's
    # working set 300
    assert peak == 90 + 20 + 300 and "F1 layer 1" in moment


def test_static_terms_by_optimizer_and_shards():
    assert static_bytes(100, "sgd") == (100, 100, 0)
    assert static_bytes(100, "sgd", momentum=0.9) == (100, 100, 100)
    assert static_bytes(100, "adamw", shards=4) == (100, 100, 50)
    with pytest.raises(ValueError, match="optimizer"):
        static_bytes(100, "lion")
    fp = stage_footprint(_layers(), {}, _one_stage("1f1b", 2), optimizer="adam")
    assert (fp.weights, fp.gradients, fp.optimizer) == (3000, 3000, 6000)
    assert fp.device == fp.static + fp.activations


def _mems(terms: list[LayerTerms]) -> list[LayerMem]:
    return [LayerMem(t.layer, t.saved, t.input_bytes, 1.0, 2.0) for t in terms]


def test_fit_plan_holds_the_walk_under_the_limit_where_the_store_model_does_not():
    acts = _one_stage("gpipe", 3)
    flight = InFlight(max_in_flight(acts), max_waiting_w(acts), acts)
    terms = _layers()
    keep = walk(terms, {}, acts)[0]
    limit = keep * 2 // 3
    plan = fit_plan(_mems(terms), terms, flight, limit, 1e9, "optimal")
    assert plan is not None and plan.required_bytes < limit
    assert walk(terms, plan.policies, acts)[0] == plan.required_bytes
    with pytest.raises(PlanError, match="raise memory.limit"):
        fit_plan(_mems(terms), terms, flight, 50, 1e9, "optimal")
    assert fit_plan(_mems(terms), terms, flight, keep + 1, 1e9, "greedy") is None


def test_fit_plan_falls_back_to_a_uniform_plan_when_its_tries_run_out():
    # at 500 B the store's model plans "keep layer 0, swap layer 1" (410 B by its count),
    # which the walk prices at 530 B; lowering the bound finds all-swap (380 B) only after
    # several tries. With one try left, the fit must still come from the uniform plans,
    # not a "no plan fits" while every layer swapped fits (seen in CI on bench memory)
    acts = _one_stage("gpipe", 3)
    flight = InFlight(max_in_flight(acts), max_waiting_w(acts), acts)
    terms = _layers()
    plan = fit_plan(_mems(terms), terms, flight, 500, 1e9, "optimal", tries=1)
    assert plan is not None and plan.policies == {0: "swap", 1: "swap"}
    assert plan.required_bytes == walk(terms, plan.policies, acts)[0] == 380


def test_the_profile_measures_what_swap_and_a_split_backward_leave_on_the_device():
    """An MLP's hidden layer is Linear + GELU: keep holds the linear's output (GELU saves it)
    and the GELU's output; swapped, the store moves the saved linear output to the host as
    it is saved, so only the output stays; under a split backward the linear stashes its
    input for W and nothing the layer created (GELU's saved tensor goes with the graph)."""
    from trainwright.config import load_config
    from trainwright.model.build import build_layers
    from trainwright.pipeline.profile import profile_model

    cfg = load_config(None, ['model.name="mlp"', "model.d_in=16", "model.d_model=32",
                             "model.n_blocks=2", "train.batch_size=8",
                             "train.micro_batches=1"])
    terms = profile_model(cfg, build_layers(cfg)).terms
    for hidden in (terms[0], terms[1]):
        assert hidden.output_bytes == 8 * 32 * 4
        assert hidden.kept == 2 * hidden.output_bytes
        assert hidden.kept_swap == hidden.output_bytes
        assert hidden.work_swap == hidden.work == 2 * hidden.output_bytes
        assert (hidden.w_held, hidden.w_keeps_input) == (0, True)
    last = terms[2]  # Linear and the loss: the linear stashes its input
    assert last.w_keeps_input and last.w_held == 0
    # the loss's targets of one micro-batch (8 samples; the mlp's data: a class id each)
    assert last.target_bytes == 8 * 8 and terms[0].target_bytes == terms[1].target_bytes == 0


def test_a_layer_that_normalises_its_input_first_leaves_it_to_no_w():
    """A GPT block and the head start with a LayerNorm: their linears stash the norm's
    output, not the layer's input, so a split backward's B leaves the layer below's output
    to nobody (metered: ZB-H2 pp 4 x 8's stages held one block output per micro-batch
    less than the walk that took it to be kept; the probe had found its input alive
    because, as a leaf, autograd's gradient accumulator kept it while any node above lived)."""
    from trainwright.config import load_config
    from trainwright.model.build import build_layers
    from trainwright.pipeline.profile import profile_model

    cfg = load_config(None, ['model.name="gpt"', "model.d_model=32", "model.n_heads=2",
                             "model.n_blocks=1", "model.context=8", "train.batch_size=2",
                             "train.micro_batches=1"])
    terms = profile_model(cfg, build_layers(cfg)).terms
    assert [terms[i].w_keeps_input for i in (1, 2)] == [False, False]  # block, head
    assert all(terms[i].w_held > 0 for i in (1, 2))


def test_the_profile_times_a_split_backwards_weight_pass_and_stage_costs_carry_it():
    """Each layer's ``W`` share (its linear's weight gradient) is measured, above nothing
    and below the whole backward; a stage's ``weight_s`` (a zero-bubble ``W``) sums its
    layers', so its ``B`` takes the rest rather than half."""
    from trainwright.config import load_config
    from trainwright.model.build import build_layers
    from trainwright.observe.tensor_profile import LayerTensors
    from trainwright.pipeline.profile import profile_model
    from trainwright.plan.stage_inputs import stage_costs

    cfg = load_config(None, ['model.name="mlp"', "model.d_in=64", "model.d_model=256",
                             "model.n_blocks=2", "train.batch_size=64",
                             "train.micro_batches=1"])
    table = profile_model(cfg, build_layers(cfg))
    for c in table:
        assert 0.0 < c.weight_s < c.backward_s, c
    rows = [LayerTensors(c.layer, c.name, c.forward_s, c.backward_s, c.input_bytes,
                         c.output_bytes, c.param_bytes, weight_s=c.weight_s) for c in table]
    costs = stage_costs(rows, [[0, 1], [2]], None, [0, 1], [0.0, 0.0], [0.0, 0.0])
    assert costs[0].weight_s == pytest.approx(table[0].weight_s + table[1].weight_s)
    assert costs[1].weight_s == pytest.approx(table[2].weight_s)


def test_a_layer_whose_split_cannot_be_measured_is_planned_as_before(monkeypatch, caplog):
    from trainwright.config import load_config
    from trainwright.model.build import build_layers
    from trainwright.pipeline import workset
    from trainwright.pipeline.profile import profile_model

    def refuse(self, layer, *a, **k):
        raise RuntimeError("no split for this layer")

    monkeypatch.setattr(workset.WorkingSetProbe, "measure_split", refuse)
    cfg = load_config(None, ['model.name="mlp"', "model.d_in=16", "model.d_model=32",
                             "model.n_blocks=1", "train.batch_size=8"])
    table = profile_model(cfg, build_layers(cfg))
    assert all(t.w_held == -1 and not t.w_keeps_input for t in table.terms.values())
    assert all(c.weight_s == 0.0 for c in table)  # W's share unknown: planned as half
    assert "could not measure what a split backward keeps" in caplog.text
