"""``python -m fusedkit bench [...]``: the fused-vs-unfused report (see fusedkit.bench)."""

from __future__ import annotations

import os
import sys

import torch

from . import _elementwise


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m fusedkit bench [options]   (python -m fusedkit bench --help)")
        return 0 if argv else 2
    if argv[0] != "bench":
        print(f"unknown command {argv[0]!r}; try: python -m fusedkit bench", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not _elementwise.INTERPRETED:
        # Triton chooses the interpreter when it decorates the kernels, which has
        # happened already: start again with it on, so the report runs the real kernels.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "fusedkit", *argv], env)
    from .bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
