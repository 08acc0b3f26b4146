"""The Hopper matmul kernel: persistent programs fed by the tensor-memory accelerator.

A second data-movement algorithm for the same ``act(a @ b + bias)`` (and its gated
variant) as :func:`fusedkit.kernels.matmul.matmul_kernel`, whose epilogues it shares:
- operands arrive through TMA tensor descriptors: one bulk copy per tile instead of
  per-thread address arithmetic, out-of-range rows, columns and the K tail
  zero-filled by the hardware, so the loop carries no masks;
- ``NUM_SMS`` persistent programs walk the output tiles in grouped order, so the
  next tile's loads overlap this tile's epilogue;
- ``b`` is read in the layout it has: (K, N) row-major, or an ``nn.Linear`` weight
  (N, K) row-major through ``b = weight.t()`` (``B_KMAJOR``), transposed in shared
  memory for the tensor cores, never copied; likewise ``a`` (M, K) row-major, or
  column-major (``A_MMAJOR``: the weight gradient's ``x.t() @ grad``);
- float32 on TF32 tensor cores with row-major ``a`` and ``b`` computes the transposed
  product ``(b^T a^T)^T``, ``b^T`` rounded to TF32 in registers (``TRANSPOSE`` below):
  TF32 ``wgmma`` reads shared-memory operands K-major only, and a row-major ``b`` is
  N-major, so Triton would transpose it on a shared-memory store each K step; as the
  register operand of ``b^T a^T`` it may have any layout. At M = K = N = 4096, TF32,
  128 x 128 x 32 tiles, 3 stages, 8 warps, that runs over three times as fast as ``a @ b``
  (H200; docs/matmul.md, "A row-major b on TF32 tensor cores", has the figures).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import helpers
from .matmul import epilogue, gated_epilogue, grad_epilogue, prologue

__all__ = ["matmul_tma_kernel"]


@triton.jit
def _load_tile(desc, off_m, off_n, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr):
    """Load a (BLOCK_M, BLOCK_N) tile that :func:`_store_tile` would store (two halves with SUBTILE)."""
    if SUBTILE:
        left = desc.load([off_m, off_n])
        right = desc.load([off_m, off_n + BLOCK_N // 2])
        tile = tl.reshape(tl.permute(tl.join(left, right), (0, 2, 1)), (left.shape[0], BLOCK_N))
    else:
        tile = desc.load([off_m, off_n])
    return tile


@triton.jit
def _store_tile(desc, acc, off_m, off_n, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr):
    """Store a (BLOCK_M, BLOCK_N) tile; SUBTILE stores it as two halves (less shared memory)."""
    dtype = desc.dtype
    if SUBTILE:
        halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        desc.store([off_m, off_n], helpers.convert(left, dtype))
        desc.store([off_m, off_n + BLOCK_N // 2], helpers.convert(right, dtype))
    else:
        desc.store([off_m, off_n], helpers.convert(acc, dtype))


@triton.jit
def matmul_tma_kernel(
    # Tensor descriptors of a, b, c (the output) and pre (c's where absent), and GATED's up projection b2 and
    # its kept product pre2 (b's and pre's where absent); the biases' pointers and the column sums' partials
    # (SUM_ROWS) (c's where absent).
    a_desc, b_desc, c_desc, pre_desc, b2_desc, pre2_desc, bias_ptr, colsum_ptr, bias2_ptr,
    # Sizes: a is (M, K), b (K, N); M_BUCKET (M's power-of-two bucket, ``configs.matmul_m_bucket``) keys the tuner.
    M, N, K, M_BUCKET,
    # The bias's stride (the descriptors carry the operands').
    stride_bias,
    # Compile-time switches: the epilogue (GRAD_ACT, SUM_ROWS: the backward one, matmul.grad_epilogue; GATED:
    # matmul.gated_epilogue) and the prologue on A; the operands' layouts and arithmetic; the persistent grid
    # and the tile.
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, GRAD_ACT: tl.constexpr,
    SUM_ROWS: tl.constexpr, PROLOGUE: tl.constexpr, GATED: tl.constexpr,
    A_MMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr,
    NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,
):  # fmt: skip
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # The transposed product (module docstring); ``runtime.matmul_tma.transposed_product``
    # asks the same on the host.
    TRANSPOSE: tl.constexpr = a_desc.dtype == tl.float32 and INPUT_PRECISION != "ieee" and not A_MMAJOR and not B_KMAJOR
    tl.static_assert(not GATED or not (TRANSPOSE or GRAD_ACT), "the gated epilogue: no transposed product")
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = helpers.grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if TRANSPOSE:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (GATED's up projection; unused otherwise)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_MMAJOR:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
                if GATED:
                    b2 = b2_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
                if GATED:
                    b2 = b2_desc.load([off_k, off_n])
            a = prologue(a, PROLOGUE)
            if UPCAST_OPERANDS:  # the interpreter's bf16 dot (see runtime.matmul.launch_config)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                if GATED:
                    b2 = b2.to(tl.float32)
            if TRANSPOSE:
                bt = b.T
                if INPUT_PRECISION == "tf32":  # rounded in registers, so wgmma reads it there
                    bt = helpers.tf32_big(bt)
                acc = helpers.dot(bt, a.T, acc, INPUT_PRECISION, tl.float32)
            else:
                acc = helpers.dot(a, b, acc, INPUT_PRECISION, tl.float32)
            if GATED:  # (the same A tile, a second B tile)
                acc2 = helpers.dot(a, b2, acc2, INPUT_PRECISION, tl.float32)
        if TRANSPOSE:
            acc = acc.T
        cols = off_n + tl.arange(0, BLOCK_N)
        if GATED:
            gate, up, out = gated_epilogue(acc, acc2, cols, bias_ptr, bias2_ptr, N, stride_bias, HAS_BIAS, ACTIVATION)
            if STORE_PRE:
                _store_tile(pre_desc, gate, off_m, off_n, BLOCK_N, SUBTILE)
                _store_tile(pre2_desc, up, off_m, off_n, BLOCK_N, SUBTILE)
        elif GRAD_ACT:  # (pre's rows and columns past M and N load as zeros, and so does acc there)
            pre = _load_tile(pre_desc, off_m, off_n, BLOCK_N, SUBTILE)
            mask = ((off_m + tl.arange(0, BLOCK_M)) < M)[:, None] & (cols < N)[None, :]
            out = grad_epilogue(acc, pre, mask, colsum_ptr, pid_m, cols, N, ACTIVATION, SUM_ROWS)
        else:
            pre, out = epilogue(acc, cols, bias_ptr, N, stride_bias, HAS_BIAS, ACTIVATION)
            if STORE_PRE:
                _store_tile(pre_desc, pre, off_m, off_n, BLOCK_N, SUBTILE)
        _store_tile(c_desc, out, off_m, off_n, BLOCK_N, SUBTILE)
