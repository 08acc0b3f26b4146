"""The Python around fusedkit's launches in a LinearReLU training step, on any machine.

Under the Triton interpreter, with the matmul and elementwise launches stubbed out, what
is left of a step is the host work fusedkit adds: call signatures, validation, plans,
autograd Functions, allocation. It shows where that time goes without a GPU (the GPU
probe, ``probe_linear_backward.py``, times the same pieces with real launches).

    python benchmarks/probe_host_overhead.py [--profile]

On this project's 2-core CPU host (torch 2.13, triton 3.9, 2026-12-03; three runs each)
the forward with autograd took 81-91 us before such calls kept a recipe of their own and
48-50 us after; the step 286-312 us before, 246-248 after; the backward 172-209 and 176-201.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take fusedkit's kernels (here: stubs)

import torch  # noqa: E402

import fusedkit  # noqa: E402
from fusedkit import _elementwise as ew  # noqa: E402
from fusedkit import _matmul as mm  # noqa: E402


def _stub_launches() -> None:
    mm.launch_matmul = lambda a, b, bias, activation, out, pre=None, plan=None: out
    ew._Recipe._launch = lambda self, spec, per_call, index: None


def _us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    _stub_launches()
    torch.manual_seed(0)
    module = fusedkit.nn.LinearReLU(64, 64)
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 64)
    params = [x, *module.parameters()]
    y = module(x)
    rows = [("step: forward + backward", lambda: torch.autograd.grad(module(x), params, g)),
            ("forward, autograd recording", lambda: module(x)),
            ("backward", lambda: torch.autograd.grad(y, params, g, retain_graph=True))]
    print("LinearReLU(64, 64), launches stubbed out: host us a call")
    for label, fn in rows:
        print(f"  {label:<30} {_us(fn):8.1f}")
    with torch.no_grad():
        print(f"  {'forward, no autograd':<30} {_us(lambda: module(x)):8.1f}")
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [rows[0][1]() for _ in range(2000)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
