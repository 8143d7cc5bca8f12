import json, statistics
from trainwright.bench.planner import PlannerBenchSpec, _spawn, _accuracy_worker, _links, predict
from trainwright.pipeline.harness import job_batch, job_layers
from trainwright.tensor_profile import profile_tensors
import torch
if __name__ == "__main__":
    spec = PlannerBenchSpec(stage_counts=[2], schedules=["gpipe"])
    job0 = spec.job(1, "1f1b"); layers = job_layers(job0); x, y = job_batch(job0, 0); n = spec.micro_batch_size
    rows = profile_tensors([(f"l{i}", m) for i, m in enumerate(layers)], x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))
    res = _spawn(_accuracy_worker, 2, spec, "gpipe", rows, True)
    json.dump(res, open(".scratch/res_gpipe2.json", "w"))
    lat, bw = _links(res[0]["links"]); print("links", lat, bw)
    keep = [r["keep"] for r in res]
    for i in range(5):
        sim = predict(rows, keep, spec, "gpipe", None, lat, bw, step=i)
        print("step", i, "measured", [round(r["step_s"][i], 3) for r in keep], "pred", round(sim.step_s, 3))
        for r, rr in enumerate(keep):
            agg = {}
            for kind, mb, d in rr["events"][i]:
                agg.setdefault(kind, []).append(d)
            print("  rank", r, {kk: (round(sum(v), 3), round(statistics.median(v)*1e3, 1)) for kk, v in agg.items()}, "sum", round(sum(sum(v) for v in agg.values()), 3))
        busy = {}
        for s, k, mb, st, en in sim.timeline:
            busy.setdefault((s, k), 0.0); busy[(s, k)] += en - st
        print("  sim", {f"{s}{k}": round(v, 3) for (s, k), v in busy.items()})
