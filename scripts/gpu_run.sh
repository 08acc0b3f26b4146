#!/usr/bin/env bash
# The GPU job (the device lease is short: 30 min a session, 10 min a call).
# Stages write straight into $OUT as they go, each under its own time limit, so a
# call that runs out of time still returns what finished.  The short tables print last.
#   bash scripts/gpu_run.sh [STAGE ...]    stages: env tests bench ncu matmul latency
#   (no stage = all; FUSEDKIT_FUZZ_EXAMPLES and PYTEST_ARGS pass through)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
stages=${*:-env tests bench ncu matmul latency}
rc=0
# pytest-xdist is not on the device: wheels carried in .wheels/ (git-ignored), if present.
xdist=()
if ls .wheels/pytest_xdist-*.whl >/dev/null 2>&1 &&
   pip install -q --no-index --find-links .wheels pytest-xdist >/dev/null 2>&1; then
  xdist=(-n "${TEST_WORKERS:-8}")
fi
step() {  # step NAME SECONDS CMD...: run CMD, stdout+stderr to $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
  local r=$?
  echo "[$name] rc=$r $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
  [ $r -ne 0 ] && rc=1
  return 0
}
for s in $stages; do case $s in
  env) { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
       } > "$OUT/env.txt" 2>&1 ;;
  tests) FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-500} step pytest ${TEST_SECS:-420} \
           python3 -u -m pytest tests -v -p no:cacheprovider --durations=25 "${xdist[@]}" ${PYTEST_ARGS:-} ;;
  bench) step bench 240 python3 -m fusedkit bench --sizes 20,24,28 --json "$OUT/bench.json" \
           --csv "$OUT/bench.csv" --plots "$OUT/plots" ;;
  ncu) step ncu 180 python3 -m fusedkit bench --ncu --kernels add_relu,add --dtypes fp32,bf16 \
         --sizes 26 --no-compile --json "$OUT/ncu.json" ;;
  matmul) step matmul 240 python3 -m fusedkit bench --matmul --dtypes bf16,fp16 \
            --json "$OUT/matmul.json" --plots "$OUT/plots" ;;
  latency) step latency 200 python3 -m fusedkit bench --latency --json "$OUT/latency.json"
           PYTHONPATH=. step probe 60 python3 benchmarks/probe_latency.py 1024 ;;
  *) echo "unknown stage $s"; rc=1 ;;
esac; done
[ -d "$OUT/plots" ] && tar czf "$OUT/plots.tgz" -C "$OUT" plots && rm -rf "$OUT/plots"
cat "$OUT/env.txt" 2>/dev/null
cat "$OUT/steps.txt" 2>/dev/null
[ -f "$OUT/pytest.txt" ] && grep -E "^(FAILED|ERROR)|passed|failed|[0-9.]+s (call|setup)" "$OUT/pytest.txt" | tail -45
head -12 "$OUT/probe.txt" 2>/dev/null
tail -16 "$OUT/latency.txt" 2>/dev/null
grep -A12 "DRAM bytes" "$OUT/ncu.txt" 2>/dev/null
tail -18 "$OUT/matmul.txt" 2>/dev/null
tail -30 "$OUT/bench.txt" 2>/dev/null
exit $rc
