#!/usr/bin/env bash
# Memory safety on the GPU: a representative slice of the suite under
# compute-sanitizer memcheck (elementwise, the fast path's direct launches,
# fuzzing, both matmul kernels), and the matmul under racecheck.
#   bash scripts/sanitize.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export FUSEDKIT_FUZZ_EXAMPLES=${FUSEDKIT_FUZZ_EXAMPLES:-30}
# Compiling is most of the time: spread the tests over pytest-xdist workers when it is
# installed (compute-sanitizer follows child processes).
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-14}")
compute-sanitizer --tool memcheck --target-processes all --error-exitcode 1 \
  python3 -m pytest -q -p no:cacheprovider "${workers[@]}" \
  tests/test_elementwise.py tests/test_fast_path.py tests/test_fuzz.py \
  "tests/test_matmul.py::test_odd_sizes" "tests/test_matmul.py::test_every_output_element_is_written" \
  -k "not 2_pow_31" 2>&1 | tail -5
mem=${PIPESTATUS[0]}
FUSEDKIT_AUTOTUNE=0 compute-sanitizer --tool racecheck --target-processes all --error-exitcode 1 \
  python3 -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_matmul.py \
  -k "odd_sizes or every_activation" 2>&1 | tail -5
race=${PIPESTATUS[0]}
echo "memcheck rc=$mem racecheck rc=$race"
exit $(( mem || race ))
