"""How cheap can an eager fused call get? The C++ launch table against the Python
fast path and ``torch.add`` (GPU, Triton 3.6; needs a C++ compiler and ninja).

The Python fast path costs about 1.8x ``torch.add`` at 1,024 elements on the H200
host, and its floor from Python, one allocation plus Triton's C launch function, is
already more than ``torch.add``'s whole call (``docs/why-fusion.md``). With
``FUSEDKIT_NATIVE_LAUNCH=1`` a repeated call is matched, allocated and launched in C++
(``fusedkit/_native.py``). This times the table's own call, the public op with the
table on and off, and the eager peers, all in one process on the same operands.

    python benchmarks/probe_native_launch.py [n]
"""

from __future__ import annotations

import os
import sys
import time

import torch

import fusedkit
from fusedkit import _native
from fusedkit.latency import per_call_us
from fusedkit.registry import ADD_RELU

def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    os.environ["FUSEDKIT_NATIVE_LAUNCH"] = "1"
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    t0 = time.perf_counter()
    for _ in range(3):  # keep the recipe, then the kernel and its native launch (building the extension)
        fusedkit.add_relu(x, y)
    print(f"first three calls (the extension's build included): {time.perf_counter() - t0:.1f} s")
    table = _native.TABLE
    if table is None or len(table) == 0:
        raise SystemExit("no native launch was kept (a Triton other than 3.6, or the build failed)")
    for _ in range(3):
        x.copy_(torch.randn(n, device="cuda"))
        assert torch.equal(fusedkit.add_relu(x, y), torch.relu(x + y)), "the native launch computed something else"

    def python_fast_path():  # the table set aside for the call (two attribute swaps included)
        _native.TABLE = None
        try:
            return fusedkit.add_relu(x, y)
        finally:
            _native.TABLE = table

    rows = [("torch.add(x, y)", lambda: torch.add(x, y)),
            ("torch.relu(x + y)", lambda: torch.relu(x + y)),
            ("fusedkit.add_relu(x, y)  [C++ launch table]", lambda: fusedkit.add_relu(x, y)),
            ("  the table's call alone", lambda: table.call(id(ADD_RELU), (x, y), 1)),
            ("fusedkit.add_relu(x, y)  [Python fast path]", python_fast_path),
            ("torch.empty_like(x)", lambda: torch.empty_like(x))]
    for name, fn in rows:
        print(f"{name:48s} {per_call_us(fn, x.device):7.1f} us/call  (n={n}, fp32)")


if __name__ == "__main__":
    main()
