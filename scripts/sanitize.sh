#!/usr/bin/env bash
# Memory safety on the GPU: a representative slice of the suite under
# compute-sanitizer memcheck (the fast path's direct launches, the C++ launch
# table, both matmul kernels, fuzzing, elementwise), and the matmul under racecheck.
#   bash scripts/sanitize.sh            (MEMCHECK_SECS, RACECHECK_SECS: each part's limit)
# Output streams to this script's stdout as the tests finish (a part cut off by its
# limit still shows how far it got); each part ends with compute-sanitizer's
# "ERROR SUMMARY" line and the last line gives both exit codes.
set -uo pipefail
cd "$(dirname "$0")/.."
export FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-30}
# Spread the tests over pytest-xdist workers when it is installed (compute-sanitizer
# follows child processes). H200, 2026-12-02: 14 workers did not finish the memcheck
# part in 330 s (its log was lost to a pipe; it streams now).
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-14}")
sanitized() {  # sanitized TOOL SECONDS PYTEST_ARGS...
  local tool=$1 secs=$2; shift 2
  echo "== $tool: $*"
  timeout -k 30 "$secs" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 1 \
    python3 -u -m pytest -v -p no:cacheprovider "${workers[@]}" "$@" 2>&1
}
sanitized memcheck "${MEMCHECK_SECS:-400}" tests/test_fast_path.py tests/test_native.py \
  "tests/test_matmul.py::test_odd_sizes" "tests/test_matmul.py::test_every_output_element_is_written" \
  tests/test_fuzz.py tests/test_elementwise.py -k "not 2_pow_31"
mem=$?
FUSEDKIT_AUTOTUNE=0 sanitized racecheck "${RACECHECK_SECS:-150}" tests/test_matmul.py -k "odd_sizes or every_activation"
race=$?
echo "memcheck rc=$mem racecheck rc=$race (124: cut off by its limit)"
exit $(( mem || race ))
