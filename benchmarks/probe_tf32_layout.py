"""Why does TF32 with a row-major ``b`` run at a third of cuBLASLt? (H200 question, 2026-12-03.)

The matmul report at e7e3de7 (H200, torch 2.11, triton 3.6, TF32 allowed, ``b`` (K, N)
row-major): fusedkit 108.0 TFLOP/s at 4096^3 against cuBLASLt's 306.7, 84.2 against 303.1
at M = 512. Compiled for sm_90 on the CPU, Triton feeds the TF32 ``wgmma`` a K-major copy
of ``b`` and fills it with 4-byte ``cp.async`` copies (48 a thread a stage for a 128 x 128
x 32 tile, against 12 16-byte ones for ``a``); with ``b`` rounded in registers first
(``cvt.rna.satfinite.tf32.f32``, fusedkit's tf32x3 split instruction) the copies are all
16 bytes wide and the transpose happens on the shared-memory store. This probe times one
small tiled kernel both ways, in both layouts of ``b``, and for a row-major ``b`` a TMA
kernel three ways (``_tma_kernel``), against torch:

    python benchmarks/probe_tf32_layout.py [M ...]   (default: 4096 512; K = N = 4096)

At 2bced09 (before the TMA rows): the rounded ``b`` was slower in all 12 cases (row-major
67-87 TFLOP/s at M = 4096 either way, torch 393.5), and with nn.Linear's K-major ``b`` the
plain kernel reached 370.3 against torch's 372.8: the row-major ``b``'s copies are the cost.
At 4e097d7 the TMA kernel's mode 2 ran 257.0 TFLOP/s at M = 4096 (modes 0 / 1: 71.0 / 81.3;
torch 370.7) and 164.4 at M = 512 (torch 298.7).
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


@triton.jit
def _tma_kernel(a_desc, b_desc, c_desc, K, MODE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A row-major ``b`` through TMA. MODE 0: ``a @ b`` (Triton transposes ``b`` on a
    shared-memory store); 1: ``(b^T a^T)^T``; 2: the same with ``b^T`` rounded in registers,
    which makes it the register A operand of ``wgmma`` (read from TMA's N-major tile, no
    store; CPU codegen, triton 3.6: no in-loop stores). Mode 2 is the library's since 548d236."""
    off_m, off_n = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N
    if MODE == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = a_desc.load([off_m, k])
        b = b_desc.load([k, off_n])
        if MODE == 0:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif MODE == 1:
            acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision="tf32")
        else:
            acc = tl.dot(_jit.tf32_round(tl.trans(b)), tl.trans(a), acc, input_precision="tf32")
    if MODE == 0:
        c_desc.store([off_m, off_n], acc)
    else:
        c_desc.store([off_m, off_n], tl.trans(acc))


def _row(label: str, run, c, ref, flop: int) -> None:
    """Run once, time, and print TFLOP/s and the error of ``c``; a launch that fails (out
    of shared memory and the like) prints its exception's name instead."""
    try:
        run()
        us = 1e3 * triton.testing.do_bench(run, rep=50)
    except Exception as e:  # report it and go on to the next case
        print(f"    {label}: {type(e).__name__}", flush=True)
        return
    err = ((c.double() - ref).abs().max() / ref.abs().max()).item()
    print(f"    {label} {flop / us / 1e6:7.1f}  {err:.2e}", flush=True)


def tma_rows(a, b, ref, flop):
    """``_tma_kernel``'s three modes for a row-major ``b``, each tile of ``TILES``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m = a.shape[0]
    c = torch.empty(m, N, device="cuda")
    for bm, bn, bk, stages, warps in TILES:
        descs = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bk, bn]),
                 TensorDescriptor.from_tensor(c, [bm, bn]))
        for mode in (0, 1, 2):
            run = lambda: _tma_kernel[(m // bm, N // bn)](*descs, K, mode, BLOCK_M=bm, BLOCK_N=bn,  # noqa: E731
                                                          BLOCK_K=bk, num_warps=warps, num_stages=stages)
            _row(f"TMA {(bm, bn, bk, stages, warps)} mode {mode}", run, c, ref, flop)


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
                    _row(f"{tile} round_b={round_b!s:<5}", run, c, ref, flop)
            if b.is_contiguous():
                tma_rows(a, b, ref, flop)
            us = 1e3 * triton.testing.do_bench(lambda: a @ b, rep=50)
            err = (((a @ b).double() - ref).abs().max() / ref.abs().max()).item()
            print(f"    torch a @ b {'':>26} {flop / us / 1e6:7.1f}  {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
