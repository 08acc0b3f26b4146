"""The tiled matmul kernel and the epilogue every matmul kernel shares.

``act(a @ b + bias)`` in one kernel: bias and activation run on the fp32 (fp64)
accumulator while it is in registers (:func:`epilogue`), and the output is written
once. Compile-time switches choose bias, activation, a stored pre-activation for the
backward pass, the ``tl.dot`` precision, 64-bit offsets and split-K. The backward
epilogue (:func:`grad_epilogue`) makes the same kernel an MLP's ``dh`` GEMM that writes
the pre-activation's gradient, and its column sums (the bias gradient), directly; the
prologue (:func:`prologue`) applies an activation to A's tiles as they load, so an MLP's
down-projection and its weight gradient read the pre-activation, and the activation's
output is never written. The gated variant (``GATED``, :func:`gated_epilogue`) multiplies
each A tile by two B operands into two accumulators, a gated MLP's gate and up projections,
and writes ``act(gate) * up``: one GEMM where eager runs two and the gate between them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import activations, helpers

__all__ = ["epilogue", "gated_epilogue", "grad_epilogue", "matmul_kernel", "prologue"]


@triton.jit
def epilogue(acc, cols, bias_ptr, N, stride_bias, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """Every matmul kernel's epilogue, on the accumulator tile of output columns ``cols`` while
    it is in registers: returns ``(pre, out)``, the pre-activation ``acc + bias`` and its
    activation. The caller stores ``out`` (and ``pre`` when a backward needs it)."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        acc = acc + helpers.widen(bias[None, :], acc.dtype)
    return acc, activations.apply_activation(acc, ACTIVATION)


@triton.jit
def gated_epilogue(
    acc, acc2, cols, bias_ptr, bias2_ptr, N, stride_bias, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr
):
    """Every matmul kernel's gated epilogue, on the gate's and the up projection's accumulator
    tiles: returns ``(gate, up, act(gate) * up)``, each bias added first. The product is taken
    in float32 from unrounded values (eager rounds the gate, its activation and the product
    each to the operands' dtype), so it is at least as close to the exact result as eager's."""
    gate, act = epilogue(acc, cols, bias_ptr, N, stride_bias, HAS_BIAS, ACTIVATION)
    up, _ = epilogue(acc2, cols, bias2_ptr, N, stride_bias, HAS_BIAS, 0)
    return gate, up, act * up


@triton.jit
def prologue(a, PROLOGUE: tl.constexpr):
    """Every matmul kernel's prologue, on an A tile as it arrives: ``act(a)`` (the activation
    ``PROLOGUE`` codes; 0: none), computed in float32 (float64 for float64) and rounded to A's dtype as an eager
    ``act(pre)`` would be stored, so the product is that of the activation's output, which
    is never written. Zeros (the masked and out-of-range elements) stay zeros."""
    if PROLOGUE != 0:
        if a.dtype == tl.float64:
            a = activations.apply_activation(a, PROLOGUE)
        else:
            a = helpers.convert(activations.apply_activation(helpers.widen(a, tl.float32), PROLOGUE), a.dtype)
    return a


@triton.jit
def grad_epilogue(acc, pre, mask, colsum_ptr, pid_m, cols, N, ACTIVATION: tl.constexpr, SUM_ROWS: tl.constexpr):
    """Every matmul kernel's backward epilogue: ``acc`` is the gradient reaching an activation's
    output (``dy @ W2`` in an MLP's backward), ``pre`` that activation's input tile; returns
    ``acc * act'(pre)``, the pre-activation's gradient, so it is written once and never read
    back to be multiplied. ``SUM_ROWS``: the tile's column sums (the bias gradient's share of
    this tile row, in float32 before rounding) stored as row ``pid_m`` of ``colsum_ptr``'s
    (tile rows, N) partials, which the host sums in a fixed order: the same bits every run."""
    dpre = activations.apply_activation_grad(acc, helpers.widen(pre, acc.dtype), ACTIVATION)
    if SUM_ROWS:
        sums = tl.sum(tl.where(mask, dpre, 0.0), axis=0)
        tl.store(colsum_ptr + pid_m * N + cols, sums, mask=cols < N)
    return dpre


@triton.jit
def _store(
    acc,
    acc2,
    rows,
    cols,
    mask,
    pid_m,
    c_ptr,
    bias_ptr,
    pre_ptr,
    colsum_ptr,
    bias2_ptr,
    pre2_ptr,
    N,
    stride_cm,
    stride_cn,
    stride_bias,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PRE: tl.constexpr,
    GRAD_ACT: tl.constexpr,
    SUM_ROWS: tl.constexpr,
    GATED: tl.constexpr,
):
    """The epilogue, then the pre-activation (when kept) and the result stored through pointers;
    with ``GRAD_ACT``, the backward epilogue on ``pre`` read from ``pre_ptr`` instead; with
    ``GATED``, the gated epilogue on ``acc`` and ``acc2``, the gate kept in ``pre`` and the up
    projection in ``pre2`` (both laid out as the output)."""
    c_offsets = rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if GATED:
        gate, up, out = gated_epilogue(acc, acc2, cols, bias_ptr, bias2_ptr, N, stride_bias, HAS_BIAS, ACTIVATION)
        if STORE_PRE:
            tl.store(pre_ptr + c_offsets, helpers.convert(gate, pre_ptr.dtype.element_ty), mask=mask)
            tl.store(pre2_ptr + c_offsets, helpers.convert(up, pre2_ptr.dtype.element_ty), mask=mask)
    elif GRAD_ACT:
        pre = tl.load(pre_ptr + c_offsets, mask=mask, other=0.0)
        out = grad_epilogue(acc, pre, mask, colsum_ptr, pid_m, cols, N, ACTIVATION, SUM_ROWS)
    else:
        pre, out = epilogue(acc, cols, bias_ptr, N, stride_bias, HAS_BIAS, ACTIVATION)
        # ``helpers.convert``: bf16 rounded to nearest even in the interpreter too (compiled: a plain cast).
        if STORE_PRE:
            tl.store(pre_ptr + c_offsets, helpers.convert(pre, pre_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + c_offsets, helpers.convert(out, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def matmul_kernel(
    # Pointers: a, b, c (the output), bias and pre (c's where absent), split-K's workspace and counters (c's
    # without), the column sums' partials (SUM_ROWS; c's without); GATED: the up projection's b2 (laid out as b),
    # its bias and its kept product pre2 (b's, c's and c's without).
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, ws_ptr, arrivals_ptr, colsum_ptr, b2_ptr, bias2_ptr, pre2_ptr,
    # Sizes: a is (M, K), b (K, N); M_BUCKET (M's power-of-two bucket, ``configs.matmul_m_bucket``) keys the tuner.
    M, N, K, M_BUCKET,
    # Strides, in elements, of a, b, c and the bias.
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    # Compile-time switches: the epilogue (GRAD_ACT: the backward one, on pre read; SUM_ROWS: its column sums;
    # GATED: act(a @ b + bias) * (a @ b2 + bias2)) and the prologue on A; the arithmetic and the offsets; the tile.
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, GRAD_ACT: tl.constexpr,
    SUM_ROWS: tl.constexpr, PROLOGUE: tl.constexpr, GATED: tl.constexpr,
    ACC_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
):  # fmt: skip
    pid_m, pid_n = helpers.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    # Row and column masks are constant along K, so A and B loads stay 16 bytes wide.
    # (Wrapping indices with ``% M`` instead, as Triton's tutorial does, breaks the
    # alignment its hints promise: a misaligned-address fault for fp16 with K = 33.)
    row_ok = (rows < M)[:, None]
    col_ok = (cols < N)[None, :]
    # Split-K: program (tile, s) sums K steps [k_lo, k_hi) of its tile.
    k_lo = 0
    k_hi = tl.cdiv(K, BLOCK_K)
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_hi, SPLIT_K)
        k_lo = tl.program_id(1) * per_split
        k_hi = tl.minimum(k_hi, k_lo + per_split)
        if INT64:
            k_lo = k_lo.to(tl.int64)
    k_offs = tl.arange(0, BLOCK_K)
    ks = k_lo * BLOCK_K + k_offs
    tl.static_assert(not GATED or (SPLIT_K == 1 and not GRAD_ACT), "the gated epilogue runs without split-K")
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    b2_ptrs = b2_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn  # (GATED: b2 is laid out as b)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)  # (GATED's up projection; unused otherwise)
    for k in range(k_lo, k_hi):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok, other=0.0)
            if GATED:
                b2 = tl.load(b2_ptrs, mask=col_ok, other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok & (k_offs[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(k_offs[:, None] < k_left) & col_ok, other=0.0)
            if GATED:
                b2 = tl.load(b2_ptrs, mask=(k_offs[:, None] < k_left) & col_ok, other=0.0)
        a = prologue(a, PROLOGUE)
        if UPCAST_OPERANDS or (helpers.INTERPRETED and a.dtype == tl.bfloat16):
            # (the interpreter's own bf16 -> fp32 conversion flushes subnormals; widen is exact)
            a = helpers.widen(a, tl.float32)
            b = helpers.widen(b, tl.float32)
            if GATED:
                b2 = helpers.widen(b2, tl.float32)
        if DOT:
            acc = helpers.dot(a, b, acc, INPUT_PRECISION, ACC_DTYPE)
            if GATED:
                acc2 = helpers.dot(a, b2, acc2, INPUT_PRECISION, ACC_DTYPE)
        else:
            acc += helpers.outer_sum(a, b, ACC_DTYPE)
            if GATED:
                acc2 += helpers.outer_sum(a, b2, ACC_DTYPE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        if GATED:
            b2_ptrs += BLOCK_K * stride_bk

    mask = row_ok & col_ok
    if SPLIT_K == 1:
        _store(
            acc,
            acc2,
            rows,
            cols,
            mask,
            pid_m,
            c_ptr,
            bias_ptr,
            pre_ptr,
            colsum_ptr,
            bias2_ptr,
            pre2_ptr,
            N,
            stride_cm,
            stride_cn,
            stride_bias,
            HAS_BIAS,
            ACTIVATION,
            STORE_PRE,
            GRAD_ACT,
            SUM_ROWS,
            GATED,
        )
    else:
        # Each split writes its partial tile to the (SPLIT_K, M, N) workspace and counts
        # itself in; the last to arrive sums the partials in split order (so the result
        # does not depend on which split finished last), applies the epilogue and
        # resets the tile's counter to zero for the next launch on this stream.
        ws = ws_ptr + rows[:, None] * N + cols[None, :]
        tl.store(ws + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count is released
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(arrivals_ptr + tl.program_id(0), 0)
            _store(
                total,
                total,
                rows,
                cols,
                mask,
                pid_m,
                c_ptr,
                bias_ptr,
                pre_ptr,
                colsum_ptr,
                bias2_ptr,
                pre2_ptr,
                N,
                stride_cm,
                stride_cn,
                stride_bias,
                HAS_BIAS,
                ACTIVATION,
                STORE_PRE,
                GRAD_ACT,
                SUM_ROWS,
                GATED,
            )
