import time
from trainwright.devices import preset
from trainwright.plan.commands import gpt_profile
from trainwright.plan.planner import PlanRequest, make_plan
for mbs in (8, 12):
    rows = gpt_profile(24, 2048, 16, 2048, 50257, mbs, True, "bfloat16", 125e12, 900e9)
    topo = preset("dgx1", 32 * 2**30)
    for peer in (False, True):
        t0 = time.time()
        req = PlanRequest(rows, "1f1b", 8, 16, topo, state_factor=8.0, reserve=2 * 2**30, partition=[4,3,3,3,3,3,3,4], peer_swap=peer, latency_s=10e-6)
        plan = make_plan(req); d = plan.to_dict()
        print(mbs, peer, round(time.time()-t0,2), d["mapping"], round(plan.sim.step_s,3), round(plan.keep_sim.step_s,3), [round(b/2**30,1) for b in plan.sim.peak_bytes], [round(b/2**30,1) for b in d["budgets"]], d["fits"], d["policy_counts"])
