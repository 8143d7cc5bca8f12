import json, statistics, sys
from trainwright.bench.planner import PlannerBenchSpec, _spawn, _accuracy_worker
from trainwright.pipeline.harness import job_batch, job_layers
from trainwright.tensor_profile import profile_tensors
import torch, pickle
if __name__ == "__main__":
    k, sch = int(sys.argv[1]), sys.argv[2]
    spec = PlannerBenchSpec(stage_counts=[k], schedules=[sch])
    job0 = spec.job(1, "1f1b"); layers = job_layers(job0); x, y = job_batch(job0, 0); n = spec.micro_batch_size
    rows = profile_tensors([(f"l{i}", m) for i, m in enumerate(layers)], x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))
    pickle.dump(rows, open(f".scratch/rows.pkl", "wb"))
    res = _spawn(_accuracy_worker, k, spec, sch, rows, True)
    json.dump(res, open(f".scratch/res_{sch}{k}.json", "w"))
