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
# Every tensor its own cudaMalloc, so memcheck sees an access past a tensor's end: with
# PyTorch's caching allocator tensors share 2 MiB segments, and an overrun that stays
# inside one is invisible to it (the runs up to 2026-12-03 had the cache on).
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
workers=()
[ "${SANITIZE_WORKERS:-0}" -gt 0 ] && workers=(-n "$SANITIZE_WORKERS")
# Most telling first (a part cut off by its limit still covers these): the matmul's
# masked edges, the fast path's direct launches, then the elementwise layouts.
MEM_TESTS=(tests/test_matmul.py::test_odd_sizes tests/test_matmul.py::test_every_output_element_is_written
  tests/test_matmul.py::test_split_k_configs tests/test_fast_path.py tests/test_elementwise.py::test_block_boundaries
  tests/test_elementwise.py::test_high_rank_permuted tests/test_elementwise.py::test_out_layouts_and_aliasing
  tests/test_elementwise.py::test_in_place_on_broadcast_and_transposed_views
  tests/test_elementwise.py::test_strided_views tests/test_elementwise.py::test_broadcast
  tests/test_elementwise.py::test_contiguous)
MEM_K="not 2_pow_31 and not cuda_graph"
RACE_TESTS=(tests/test_matmul.py -k "odd_sizes or every_activation or split_k")
# SANITIZE_TESTS="tests/x.py::test_y ...": that selection alone, under both tools.
if [ -n "${SANITIZE_TESTS:-}" ]; then
  read -ra MEM_TESTS <<< "$SANITIZE_TESTS"; RACE_TESTS=("${MEM_TESTS[@]}"); MEM_K=""
fi
echo "== warm-up (no sanitizer)"
timeout "${WARMUP_SECS:-120}" python3 -m pytest -q -p no:cacheprovider "${MEM_TESTS[@]}" -k "$MEM_K" 2>&1 | tail -3
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
sanitized() {  # sanitized TOOL SECONDS PYTEST_ARGS...
  local tool=$1 secs=$2; shift 2
  printf '\n== %s: %s\n' "$tool" "$*"  # (a cut-off run leaves its last line unfinished)
  timeout -k 20 "$secs" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 1 \
    python3 -u -m pytest -v -p no:cacheprovider "${workers[@]}" "$@" 2>&1 | tee "$LOG"
  local r=$?
  # A count that survives a cut-off: the tests that finished, and the tool's reports so far.
  echo; echo "== $tool: $(grep -c ' PASSED' "$LOG") tests passed, $(grep -c ' FAILED' "$LOG") failed," \
       "$(grep -E '^========= ' "$LOG" | grep -vc -e 'COMPUTE-SANITIZER' -e ' SUMMARY') sanitizer report lines;" \
       "$(grep -E '(ERROR|RACECHECK) SUMMARY' "$LOG" || echo 'no summary line (cut off)')"
  return $r
}
sanitized memcheck "${MEMCHECK_SECS:-400}" "${MEM_TESTS[@]}" -k "$MEM_K"
mem=$?
sanitized racecheck "${RACECHECK_SECS:-150}" "${RACE_TESTS[@]}"
race=$?
printf '\nmemcheck rc=%s racecheck rc=%s (124: cut off by its limit)\n' "$mem" "$race"
exit $(( mem || race ))
