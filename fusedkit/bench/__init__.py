"""fusedkit's reports: fused against unfused, peers in the same process (``python -m fusedkit
bench``). Tools, not part of the library: nothing in the core imports this package, and its
plots and progress bars need the ``bench`` extra (``pip install fusedkit[bench]``)."""

from __future__ import annotations

from .cases import BIAS_COLS, DTYPE_NAMES, LAYOUTS
from .report import run_command

__all__ = ["BIAS_COLS", "DTYPE_NAMES", "LAYOUTS", "run_command"]
