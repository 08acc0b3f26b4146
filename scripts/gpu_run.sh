#!/usr/bin/env bash
# The whole GPU job in one call (the device lease is short): environment, the test
# suite on the GPU, the fused-vs-unfused report with plots, Nsight Compute bytes,
# the matmul report and the latency probe. Everything lands in one tarball under
# $OUT (the device tool returns at most 8 files); the short tables print last.
#   bash scripts/gpu_run.sh [quick]
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mode=${1:-full}
cd "$(dirname "$0")/.."
W=$(mktemp -d)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$W/env.txt" 2>&1

FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-500} python3 -m pytest tests -q -p no:cacheprovider \
  > "$W/pytest.txt" 2>&1
test_rc=$?

bench_rc=0
if [ "$mode" = quick ]; then
  python3 -m fusedkit bench --sizes 24 --no-compile > "$W/bench.txt" 2>"$W/bench.err" || bench_rc=$?
else
  python3 -m fusedkit bench --sizes 20,24,28 --json "$W/bench.json" --csv "$W/bench.csv" --plots "$W/plots" \
    > "$W/bench.txt" 2>"$W/bench.err" || bench_rc=$?
  python3 -m fusedkit bench --ncu --kernels add_relu,add --dtypes fp32,bf16 --sizes 26 --no-compile \
    --json "$W/ncu.json" > "$W/ncu.txt" 2>>"$W/bench.err" || bench_rc=$?
  python3 -m fusedkit bench --matmul --dtypes bf16,fp16 --json "$W/matmul.json" --plots "$W/plots" \
    > "$W/matmul.txt" 2>>"$W/bench.err" || bench_rc=$?
  PYTHONPATH=. python3 benchmarks/probe_latency.py 1024 > "$W/probe.txt" 2>&1
fi

tar czf "$OUT/gpu_run.tgz" -C "$W" .
cat "$W/env.txt"
tail -3 "$W/pytest.txt"
tr '\r' '\n' < "$W/bench.err" | grep -v '^\[' | tail -5
echo "pytest rc=$test_rc bench rc=$bench_rc   (all files: \$OUT/gpu_run.tgz)"
head -8 "$W/probe.txt" 2>/dev/null
grep -A12 "DRAM bytes" "$W/ncu.txt" 2>/dev/null
cat "$W/matmul.txt" 2>/dev/null | tail -18
tail -40 "$W/bench.txt"
exit $(( test_rc || bench_rc ))
