"""Where an eager call's host time goes: the measurement behind the host-bound rows of the norms
and models reports (an eager norm's forward + backward issues in 2-5x eager's wall time at
8192 x 2048 on the H200, docs/results.md, "Norms").

    PYTHONPATH=. python benchmarks/host_profile.py                   # every case below
    PYTHONPATH=. python benchmarks/host_profile.py --cases add_rms_norm --rows 8192 --n 2048

For each case: the host's time to issue one call (forward, or forward + backward through
``torch.autograd.grad``), issued back to back and synchronised only at the end, against the
same call's eager PyTorch composition; then the Python functions that take the most of it
(``cProfile``, its own overhead included). The ``function_roundtrip`` case is a Python
``torch.autograd.Function`` that does nothing, forward and backward, beside ``x * 1``: what any
op whose backward runs in Python pays on this machine, whatever its kernels; ``*_one_thread``
runs the backward on the calling thread rather than autograd's CUDA device thread, and
``silu_mul_grad`` is an op whose autograd node is C++ (the launch table's); ``linear_gelu``
is the matmul with a GELU epilogue that ``fuse`` gives BERT's and ViT's MLPs (timed at
``--rows 2048``, where the H100 issues it slower than it runs). On a CPU the
kernels run in the interpreter, so only the script itself is checked there.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import fusedkit

#: The cases a run times by default (``--cases``).
CASES = (
    "add_rms_norm",
    "add_rms_norm_one_thread",
    "add_rms_norm_forward",
    "silu_mul_grad",
    "rms_norm_no_grad",
    "add_rms_norm_no_grad",
    "gated_mlp_decode",
    "linear_gelu",
    "linear_gelu_forward",
    "function_roundtrip",
)


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _cases(rows: int, n: int, device, dtype):
    x, r = (torch.randn(rows, n, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    w = torch.randn(n, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, n, device=device, dtype=dtype)
    wg, wu = (torch.randn(4 * n, n, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    wd = torch.randn(n, 4 * n, device=device, dtype=dtype, requires_grad=True)
    bias = torch.randn(4 * n, device=device, dtype=dtype, requires_grad=True)
    one = torch.randn(1, n, device=device, dtype=dtype)

    def grad(y, inputs):
        torch.autograd.grad(y, inputs, dy if y.shape == dy.shape else torch.ones_like(y))

    def on_calling_thread(fn):
        # (autograd runs a CUDA backward on its device thread; this runs it on the caller's)
        def call():
            with torch.autograd.set_multithreading_enabled(False):
                fn()

        return call

    return {
        "add_rms_norm": (
            lambda: grad(fusedkit.add_rms_norm(x, r, w, 1e-6)[0], (x, r, w)),
            lambda: grad(F.rms_norm(x + r, (n,), w, 1e-6), (x, r, w)),
        ),
        "add_rms_norm_one_thread": (
            on_calling_thread(lambda: grad(fusedkit.add_rms_norm(x, r, w, 1e-6)[0], (x, r, w))),
            on_calling_thread(lambda: grad(F.rms_norm(x + r, (n,), w, 1e-6), (x, r, w))),
        ),
        "add_rms_norm_forward": (
            lambda: fusedkit.add_rms_norm(x, r, w, 1e-6),
            lambda: F.rms_norm(x + r, (n,), w, 1e-6),
        ),
        "silu_mul_grad": (
            lambda: grad(fusedkit.silu_mul(x, r), (x, r)),
            lambda: grad(F.silu(x) * r, (x, r)),
        ),
        "rms_norm_no_grad": (
            lambda: fusedkit.rms_norm(x.detach(), (n,), w.detach(), 1e-6),
            lambda: F.rms_norm(x.detach(), (n,), w.detach(), 1e-6),
        ),
        "add_rms_norm_no_grad": (
            lambda: fusedkit.add_rms_norm(x.detach(), r.detach(), w.detach(), 1e-6),
            lambda: F.rms_norm(x.detach() + r.detach(), (n,), w.detach(), 1e-6),
        ),
        "gated_mlp_decode": (
            lambda: fusedkit.gated_mlp(one, wg.detach(), wu.detach(), wd.detach()),
            lambda: F.linear(F.silu(F.linear(one, wg.detach())) * F.linear(one, wu.detach()), wd.detach()),
        ),
        "linear_gelu": (  # (BERT's and ViT's MLP up-projection: fuse() gives it a GELU epilogue)
            lambda: grad(fusedkit.matmul(x, wg.t(), bias, "gelu"), (x, wg, bias)),
            lambda: grad(F.gelu(F.linear(x, wg, bias)), (x, wg, bias)),
        ),
        "linear_gelu_forward": (
            lambda: fusedkit.matmul(x.detach(), wg.detach().t(), bias.detach(), "gelu"),
            lambda: F.gelu(F.linear(x.detach(), wg.detach(), bias.detach())),
        ),
        "function_roundtrip": (
            lambda: grad(_Nothing.apply(x), (x,)),
            lambda: grad(x * 1, (x,)),
        ),
    }


def _issue_us(fn, calls: int, sync) -> tuple[float, float]:
    """(host us a call to issue, wall us a call) over ``calls`` back-to-back calls."""
    for _ in range(max(10, calls // 10)):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--n", type=int, default=768)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=15, help="cProfile rows a case prints")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    rows, n, calls = (args.rows, args.n, args.calls) if gpu else (8, 32, 3)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    cases = _cases(rows, n, device, dtype)
    table = []
    for name in args.cases.split(","):
        fused, eager = cases[name]
        f_host, f_wall = _issue_us(fused, calls, sync)
        e_host, e_wall = _issue_us(eager, calls, sync)
        table.append((name, f_host, f_wall, e_host, e_wall))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fused()
        profile.disable()
        sync()
        print(f"== {name}: the fused call's Python, {calls} calls (cProfile's own cost included)")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    where = torch.cuda.get_device_name() if gpu else "CPU (Triton's interpreter: a check of the script only)"
    print(f"{where}, torch {torch.__version__}, {rows} x {n}, {dtype}; us a call")
    print(f"{'case':<24} {'fused host':>11} {'fused wall':>11} {'eager host':>11} {'eager wall':>11} {'x wall':>7}")
    for name, f_host, f_wall, e_host, e_wall in table:
        print(f"{name:<24} {f_host:11.1f} {f_wall:11.1f} {e_host:11.1f} {e_wall:11.1f} {e_wall / f_wall:7.2f}")


if __name__ == "__main__":
    main()
