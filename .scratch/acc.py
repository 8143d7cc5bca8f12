import json, sys, time
from trainwright.bench.planner import PlannerBenchSpec, run
if __name__ == "__main__":
    t0 = time.time()
    spec = PlannerBenchSpec(stage_counts=[int(sys.argv[1])], schedules=sys.argv[2].split(","))
    r = run(spec, repeats=1, big=False)
    json.dump(r, open(f".scratch/acc_{sys.argv[1]}.json", "w"), indent=1)
    for a in r["accuracy_runs"]:
        print({k: a[k] for k in ("stages", "schedule", "limit", "measured_step_s", "predicted_step_s", "step_error", "measured_peak_bytes", "predicted_peak_bytes", "peak_error_max")})
    print({k: r[k] for k in ("peer_swap_step_s", "host_swap_step_s", "recompute_step_s", "peer_vs_best_other")})
    print(time.time() - t0)
