import torch
from trainwright.bench.planner import PlannerBenchSpec, _plan
from trainwright.pipeline.harness import job_batch, job_layers
from trainwright.tensor_profile import profile_tensors
spec = PlannerBenchSpec(n_blocks=2, d_model=32, n_heads=2, context=16, vocab=64, micro_batches=4, micro_batch_size=2, steps=3, warmup=1, stage_counts=[2], schedules=["1f1b"])
job0 = spec.job(1, "1f1b"); layers = job_layers(job0); x, y = job_batch(job0, 0); n = spec.micro_batch_size
rows = profile_tensors([(f"l{i}", m) for i, m in enumerate(layers)], x[:n], y[:n], lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()))
for fam in (("peer",), ("peer", "recompute")):
    p = _plan(rows, spec, 2, "1f1b", [85286, 225352], fam)
    d = p.to_dict()
    print(fam, d["fits"], d["predicted"]["activation_peak_bytes"], d["predicted"]["peak_bytes"], [sp.required_bytes for sp in p.placement.stages], p.placement.stages[0].keep_bytes)
