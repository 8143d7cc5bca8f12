import json, statistics
from trainwright.bench.planner import PlannerBenchSpec, _links, predict, _plan
from trainwright.pipeline.harness import job_batch, job_layers
from trainwright.tensor_profile import profile_tensors
import torch
spec = PlannerBenchSpec(stage_counts=[2], schedules=["gpipe"])
job0 = spec.job(1, "1f1b"); layers = job_layers(job0); x, y = job_batch(job0, 0); n = spec.micro_batch_size
rows = profile_tensors([(f"l{i}", m) for i, m in enumerate(layers)], x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))
res = json.load(open(".scratch/res_gpipe2.json"))
lat, bw = _links(res[0]["links"])
for key in ("keep", "limited"):
    runs = [r[key] for r in res]
    plan = None if key == "keep" else _plan(rows, spec, 2, "gpipe", res[0]["budgets"], ("peer", "recompute")).placement
    for i in range(5):
        sim = predict(rows, runs, spec, "gpipe", plan, lat, bw, step=i)
        m = max(r["step_s"][i] for r in runs)
        print(key, i, round(m, 3), round(sim.step_s, 3), round((sim.step_s - m) / m, 3))
