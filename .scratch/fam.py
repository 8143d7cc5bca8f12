import json
from trainwright.bench.planner import PlannerBenchSpec, run
if __name__ == "__main__":
    spec = PlannerBenchSpec(n_blocks=2, d_model=32, n_heads=2, context=16, vocab=64,
                            micro_batches=4, micro_batch_size=2, steps=3, warmup=1,
                            stage_counts=[2], schedules=["1f1b"])
    r = run(spec, repeats=1, big=False)
    print(r["family_limit_bytes"])
    for f, v in r["families"].items(): print(f, v["fits"], v["peak_bytes_per_stage"], v["policy_counts"])
