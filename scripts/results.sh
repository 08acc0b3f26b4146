#!/usr/bin/env bash
# Regenerates the committed benchmark results of this machine's GPU and the tables built from them:
#   bash scripts/results.sh [REPORT ...]    reports: whole models elementwise ncu matmul latency backward norms traffic advise (default: all)
# Each report writes benchmarks/results/<gpu>/<report>.txt (what it printed) and .json (the
# numbers and the environment: GPU, driver, torch, triton, fusedkit version and commit, date);
# the elementwise and matmul reports also their plots. Then docs/results.md and the README's
# headline table are rendered from those files (benchmarks/render_results.py).
# RESULTS_DIR overrides the folder; MATMUL_DTYPES (default bf16,fp16) the matmul report's dtypes.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# (the GPU's model, as in "NVIDIA H100 80GB HBM3" -> h100; the name's last word otherwise)
gpu=$("$py" -c "import re, torch; n = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'; m = re.search(r'\b[A-Z]+[0-9]+[A-Z]*\b', n); print((m.group() if m else n.split()[-1]).lower())") \
  || { echo "[results] $py has no PyTorch: run bash scripts/run.sh test first, or set PYTHON" >&2; exit 1; }
dir=${RESULTS_DIR:-benchmarks/results/$gpu}
mkdir -p "$dir"
reports=${*:-whole models elementwise ncu matmul latency backward norms traffic advise}
rc=0
run_report() {  # run_report NAME COMMAND...: COMMAND --no-progress --json into $dir/NAME.{txt,json}
  local name=$1; shift
  echo "[results] $name: $*" >&2
  if ! "$@" --no-progress --json "$dir/$name.json" > "$dir/$name.txt" 2>&1; then
    echo "[results] $name failed: see $dir/$name.txt" >&2; rc=1
  fi
}
report() {  # report NAME ARGS...: one `python -m fusedkit bench` report (through scripts/run.sh)
  local name=$1; shift
  run_report "$name" bash scripts/run.sh bench "$@"
}
for r in $reports; do case $r in
  # whole models in three processes (each number their median; docs/fuse.md), the blocks in one
  # (WHOLE_MODELS=gpt2,bert WHOLE_PROCESSES=1 WHOLE_ADD=1: add to the committed record, a lease at a time)
  whole) report whole --models "${WHOLE_MODELS:-whole}" --processes "${WHOLE_PROCESSES:-3}" ${WHOLE_ADD:+--add} ;;
  models) report models --models blocks ;;
  # (the ops model code calls: the gradient kernels are timed in place by the backward report)
  elementwise) report elementwise --kernels ops --sizes 20,24,28 --csv "$dir/elementwise.csv" --plots "$dir" ;;
  ncu) report ncu --ncu --kernels add_relu,add --dtypes fp32,bf16 --sizes 20,26 --no-compile ;;
  matmul) report matmul --matmul --dtypes "${MATMUL_DTYPES:-bf16,fp16}" --plots "$dir" ;;
  # (three processes on one core: the host table's protocol, docs/benchmarks.md "Small tensors")
  latency) report latency --latency --processes "${LATENCY_PROCESSES:-3}" --pin ;;
  backward) report backward --backward --dtypes bf16 ;;
  norms) report norms --norms --dtypes bf16 ;;
  traffic) report traffic --traffic ;;
  advise) run_report advise "$py" -m fusedkit advise ;;
  *) echo "unknown report $r" >&2; rc=1 ;;
esac; done
"$py" benchmarks/render_results.py "$dir" || rc=1
exit $rc
