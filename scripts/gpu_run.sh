#!/usr/bin/env bash
# The whole GPU job in one call (the device lease is short): environment, the
# test suite on the GPU, then the fused-vs-unfused report. Full logs go to $OUT;
# the short table prints last.
#   bash scripts/gpu_run.sh [quick]
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mode=${1:-full}
cd "$(dirname "$0")/.."

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"

FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-500} python3 -m pytest tests -q -p no:cacheprovider -x \
  > "$OUT/pytest.txt" 2>&1
test_rc=$?
tail -5 "$OUT/pytest.txt"

if [ "$mode" = quick ]; then
  python3 -m fusedkit bench --sizes 24 --no-compile > "$OUT/bench.txt" 2>"$OUT/bench.err"
  bench_rc=$?
else
  python3 -m fusedkit bench --sizes 20,24,28 --json "$OUT/bench.json" --csv "$OUT/bench.csv" \
    > "$OUT/bench.txt" 2>"$OUT/bench.err"
  bench_rc=$?
  # Odd sizes defeat Triton's 16-divisibility specialisation (no 16-byte loads): how much does it cost?
  python3 -m fusedkit bench --kernels add_relu --dtypes fp32 --sizes 268435456,268435457 \
    --layouts contiguous --no-compile > "$OUT/bench_odd.txt" 2>>"$OUT/bench.err"
  PYTHONPATH=. python3 benchmarks/probe_latency.py 1024 > "$OUT/probe.txt" 2>&1
fi
tr '\r' '\n' < "$OUT/bench.err" | grep -v '^\[' | tail -3
echo "pytest rc=$test_rc bench rc=$bench_rc"
tail -n +4 "$OUT/bench_odd.txt" 2>/dev/null
head -7 "$OUT/probe.txt" 2>/dev/null
cat "$OUT/bench.txt"
exit $(( test_rc || bench_rc ))
