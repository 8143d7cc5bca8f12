import json, pickle, sys
from trainwright.bench.planner import PlannerBenchSpec, _links, predict_steps, _plan, _measured
k, sch = int(sys.argv[1]), sys.argv[2]
spec = PlannerBenchSpec(stage_counts=[k], schedules=[sch])
rows = pickle.load(open(".scratch/rows.pkl", "rb"))
res = json.load(open(f".scratch/res_{sch}{k}.json"))
lat, bw = _links(res[0]["links"])
for key in ("keep", "limited"):
    runs = [r[key] for r in res]
    plan = None if key == "keep" else _plan(rows, spec, k, sch, res[0]["budgets"], ("peer", "recompute")).placement
    m, _ = _measured(runs, spec.warmup)
    p, _ = predict_steps(rows, runs, spec, sch, plan, lat, bw)
    print(key, round(m,3), round(p,3), round((p-m)/m,3))
