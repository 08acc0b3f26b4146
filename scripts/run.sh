#!/usr/bin/env bash
# fusedkit's two jobs from a fresh clone, on a CPU or a GPU machine, with nothing done first:
#   bash scripts/run.sh bench [options]   the fused-vs-unfused report (python -m fusedkit bench --help)
#   bash scripts/run.sh test [pytest args]   the test suite (add -m "not slow" for the quick subset)
#   bash scripts/run.sh lint                 ruff check and ruff format --check (CI runs it before the tests)
# It uses $PYTHON, else python3 when it already has PyTorch and Triton (a GPU machine's own
# stack), else a virtual environment in .venv with PyTorch 2.13 and Triton 3.9, and installs
# whatever else the job needs (the package's "test" or "bench" extra) that is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
job=${1:-}
case $job in
  bench|test|lint) shift ;;
  *) echo "usage: bash scripts/run.sh bench|test|lint [args...]" >&2; exit 2 ;;
esac

py=${PYTHON:-python3}
RUFF_VERSION=0.17.6
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && ! "$py" -c "import torch, triton" 2>/dev/null; then
  py=.venv/bin/python
fi
if ! "$py" -c "import torch, triton" 2>/dev/null; then
  # No PyTorch: the CPU build (a bare "torch" would fetch a multi-GB CUDA build) and the
  # Triton whose interpreter runs the kernels on the CPU.
  echo "[run.sh] no PyTorch in $py: installing the CPU stack into .venv" >&2
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  py=.venv/bin/python
  if ! "$py" -m pip --version >/dev/null 2>&1; then
    echo "[run.sh] .venv has no pip (python3-venv missing?): install it, remove .venv and run again" >&2
    exit 1
  fi
  "$py" -m pip install --quiet --disable-pip-version-check torch==2.13.0 "triton==3.9.*"
fi

# What the job needs, as import name=distribution name: the required ones must install, the
# optional ones may fail (no network, say: a GPU machine), and the tests that need them skip.
if [ "$job" = lint ]; then
  # One pinned ruff: its rules and its formatting change between releases (configured in pyproject.toml).
  "$py" -m ruff --version 2>/dev/null | grep -qx "ruff $RUFF_VERSION" \
    || "$py" -m pip install --quiet --disable-pip-version-check "ruff==$RUFF_VERSION"
  "$py" -m ruff check .
  exec "$py" -m ruff format --check .
fi
if [ "$job" = test ]; then
  required="packaging=packaging numpy=numpy pytest=pytest hypothesis=hypothesis"
  optional="xdist=pytest-xdist matplotlib=matplotlib pytest_benchmark=pytest-benchmark tqdm=tqdm ninja=ninja mkdocs=mkdocs-material mkdocstrings_handlers=mkdocstrings-python transformers=transformers"
else
  required="packaging=packaging numpy=numpy"
  optional="matplotlib=matplotlib tqdm=tqdm transformers=transformers ninja=ninja"
fi
install() {  # install LEVEL PAIRS...: pip-install the distributions whose module does not import
  local level=$1 missing=() pair; shift
  for pair in "$@"; do
    "$py" -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "[run.sh] installing ${missing[*]}" >&2
  if ! "$py" -m pip install --quiet --disable-pip-version-check "${missing[@]}"; then
    [ "$level" = required ] && { echo "[run.sh] could not install ${missing[*]}" >&2; exit 1; }
    echo "[run.sh] could not install ${missing[*]}: what needs them is skipped" >&2
  fi
}
install required $required
install optional $optional

# fusedkit itself runs from this checkout (the current directory is on sys.path); the
# environment's own tools (ninja, for the C++ launch table) come first on PATH.
export PATH="$(dirname "$py"):$PATH"
# The C++ launch table (repeated eager calls launched and recorded for autograd in C++),
# built once per machine and torch version; without a compiler calls take the Python path.
"$py" -m fusedkit build >/dev/null || true
if [ "$job" = bench ]; then
  exec "$py" -m fusedkit bench "$@"
fi
workers=()
"$py" -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-auto}")
exec "$py" -m pytest -q ${workers[@]+"${workers[@]}"} "$@"
