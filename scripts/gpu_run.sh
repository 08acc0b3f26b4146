#!/usr/bin/env bash
# The GPU job (the device lease is short: 30 min a session, 10 min a call).
# Each stage runs under its own time limit and writes into a work folder that is
# re-packed into $OUT/gpu_run.tgz after every stage (the device returns at most 8
# files), so a call that runs out of time still returns what finished; the test
# log goes straight to $OUT/pytest.txt.  The short tables print last.
#   bash scripts/gpu_run.sh [STAGE ...]    stages: env tests bench ncu matmul backward latency
#   (and linprobe: benchmarks/probe_linear_backward.py alone; mmprobe: every tuning config timed;
#   tf32probe: the fp32 tf32x3 splits side by side; smallm: small-M bf16 do_bench, host and graph times;
#   fp32probe: fp32 modes against torch, time and error; matmul_tf32: the fp32 matmul report with TF32 allowed;
#   tf32layout: TF32 with a row-major b: a small kernel two ways, a TMA kernel three ways;
#   mmncu: fusedkit's and cuBLASLt's matmul kernels under ncu, MMNCU_ARGS; tmatiles: TMA kernel
#   tiles at M = 64 / 512 and fp32's kernel choice by M, TMATILES_ARGS "tiles", "fp32", "tf32", "halves")
#   (and sanitize, fuzz (2,000 examples an op), pybench, native (the C++ launch probe and the
#   latency report with FUSEDKIT_NATIVE_LAUNCH=1): not in the default set)
#   (no stage = all; FUSEDKIT_FUZZ_EXAMPLES / _SHARDS, FUZZ_ARGS (e.g. "-k matmul"), PYTEST_ARGS (default: the tests folder),
#   MATMUL_DTYPES, MATMUL_SHAPES (e.g. 512x4096x4096,64x4096x4096), MMPROBE_ARGS, TF32PROBE_ARGS, FP32PROBE_ARGS, SMALLM_ARGS pass through; <STAGE>_SECS overrides a stage's time limit, e.g. PYTEST_SECS=300 for the tests stage;
#   FUSEDKIT_SKIP_PASSED=.gpu-passed.txt (a carried copy of an earlier call's pytest.txt) runs only
#   the tests that log does not report as passed)
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
W=$(mktemp -d)
cd "$(dirname "$0")/.."
stages=${*:-env tests bench ncu matmul backward latency}
rc=0
# pytest-xdist and ninja (which fusedkit/_native.py's C++ build needs) are in the device
# image. Earlier runs tried to pip-install carried wheels, and that install failing
# (the image's venv is not writable) silently dropped -n: the suite ran on one worker.
xdist=()
if python3 -c "import xdist" 2>/dev/null; then
  xdist=(-n "${TEST_WORKERS:-14}" --dist worksteal)
  echo "[xdist] ${TEST_WORKERS:-14} workers" >> "$OUT/steps.txt"
else
  echo "[xdist] not installed: tests run on one worker" >> "$OUT/steps.txt"
fi
# Compiling kernels is most of the suite's time on a fresh machine (every dtype, layout
# and autotune config). Triton's and Inductor's caches travel between calls: a carried
# .gpu-cache.tgz (git-ignored) is unpacked here and the grown cache comes back as
# $OUT/gpu-cache.tgz.00, .01, ... (at most 16 MiB a file comes back, and 8 files a call):
# cat them into .gpu-cache.tgz and pass carry: [".gpu-cache.tgz"] (64 MiB at most).
# A fixed path: Triton's cache index records absolute file paths, so a cache unpacked
# anywhere else misses every kernel.
CACHE=/tmp/fusedkit-gpu-cache
mkdir -p "$CACHE"
[ -f .gpu-cache.tgz ] && tar xzf .gpu-cache.tgz -C "$CACHE" 2>/dev/null
export TRITON_CACHE_DIR="$CACHE/triton" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
CACHE_CHUNKS=3  # the other five files: gpu_run.tgz, pytest.txt, env.txt, steps.txt, and one spare
pack_cache() {  # SKIP_CACHE_PACK=1: not at all (a 1.2 GB cache took about 30 s a stage to pack, 9ec4d64)
  [ -n "${SKIP_CACHE_PACK:-}" ] && return 0
  tar czf "$CACHE.tgz" -C "$CACHE" . 2>/dev/null
  rm -f "$OUT"/gpu-cache.tgz.*
  if [ "$(stat -c %s "$CACHE.tgz")" -le $((CACHE_CHUNKS * 15 * 1024 * 1024)) ]; then
    split -b 15M -d -a 2 "$CACHE.tgz" "$OUT/gpu-cache.tgz."
  else
    echo "[cache] $(du -sh "$CACHE" | cut -f1) unpacked: too big to come back" | tee -a "$OUT/steps.txt"
  fi
  rm -f "$CACHE.tgz"
}
step() {  # step NAME SECONDS CMD...: run CMD, stdout+stderr to $W/NAME.txt; NAME_SECS overrides SECONDS
  local name=$1 var; var="$(echo "$1" | tr a-z A-Z)_SECS"
  local secs=${!var:-$2}; shift 2
  local t0=$SECONDS log="$W/$name.txt"
  [ "$name" = pytest ] && log="$OUT/pytest.txt"
  timeout "$secs" "$@" > "$log" 2>&1
  local r=$?
  echo "[$name] rc=$r $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
  [ $r -ne 0 ] && rc=1
  tar czf "$OUT/gpu_run.tgz" -C "$W" .
  pack_cache
  return 0
}
for s in $stages; do case $s in
  env) { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
         python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
       } > "$W/env.txt" 2>&1; cp "$W/env.txt" "$OUT/env.txt" ;;
  tests) FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-60} step pytest 420 \
           python3 -u -m pytest -v -p no:cacheprovider --durations=25 "${xdist[@]}" ${PYTEST_ARGS:-tests} ;;
  bench) step bench 240 python3 -m fusedkit bench --sizes 20,24,28 --json "$W/bench.json" \
           --csv "$W/bench.csv" --plots "$W/plots" ;;
  ncu) step ncu 240 python3 -m fusedkit bench --ncu --kernels add_relu,add --dtypes fp32,bf16 \
         --sizes 20,26 --no-compile --json "$W/ncu.json" ;;  # 2^20: inside L2, also measured warm
  matmul) step matmul 300 python3 -m fusedkit bench --matmul --dtypes ${MATMUL_DTYPES:-bf16,fp16} ${MATMUL_SHAPES:+--shapes $MATMUL_SHAPES} \
            --json "$W/matmul.json" --plots "$W/plots" ;;
  matmul_tf32) step matmul_tf32 200 python3 -m fusedkit bench --matmul --tf32 --dtypes fp32 ${MATMUL_SHAPES:+--shapes $MATMUL_SHAPES} \
                 --json "$W/matmul_tf32.json" ;;  # fp32 with TF32 allowed, both sides
  backward) step backward 150 python3 -m fusedkit bench --backward --dtypes bf16 --json "$W/backward.json"
            # fp32 apart (BACKWARD_FP32=0 skips it): tuning the fp32 LinearReLU matmuls is the slow part
            [ "${BACKWARD_FP32:-1}" != 0 ] && step backward_fp32 200 python3 -m fusedkit bench --backward --dtypes fp32 \
              --json "$W/backward_fp32.json"
            PYTHONPATH=. step linprobe 120 python3 benchmarks/probe_linear_backward.py ;;
  linprobe) PYTHONPATH=. step linprobe 120 python3 benchmarks/probe_linear_backward.py ;;  # also inside backward
  mmprobe) PYTHONPATH=. step mmprobe 280 python3 benchmarks/probe_matmul_configs.py ${MMPROBE_ARGS:-} ;;  # e.g. "bf16 64 4096 4096"
  tf32probe) PYTHONPATH=. step tf32probe 120 python3 benchmarks/probe_tf32x3_split.py ${TF32PROBE_ARGS:-} ;;  # the fp32 splits side by side, e.g. "512 4096 4096"
  mmncu) PYTHONPATH=. step mmncu 240 python3 benchmarks/probe_matmul_ncu.py ${MMNCU_ARGS:-} ;;  # cuBLASLt's kernels beside ours under ncu, e.g. "bf16 512 4096 4096"
  tmatiles) PYTHONPATH=. step tmatiles 300 python3 benchmarks/probe_tma_tiles.py ${TMATILES_ARGS:-} ;;  # TMA tiles at M = 64 / 512; fp32's kernel by M
  tf32layout) PYTHONPATH=. step tf32layout 90 python3 benchmarks/probe_tf32_layout.py ;;  # TF32 with a row-major b
  smallm) PYTHONPATH=. step smallm 120 python3 benchmarks/probe_small_m.py ${SMALLM_ARGS:-} ;;  # small-M bf16: GPU or host time; SMALLM_ARGS="forced"
  fp32probe) PYTHONPATH=. step fp32probe 150 python3 benchmarks/probe_fp32.py ${FP32PROBE_ARGS:-} ;;  # fp32 modes: time and error, e.g. "--quick 1 8 64 512"
  latency) step latency 200 python3 -m fusedkit bench --latency --json "$W/latency.json"
           PYTHONPATH=. step probe 60 python3 benchmarks/probe_latency.py 1024 ;;
  native) PYTHONPATH=. step native 150 python3 benchmarks/probe_native_launch.py 1024
          FUSEDKIT_NATIVE_LAUNCH=1 step latency_native 200 python3 -m fusedkit bench --latency \
            --json "$W/latency_native.json" ;;
  sanitize) step sanitize 590 bash scripts/sanitize.sh ;;  # memcheck 400 s + racecheck 150 s: a call of its own
  fuzz) FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-2000} FUSEDKIT_FUZZ_SHARDS=${FUSEDKIT_FUZZ_SHARDS:-4} \
          step fuzz 500 python3 -u -m pytest tests/test_fuzz.py -v -p no:cacheprovider "${xdist[@]}" ${FUZZ_ARGS:-} \
          --junitxml "$W/fuzz.xml" ;;  # the examples each shard ran: <property name="examples">
  pybench) step pybench 500 python3 -m pytest benchmarks --benchmark-only -q -p no:cacheprovider \
             --benchmark-json "$W/pybench.json" ${PYBENCH_ARGS:-} ;;
  *) echo "unknown stage $s"; rc=1 ;;
esac; done
tar czf "$OUT/gpu_run.tgz" -C "$W" .
cat "$OUT/env.txt" 2>/dev/null
cat "$OUT/steps.txt" 2>/dev/null
[ -f "$OUT/pytest.txt" ] && grep -E "^(FAILED|ERROR)|passed|failed|[0-9.]+s (call|setup)" "$OUT/pytest.txt" | tail -45
grep -E "^== |rc=" "$W/sanitize.txt" 2>/dev/null
head -12 "$W/probe.txt" 2>/dev/null
tail -8 "$W/native.txt" 2>/dev/null
tail -16 "$W/latency_native.txt" 2>/dev/null
tail -16 "$W/latency.txt" 2>/dev/null
grep -A26 "DRAM bytes" "$W/ncu.txt" 2>/dev/null
grep -A14 "fit in L2 again" "$W/ncu.txt" 2>/dev/null
tail -18 "$W/matmul.txt" 2>/dev/null
tail -8 "$W/matmul_tf32.txt" 2>/dev/null
tail -8 "$W/backward.txt" "$W/backward_fp32.txt" 2>/dev/null
cat "$W/linprobe.txt" 2>/dev/null
cat "$W/mmprobe.txt" 2>/dev/null
cat "$W/tf32probe.txt" 2>/dev/null
cat "$W/tf32layout.txt" 2>/dev/null
cat "$W/mmncu.txt" 2>/dev/null
cat "$W/tmatiles.txt" 2>/dev/null
cat "$W/smallm.txt" 2>/dev/null
cat "$W/fp32probe.txt" 2>/dev/null
tail -30 "$W/bench.txt" 2>/dev/null
exit $rc
