#!/usr/bin/env bash
# The GPU job (a device lease is short): the test suite and the reports, each stage under
# its own time limit, writing into a work folder that is re-packed into $OUT/gpu_run.tgz
# after every stage, so a call that runs out of time still returns what finished; the test
# log goes straight to $OUT/pytest.txt. The short tables print last.
#   bash scripts/gpu_run.sh [STAGE ...]    (no stage: env tests)
# Stages: env; tests (the suite, PYTEST_ARGS: default the tests folder); results [REPORTS]
# (scripts/results.sh into the work folder: RESULTS_REPORTS, default all: models elementwise ncu
# matmul latency backward norms traffic advise); fuzz (2,000 examples an op, FUZZ_ARGS); sanitize
# (scripts/sanitize.sh); pybench (the pytest-benchmark suite); python (the latency report with
# FUSEDKIT_NATIVE_LAUNCH=0: the Python path beside the default C++ one). <STAGE>_SECS overrides a stage's limit (e.g. PYTEST_SECS=300);
# FUSEDKIT_SKIP_PASSED=.gpu-passed.txt (a carried pytest.txt of an earlier call) runs only
# the tests that log does not report as passed. The device's copy of the tree has no .git:
# pass FUSEDKIT_COMMIT=<the commit> so the results name it.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
W=$(mktemp -d)
cd "$(dirname "$0")/.."
stages=${*:-env tests}
rc=0
# pytest-xdist and ninja (which fusedkit/runtime/native.py's C++ build needs) are in the device
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
# Peers the device image lacks (Liger-Kernel, for the model report's llama_mlp): wheels
# carried in .gpu-wheels/ (git-ignored; pure-Python, built for Python 3.12) are unpacked into
# a folder on PYTHONPATH for every stage: the image's venv is not writable.
if compgen -G ".gpu-wheels/*.whl" > /dev/null; then
  python3 -m pip install --quiet --no-deps --target /tmp/fusedkit-peers .gpu-wheels/*.whl \
    && export PYTHONPATH="/tmp/fusedkit-peers${PYTHONPATH:+:$PYTHONPATH}" \
    && echo "[peers] $(ls .gpu-wheels)" >> "$OUT/steps.txt"
fi
CACHE=/tmp/fusedkit-gpu-cache
mkdir -p "$CACHE"
[ -f .gpu-cache.tgz ] && tar xzf .gpu-cache.tgz -C "$CACHE" 2>/dev/null
export TRITON_CACHE_DIR="$CACHE/triton" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" FUSEDKIT_CACHE_DIR="$CACHE/fusedkit"
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
         python3 -m fusedkit build  # the C++ launch table, as scripts/run.sh builds it
       } > "$W/env.txt" 2>&1; cp "$W/env.txt" "$OUT/env.txt" ;;
  tests) FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-60} step pytest 420 \
           python3 -u -m pytest -v -p no:cacheprovider --durations=25 "${xdist[@]}" ${PYTEST_ARGS:-tests} ;;
  results) RESULTS_DIR="$W/results" step results ${RESULTS_SECS:-590} bash scripts/results.sh ${RESULTS_REPORTS:-} ;;
  python) FUSEDKIT_NATIVE_LAUNCH=0 step latency_python 200 python3 -m fusedkit bench --latency --no-progress \
            --json "$W/latency_python.json" ;;
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
tail -16 "$W/latency_python.txt" 2>/dev/null
for f in "$W"/results/*.txt; do [ -f "$f" ] && { echo "== $f"; tail -24 "$f"; }; done
exit $rc
