#!/usr/bin/env bash
# The GPU check in one command: the CUDA tests (`python -m pytest -m cuda`), then
# `trainwright bench memory --device cuda`; writes docs/bench/gpu.json (device, versions,
# every test outcome and bench figure) and prints a summary. Sized for under 8 minutes on
# one H100. Without a CUDA device it exits at once (code 3), saying so in one line.
#
#   tools/gpu_check.sh [OUT.json]        (default docs/bench/gpu.json)
#   GPU_CHECK_TESTS_S / GPU_CHECK_BENCH_S: time limits of the two parts (default 270 / 300 s)
#   GPU_CHECK_WORK: where the logs, the junit XML and the bench JSON go (default: a temp dir)
#   GPU_CHECK_TESTS_K: a pytest -k expression to run only some CUDA tests (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
  echo "gpu_check: no CUDA device is present (torch.cuda.is_available() is false); nothing checked"
  exit 3
fi
OUT_JSON=${1:-docs/bench/gpu.json}
WORK=${GPU_CHECK_WORK:-$(mktemp -d -t gpu-check-XXXX)}
mkdir -p "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
echo "gpu_check: CUDA tests (log: $WORK/tests.log)"
timeout "${GPU_CHECK_TESTS_S:-270}" "$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider \
  -q -rfEs --junitxml="$WORK/cuda.xml" ${GPU_CHECK_TESTS_K:+-k "$GPU_CHECK_TESTS_K"} 2>&1 \
  | tee "$WORK/tests.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu_check: bench memory --device cuda (log: $WORK/bench.log)"
timeout "${GPU_CHECK_BENCH_S:-300}" "$PY" -m trainwright bench memory --device cuda \
  --json "$WORK/bench.json" 2>&1 | tee "$WORK/bench.log"
bench_rc=${PIPESTATUS[0]}
"$PY" tools/gpu_check.py --junit "$WORK/cuda.xml" --bench "$WORK/bench.json" \
  --bench-log "$WORK/bench.log" --tests-rc "$tests_rc" --bench-rc "$bench_rc" \
  --wall-s "$(( $(date +%s) - start ))" --out "$OUT_JSON"
