"""The TMA kernel at fixed tiles, and fp32's kernel choice by M (GPU).

    python benchmarks/probe_tma_tiles.py [tiles] [fp32] [tf32] [halves]   (default: all four)

``tiles``: bf16 / fp16 at M = 64 and 512, N = K = 4096, ``b`` row-major, each tile of
``TILES`` launched directly (no tuning, timed as a CUDA graph's replay) beside cuBLASLt's
fused epilogue. Under Nsight
Compute at 4e097d7 (``probe_matmul_ncu.py``) cuBLASLt ran M = 64 as 128 programs of 64 x 32
tiles with 64-wide K steps 16 stages deep (12.8 us against our 26.7) and M = 512 as 128 x 128
tiles 6 stages deep (25.8 us against 27.4 for our TMA kernel's 4 stages), both in clusters
of two: the question is how much of that deeper pipeline this kernel can use.

``fp32``: float32 with TF32 off (tf32x3), ``b`` row-major, K = N = 4096, for M from 128
to 1024: the default choice, each kernel forced (autotuned), and torch: where the TMA
kernel's transposed product should take over from the pointer kernel.

``tf32``: TF32 allowed, ``b`` row-major: the transposed product against a K-major copy of
``b`` and ``a @ b`` on it (``MATMUL_TF32_COPY_MIN_M``).

``halves``: the same by M (16 to 1,024) for bf16 and fp16: where the TMA kernel, with the
deeper tiles the ``tiles`` part found in its autotune set, should take over.
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

import fusedkit
from fusedkit import _matmul, _matmul_tma as tma, activations as act, configs
from fusedkit._matmul import kmajor_copy, kmajor_copy_launch
from fusedkit.bench import _timer
from fusedkit.configs import MATMUL_GROUP_M, matmul_m_bucket, settings

K = N = 4096
#: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, SUBTILE)
TILES = {
    64: ((64, 32, 64, 8, 4, False), (64, 32, 64, 12, 4, False), (64, 32, 64, 16, 4, False),
         (64, 64, 64, 8, 4, False), (64, 64, 64, 12, 4, False), (64, 32, 128, 8, 4, False),
         (64, 128, 64, 4, 4, False), (128, 128, 64, 4, 8, False)),
    512: ((128, 128, 64, 4, 8, False), (128, 128, 64, 5, 8, True), (128, 128, 64, 6, 8, True),
          (128, 128, 64, 5, 8, False), (128, 256, 64, 4, 8, True), (64, 256, 64, 5, 4, True),
          (64, 128, 64, 6, 4, False), (128, 64, 64, 6, 4, False)),
}
FP32_M = (128, 256, 512, 1024)
TF32_M = (256, 512, 1024, 4096)
HALF_M = (16, 32, 64, 128, 256, 512, 1024)


def tiles_part(us):
    for dtype in (torch.bfloat16, torch.float16):
        for m, tiles in TILES.items():
            a, b, bias = torch.randn(m, K, device="cuda", dtype=dtype), torch.randn(K, N, device="cuda", dtype=dtype), \
                torch.randn(N, device="cuda", dtype=dtype)
            out = torch.empty(m, N, device="cuda", dtype=dtype)
            ref = torch._addmm_activation(bias, a, b)
            flop = 2 * m * N * K
            print(f"{dtype} M={m}: tile, us, TFLOP/s (cuBLASLt epilogue "
                  f"{flop / us(lambda: torch._addmm_activation(bias, a, b)) / 1e6:.1f}; "
                  f"fusedkit as called {flop / us(lambda: fusedkit.matmul_relu(a, b, bias)) / 1e6:.1f})", flush=True)
            for bm, bn, bk, stages, warps, subtile in tiles:
                tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=MATMUL_GROUP_M, SUBTILE=subtile)

                def run(tile=tile, stages=stages, warps=warps):
                    tma.launch_tma(a, b, bias, act.ACTIVATIONS["relu"], out, None, "ieee", False, matmul_m_bucket(m),
                                   False, False, tile,
                                   dict(num_warps=warps, num_stages=stages))
                try:
                    out.fill_(float("nan"))
                    run()
                    ok = torch.allclose(out.float(), ref.float(), atol=0.5, rtol=0.02)
                    # Replayed from a CUDA graph: a direct launch builds its descriptors on
                    # the host each call, and that host time (not the kernel) set the pace of
                    # the first run of this probe (4e097d7: 59.8 us against 28.5 for tiles
                    # differing only in stages, fp16 M = 512 at 200 TFLOP/s).
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    t = us(graph.replay)
                except Exception as e:  # a tile that does not fit
                    print(f"  {(bm, bn, bk, stages, warps, subtile)}: {type(e).__name__}", flush=True)
                    continue
                print(f"  {str((bm, bn, bk, stages, warps, subtile)):<34} {t:7.1f} {flop / t / 1e6:7.1f}"
                      f"{'' if ok else '  WRONG'}", flush=True)


def by_m(us, dtype, ms, label):
    """TFLOP/s per M (K = N = 4096, ``b`` row-major): the default choice, each kernel
    forced (autotuned), and cuBLASLt's fused epilogue."""
    print(f"{label}, b row-major, K = N = {K}: TFLOP/s (default, pointer, TMA, torch)", flush=True)
    for m in ms:
        a, b = torch.randn(m, K, device="cuda", dtype=dtype), torch.randn(K, N, device="cuda", dtype=dtype)
        bias = torch.randn(N, device="cuda", dtype=dtype)
        flop = 2 * m * N * K
        row = []
        for kernel in ("auto", "pointer", "tma"):
            with settings(FUSEDKIT_MATMUL_KERNEL=kernel):
                row.append(flop / us(lambda: fusedkit.matmul_relu(a, b, bias)) / 1e6)
        row.append(flop / us(lambda: torch._addmm_activation(bias, a, b)) / 1e6)
        print(f"  M={m:5d} " + " ".join(f"{v:7.1f}" for v in row), flush=True)


def fp32_part(us):
    torch.backends.cuda.matmul.allow_tf32 = False
    by_m(us, torch.float32, FP32_M, "fp32 tf32x3 (TF32 off)")


def tf32_part(us):
    """TF32 with a row-major ``b``: the transposed product against ``a @ b`` on a K-major
    copy of ``b`` (the copy timed with it), that product alone, and torch."""
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"fp32 TF32, b row-major, K = N = {K}: TFLOP/s (default, TMA transposed, default copying at every M, "
          "kept copy + TMA product, product alone (pointer, TMA), torch)", flush=True)
    for m in TF32_M:
        a, b, bias = torch.randn(m, K, device="cuda"), torch.randn(K, N, device="cuda"), torch.randn(N, device="cuda")
        bk = b.t().contiguous().t()
        launch = kmajor_copy_launch(b)
        flop = 2 * m * N * K
        row = [us(lambda: fusedkit.matmul_relu(a, b, bias))]
        with settings(FUSEDKIT_MATMUL_KERNEL="tma"):
            row.append(us(lambda: fusedkit.matmul_relu(a, b, bias)))
        # The copy as the library makes it (plan and kept launch) at any M; the kept plans
        # are dropped (the call key does not hold the threshold), then restored as they were.
        _matmul._RECIPES.clear()
        with settings(FUSEDKIT_MATMUL_KERNEL="auto"), mock.patch.object(configs, "MATMUL_TF32_COPY_MIN_M", 1):
            row.append(us(lambda: fusedkit.matmul_relu(a, b, bias)))
        _matmul._RECIPES.clear()
        with settings(FUSEDKIT_MATMUL_KERNEL="tma"):
            row.append(us(lambda: fusedkit.matmul_relu(a, kmajor_copy(b, launch), bias)))
        for kernel in ("pointer", "tma"):
            with settings(FUSEDKIT_MATMUL_KERNEL=kernel):
                row.append(us(lambda: fusedkit.matmul_relu(a, bk, bias)))
        row.append(us(lambda: torch._addmm_activation(bias, a, b)))
        print(f"  M={m:5d} " + " ".join(f"{flop / t / 1e6:7.1f}" for t in row), flush=True)
    launch = kmajor_copy_launch(b)
    kmajor_copy(b, launch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kmajor_copy(b, launch)
    times = {"Triton's launch": us(lambda: kmajor_copy(b)), "kept launch": us(lambda: kmajor_copy(b, launch)),
             "graph replay": us(graph.replay), "b.t().contiguous()": us(lambda: b.t().contiguous())}
    print(f"  the copy of b ({K} x {N} fp32), us (GB/s read + written): "
          + ", ".join(f"{name} {t:.1f} ({2 * b.nbytes / t / 1e3:.0f})" for name, t in times.items()), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False


def halves_part(us):
    for dtype in (torch.bfloat16, torch.float16):
        by_m(us, dtype, HALF_M, str(dtype))


def main():
    if not torch.cuda.is_available():
        print("needs a GPU")
        return
    parts = sys.argv[1:] or ["tiles", "fp32", "tf32", "halves"]
    us = _timer(torch.device("cuda"))
    torch.manual_seed(0)
    if "tiles" in parts:
        tiles_part(us)
    if "fp32" in parts:
        fp32_part(us)
    if "tf32" in parts:
        tf32_part(us)
    if "halves" in parts:
        halves_part(us)


if __name__ == "__main__":
    main()
