"""Why does TF32 with a row-major ``b`` run at a third of cuBLASLt? (H200 question, 2026-12-03.)

The matmul report at e7e3de7 (H200, torch 2.11, triton 3.6, TF32 allowed, ``b`` (K, N)
row-major): fusedkit 108.0 TFLOP/s at 4096^3 against cuBLASLt's 306.7, 84.2 against 303.1
at M = 512. Compiled for sm_90 on the CPU, Triton feeds the TF32 ``wgmma`` a K-major copy
of ``b`` and fills it with 4-byte ``cp.async`` copies (48 a thread a stage for a 128 x 128
x 32 tile, against 12 16-byte ones for ``a``); with ``b`` rounded in registers first
(``cvt.rna.satfinite.tf32.f32``, fusedkit's tf32x3 split instruction) the copies are all
16 bytes wide and the transpose happens on the shared-memory store. This probe times one
small tiled kernel both ways, in both layouts of ``b``, against torch:

    python benchmarks/probe_tf32_layout.py [M ...]   (default: 4096 512; K = N = 4096)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from fusedkit import _jit

K = N = 4096
#: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
TILES = ((128, 128, 32, 3, 8), (128, 256, 32, 3, 8), (128, 128, 32, 4, 8))


@triton.jit
def _kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_bk, stride_bn, ROUND_B: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn)
        if ROUND_B:
            b = _jit.tf32_round(b)
        acc = tl.dot(a, b, acc, input_precision="tf32")
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def main():
    if not torch.cuda.is_available():
        print("needs a GPU (TF32 tensor cores)")
        return
    ms = [int(v) for v in sys.argv[1:]] or [4096, 512]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    print(f"TF32, K = N = {K}: TFLOP/s (do_bench median), max error / max |ref|")
    for m in ms:
        a, w = torch.randn(m, K, device="cuda"), torch.randn(N, K, device="cuda")
        ref = a.double() @ w.double().t()
        flop = 2 * m * N * K
        for name, b in (("b row-major (K, N)", w.t().contiguous()), ("b = W.t() (K-major)", w.t())):
            c = torch.empty(m, N, device="cuda")
            print(f"  M={m} {name}", flush=True)
            for tile in TILES:
                bm, bn, bk, stages, warps = tile
                grid = (m // bm, N // bn)
                for round_b in (False, True):
                    run = lambda: _kernel[grid](a, b, c, m, N, K, b.stride(0), b.stride(1), round_b,  # noqa: E731
                                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                    try:
                        run()
                        us = 1e3 * triton.testing.do_bench(run, rep=50)
                    except Exception as e:  # out of shared memory and the like: report, go on
                        print(f"    {tile} round_b={round_b}: {type(e).__name__}", flush=True)
                        continue
                    err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
                    print(f"    {tile} round_b={round_b!s:<5} {flop / us / 1e6:7.1f}  {err:.2e}", flush=True)
            us = 1e3 * triton.testing.do_bench(lambda: a @ b, rep=50)
            err = (((a @ b).double() - ref).abs().max() / ref.abs().max()).item()
            print(f"    torch a @ b {'':>26} {flop / us / 1e6:7.1f}  {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
