import json, statistics, sys, pickle
from trainwright.bench.planner import PlannerBenchSpec, _links, predict, _plan
k, sch = int(sys.argv[1]), sys.argv[2]
spec = PlannerBenchSpec(stage_counts=[k], schedules=[sch])
rows = pickle.load(open(".scratch/rows.pkl", "rb"))
res = json.load(open(f".scratch/res_{sch}{k}.json"))
lat, bw = _links(res[0]["links"]); print("links", lat, bw)
for key in ("keep", "limited"):
    runs = [r[key] for r in res]
    plan = None if key == "keep" else _plan(rows, spec, k, sch, res[0]["budgets"], ("peer", "recompute")).placement
    for i in range(spec.warmup, spec.steps):
        sim = predict(rows, runs, spec, sch, plan, lat, bw, step=i)
        m = max(r["step_s"][i] for r in runs)
        print(key, i, round(m, 3), round(sim.step_s, 3), round((sim.step_s - m) / m, 3))
        if i == spec.steps - 1:
            for r, rr in enumerate(runs):
                agg = {}
                for kind, mb, d in rr["events"][i]:
                    agg.setdefault(kind, []).append(d)
                print("  rank", r, {kk: (round(sum(v), 3), round(min(v)*1e3, 2)) for kk, v in agg.items()})
            busy = {}
            for s, kk, mb, st, en in sim.timeline:
                busy.setdefault((s, kk), 0.0); busy[(s, kk)] += en - st
            print("  sim", {f"{s}{kk}": round(v, 3) for (s, kk), v in busy.items() if v > 0.001})
