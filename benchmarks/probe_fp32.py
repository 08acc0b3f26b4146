"""float32 ``linear_relu`` with TF32 off: fusedkit's modes against torch, time and error.
(H200 question, 2026-12-03: can tf32x3 be the default?)

At 0ede8f0 on the H200 (torch 2.11, triton 3.6), M = 64, K = N = 4096: fusedkit's tf32x3
68.1 us with max error / max |ref| 2.76e-7, its IEEE kernel 160.0 us (8.91e-7), torch
93.7 us (8.91e-7). This adds M = 512 and 4096, a case whose products fall in fp32's
subnormal range (do the tensor cores keep them?), and TF32 on for both sides. At 9ec4d64:
tf32x3 2.6e-7 / 2.7e-7 / 5.3e-7 at M = 64 / 512 / 4096 against torch's 9.8e-7 / 2.2e-6 /
3.1e-6, in 68.3 / 459.6 / 2008.8 us against torch's 93.5 / 368.8 / 2735.1 (M = 512 the
slow one: 293.7 us with b758956's split and tile); subnormal products kept (262,114 of
262,144 results nonzero, torch 262,113); TF32 on, M = 64: 30.5 us against torch's 33.2.

    python benchmarks/probe_fp32.py [--quick] [M ...]   (default: 64 512 4096; K = N = 4096)

``--quick``: TF32 off only, tf32x3 against torch (from M = 256 also the TMA kernel, forced),
each in both weight layouts (``linear_relu`` with W, and ``matmul_relu`` with a row-major
``b``, which the tensor cores' TF32 products take transposed: 0.55x-0.79x cuBLASLt's
epilogue in the matmul report at 9ec4d64).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import fusedkit
from fusedkit.bench import _timer
from fusedkit.configs import settings

K = N = 4096
#: Input scale whose products (about 2^-140) lie in fp32's subnormal range (2^-149 .. 2^-126).
SUBNORMAL_SCALE = 2.0**-70


def _err(got, ref) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def rows(m, dev, timer, modes, row_major: bool = False):
    a, w, bias = torch.randn(m, K, device=dev), torch.randn(N, K, device=dev), torch.randn(N, device=dev)
    ref = torch.relu(F.linear(a.double(), w.double(), bias.double()))
    b = w.t().contiguous()
    for label, mode, *kernel in modes:
        with settings(FUSEDKIT_FP32_MATMUL=mode or "tf32x3", FUSEDKIT_MATMUL_KERNEL=kernel[0] if kernel else "auto"):
            if row_major:
                label = f"{label}, b row-major"
                fn = (lambda: fusedkit.matmul_relu(a, b, bias)) if mode else (lambda: torch._addmm_activation(bias, a, b))
            else:
                fn = (lambda: fusedkit.linear_relu(a, w, bias)) if mode else (lambda: torch.relu(F.linear(a, w, bias)))
            got = fn()
            print(f"  M={m:<5} {label:<22} {timer(fn):9.1f} us   max error / max |ref| {_err(got, ref):.2e}")


def subnormal(dev, modes, m: int = 64, k: int = 64):
    """Products in the subnormal range: how many results each path keeps nonzero, and the error."""
    a = torch.randn(m, k, device=dev) * SUBNORMAL_SCALE
    w = torch.randn(N, k, device=dev) * SUBNORMAL_SCALE
    ref = F.linear(a.double(), w.double())
    print(f"products near 2^-140 (fp32 subnormal), M={m} K={k} N={N}: nonzero results (of {m * N}), error")
    for label, mode in modes:
        with settings(FUSEDKIT_FP32_MATMUL=mode or "tf32x3"):
            got = fusedkit.matmul(a, w.t()) if mode else F.linear(a, w)
        print(f"  {label:<22} {int((got != 0).sum()):8d}   {_err(got, ref):.2e}")


def main():
    if not torch.cuda.is_available():
        print("needs a GPU (TF32 and tensor cores)")
        return
    dev, timer = torch.device("cuda"), _timer(torch.device("cuda"))
    quick = "--quick" in sys.argv
    ms = [int(v) for v in sys.argv[1:] if v != "--quick"] or [64, 512, 4096]
    matmul = torch.backends.cuda.matmul
    allow = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        modes = (("fusedkit tf32x3", "tf32x3"), ("fusedkit ieee", "ieee"), ("torch", None))
        print(f"fp32 linear_relu, TF32 off, K = N = {K}, do_bench median:")
        if quick:
            tma = ("fusedkit tf32x3 TMA", "tf32x3", "tma")  # the default takes it from M = 1024
            for m in ms:
                for row_major in (False, True):
                    rows(m, dev, timer, (modes[0], tma, modes[2]) if m >= 256 else (modes[0], modes[2]), row_major)
            return
        for m in ms:
            rows(m, dev, timer, modes if m <= 64 else (modes[0], modes[2]))  # ieee's tuning is slow at large M
        subnormal(dev, modes)
        matmul.allow_tf32 = True
        print(f"fp32 linear_relu, TF32 on (both sides), K = N = {K}:")
        for m in ms:
            rows(m, dev, timer, (("fusedkit tf32", "tf32x3"), ("torch", None)))
    finally:
        matmul.allow_tf32 = allow


if __name__ == "__main__":
    main()
