#!/usr/bin/env bash
# Memory safety on the GPU: a slice of the suite under compute-sanitizer memcheck
# (elementwise layouts and block boundaries, the fast path's direct launches, both
# matmul kernels at odd sizes), and the matmul under racecheck.
#   bash scripts/sanitize.sh            (MEMCHECK_SECS, RACECHECK_SECS: each part's limit)
# The selection first runs once without the sanitizer so that compiling kernels (and
# tuning) is not done under it. One process: on the H200 (2026-12-02) 14 xdist workers
# under memcheck reported no test at all in 400 s, so SANITIZE_WORKERS defaults to 0.
# Output streams as the tests finish (a part cut off by its limit still shows how far it
# got); each part ends with compute-sanitizer's "ERROR SUMMARY" line and the last line
# gives both exit codes.
set -uo pipefail
cd "$(dirname "$0")/.."
export FUSEDKIT_AUTOTUNE=0
workers=()
[ "${SANITIZE_WORKERS:-0}" -gt 0 ] && workers=(-n "$SANITIZE_WORKERS")
MEM_TESTS=(tests/test_elementwise.py tests/test_fast_path.py
  "tests/test_matmul.py::test_odd_sizes" "tests/test_matmul.py::test_every_output_element_is_written")
MEM_K="not 2_pow_31 and not cuda_graph"
RACE_TESTS=(tests/test_matmul.py -k "odd_sizes or every_activation")
echo "== warm-up (no sanitizer)"
timeout "${WARMUP_SECS:-120}" python3 -m pytest -q -p no:cacheprovider "${MEM_TESTS[@]}" -k "$MEM_K" 2>&1 | tail -3
sanitized() {  # sanitized TOOL SECONDS PYTEST_ARGS...
  local tool=$1 secs=$2; shift 2
  echo "== $tool: $*"
  timeout -k 20 "$secs" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 1 \
    python3 -u -m pytest -v -p no:cacheprovider "${workers[@]}" "$@" 2>&1
}
sanitized memcheck "${MEMCHECK_SECS:-400}" "${MEM_TESTS[@]}" -k "$MEM_K"
mem=$?
sanitized racecheck "${RACECHECK_SECS:-150}" "${RACE_TESTS[@]}"
race=$?
echo "memcheck rc=$mem racecheck rc=$race (124: cut off by its limit)"
exit $(( mem || race ))
