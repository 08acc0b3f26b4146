"""Which TF32 split gives fp32-sized errors on the tensor cores? (H200 question, 2026-12-03.)

Triton's ``input_precision="tf32x3"`` rounds the big part to nearest (``cvt.rna``), so
an input within 0.025% of the fp32 maximum becomes inf. fusedkit's first own split
(b758956: ``big = x & 0xFFFFE000``, the big product summed into the accumulator on the
tensor cores) kept those finite, but at M = 64, K = N = 4096 it measured 3.1e-6 (max
error / max |ref|) against the IEEE kernel's 7.8e-7 and, for Triton's split in earlier
runs, 2.6e-7 and 2.7e-7. fusedkit now rounds like ``cvt.rna``, truncating only where
rounding would overflow (first by integer add and mask, about 10 operations an element;
now ``cvt.rna.satfinite``, one), and sums in Triton's order (``_jit.dot``). One small
kernel, one tile per program, each variant a compile-time switch:

    python benchmarks/probe_tf32x3_split.py [M K N [BLOCK_M BLOCK_N BLOCK_K WARPS]]   (default 64 64 32 4)

Without a GPU it prints the CPU emulation of the splits' own error (``emulate``).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from fusedkit import _jit

#: The variants: 2 against 4 isolates the order of the sums, 4 against 3 the split, 5
#: against 3 the time of the per-step NaN guard on the small sums (5 turns inf inputs to NaN),
#: 6 against 3 the split's instruction against its integer emulation.
SPLITS = {0: "ieee (no split)", 1: "triton tf32x3 (cvt.rna)", 2: "truncating, summed on tensor cores",
          3: "fusedkit (_jit.dot)", 4: "truncating, Triton's order", 5: "fusedkit's split, no NaN guard",
          6: "integer rounding (fusedkit's before)"}


@triton.jit
def _truncating_split(x):
    big = (x.to(tl.int32, bitcast=True) & _jit.TF32_KEEP_BITS).to(tl.float32, bitcast=True)
    return big, x - big


@triton.jit
def _integer_split(x):
    big = tl.where(tl.abs(x) <= _jit.FP32_MAX, _jit.tf32_round_bits(x), x)
    return big, x - big


@triton.jit
def _kernel(a_ptr, b_ptr, c_ptr, M, N, K, SPLIT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        if SPLIT == 0:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif SPLIT == 1:
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        elif SPLIT == 3:
            acc = _jit.dot(a, b, acc, "tf32x3", tl.float32)
        elif SPLIT == 5:
            a_big, a_small = _jit.tf32_split(a)
            b_big, b_small = _jit.tf32_split(b)
            small = tl.dot(a_small, b_big, input_precision="tf32")
            small = tl.dot(a_big, b_small, small, input_precision="tf32")
            acc += tl.dot(a_big, b_big, small, input_precision="tf32")
        else:
            if SPLIT == 6:
                a_big, a_small = _integer_split(a)
                b_big, b_small = _integer_split(b)
            else:
                a_big, a_small = _truncating_split(a)
                b_big, b_small = _truncating_split(b)
            small = tl.dot(a_small, b_big, input_precision="tf32")
            small = tl.dot(a_big, b_small, small, input_precision="tf32")
            small = tl.where(small == small, small, 0.0)
            if SPLIT == 2:
                acc = tl.dot(a_big, b_big, acc + small, input_precision="tf32")
            else:
                acc += tl.dot(a_big, b_big, small, input_precision="tf32")
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def emulate(m: int, k: int, n: int) -> None:
    """The splits' own error on the CPU: each TF32 product exact (operands truncated to TF32,
    as the tensor cores read fp32 registers) and every sum in float64, so only the split
    loses anything. Run on 2026-12-03 at M = 64, K = 4096, N = 512: truncating 3.2e-7,
    truncating with a rounded small part 1.4e-7, rounding 6.1e-8 (torch's fp32 on the CPU
    2.6e-7), while the H200 gave the truncating split summed into the accumulator on the
    tensor cores 3.1e-6 at N = 4096."""
    keep, half = -(1 << 13), 1 << 12
    trunc = lambda x: (x.view(torch.int32) & keep).view(torch.float32)  # noqa: E731
    rnd = lambda x: ((x.view(torch.int32) + half) & keep).view(torch.float32)  # noqa: E731
    torch.manual_seed(0)
    a, b = torch.randn(m, k), torch.randn(k, n)
    ref = a.double() @ b.double()
    tc = lambda x, y: trunc(x).double() @ trunc(y).double()  # noqa: E731
    print(f"M={m} K={k} N={n}: the split's own error (max error / max |ref|), float64 sums")
    for name, big, small in (("truncating", trunc, lambda s: s), ("truncating, small part rounded", trunc, rnd),
                             ("rounding (cvt.rna)", rnd, lambda s: s)):
        a_big, b_big = big(a), big(b)
        a_small, b_small = small(a - a_big), small(b - b_big)
        got = tc(a_small, b_big) + tc(a_big, b_small) + tc(a_big, b_big)
        print(f"  {name:<36} {((got - ref).abs().max() / ref.abs().max()).item():.2e}")
    print(f"  {'torch fp32 (CPU)':<36} {(((a @ b).double() - ref).abs().max() / ref.abs().max()).item():.2e}")


def main():
    m, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (64, 4096, 4096)
    if not torch.cuda.is_available():
        emulate(m, k, min(n, 512))
        return
    torch.manual_seed(0)
    a, b = torch.randn(m, k, device="cuda"), torch.randn(k, n, device="cuda")
    ref = a.double() @ b.double()
    bm, bn, bk, warps = (int(v) for v in sys.argv[4:8]) if len(sys.argv) > 7 else (64, 64, 32, 4)
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    grid = (m // tile["BLOCK_M"], n // tile["BLOCK_N"])
    print(f"M={m} K={k} N={n} fp32, tile {tile}, {warps} warps: max error / max |ref|, do_bench median us", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    for split, name in SPLITS.items():
        c = torch.empty(m, n, device="cuda")
        run = lambda: _kernel[grid](a, b, c, m, n, k, split, **tile, num_warps=warps, num_stages=3)  # noqa: E731
        run()
        err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"  {name:<36} {err:.2e}  {1e3 * triton.testing.do_bench(run, rep=50):8.1f}", flush=True)
    err = (((a @ b).double() - ref).abs().max() / ref.abs().max()).item()
    print(f"  {'torch (TF32 off)':<36} {err:.2e}  {1e3 * triton.testing.do_bench(lambda: a @ b, rep=50):8.1f}", flush=True)
    big = torch.full((64, 32), torch.finfo(torch.float32).max, device="cuda")
    half = torch.full((32, 64), 0.5 / 32, device="cuda")
    for split, name in SPLITS.items():
        c = torch.empty(64, 64, device="cuda")
        _kernel[(1, 1)](big, half, c, 64, 64, 32, split, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
        print(f"  fp32 max * 0.5 with {name:<36} finite: {bool(c.isfinite().all())}", flush=True)


if __name__ == "__main__":
    main()
