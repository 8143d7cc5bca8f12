import json
from trainwright.bench.planner import PlannerBenchSpec, predict_steps, predict, _measured, _links, _plan
from trainwright.pipeline.harness import job_batch, job_layers
from trainwright.tensor_profile import profile_tensors
import torch
if __name__ == "__main__":
    spec = PlannerBenchSpec(stage_counts=[2], schedules=["1f1b"])
    job0 = spec.job(1, "1f1b"); layers = job_layers(job0); x, y = job_batch(job0, 0); n = spec.micro_batch_size
    rows = profile_tensors([(f"l{i}", m) for i, m in enumerate(layers)], x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))
    res = json.load(open("/tmp/res2.json"))
    lat, bw = _links(res[0]["links"])
    keep = [r["keep"] for r in res]
    print(_measured(keep, spec.warmup))
    for i in range(spec.warmup, 5):
        print(i, max(r["step_s"][i] for r in keep), predict(rows, keep, spec, "1f1b", None, lat, bw, step=i).step_s)
    lim = [r["limited"] for r in res]
    plan = _plan(rows, spec, 2, "1f1b", res[0]["budgets"], ("peer", "recompute"))
    print(_measured(lim, spec.warmup), plan.to_dict()["policy_counts"])
    for i in range(spec.warmup, 5):
        s = predict(rows, lim, spec, "1f1b", plan.placement, lat, bw, step=i)
        print(i, max(r["step_s"][i] for r in lim), s.step_s, s.peak_bytes)
