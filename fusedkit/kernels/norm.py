"""The row-normalisation family: RMSNorm and LayerNorm, with an optional residual add first.

One forward kernel and one backward kernel; the variants are compile-time switches (RMS or
LayerNorm statistics, residual, weight, bias). The host sees a normalisation as ``rows``
rows of ``n`` unit-stride columns, each row at its own stride (``fusedkit.runtime.norm``).

Forward, per row: ``h = x + alpha * residual`` (rounded to h's dtype and stored: the new
residual stream, and what the statistics read, as the eager composition reads it), then
``y = (h - mean) * rstd * w + b`` (LayerNorm) or ``y = h * rstd * w`` (RMS, no mean), all
in float32. A row that fits one block (``ONE_PASS``: up to ``MAX_ONE_PASS`` columns) is read
once, several such rows per program where they are narrow; a wider row is read in chunks,
twice (statistics, then the output), its LayerNorm statistics merged chunk by chunk (Chan's
parallel variance: no ``E[h^2] - mean^2`` cancellation).

Backward, per row, with ``xhat = (h - mean) * rstd`` and ``g = dy * w``:
``dh = rstd * (g - mean(g) - xhat * mean(g * xhat))`` (RMS: no ``mean(g)`` term), plus the
gradient that reached ``h`` itself (``dh_out``); the weight's and bias's gradients are summed
over each program's rows into one float32 row per program, which the host sums in a fixed
order: the same bits run to run (no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .helpers import convert, widen

#: The widest row read in one block; wider rows loop over ``CHUNK``-column chunks.
MAX_ONE_PASS = 8192
CHUNK = 4096


@triton.jit
def _h_block(
    x_ptr, r_ptr, h_ptr, row, row_mask, cols, n, s_x, s_r, s_h, alpha, RESIDUAL: tl.constexpr, STORE: tl.constexpr
):
    """One block of rows of ``h = x + alpha * residual`` in float32, rounded to h's dtype
    first as the eager add rounds it (stored with ``STORE``), and the block's masks."""
    col_mask = cols < n
    mask = row_mask[:, None] & col_mask[None, :]
    # (masked-out lanes read as zeros: the row sums run over the whole block, and a masked load
    # without ``other`` leaves them undefined on a GPU)
    h = widen(tl.load(x_ptr + row[:, None] * s_x + cols[None, :], mask=mask, other=0.0), tl.float32)
    if RESIDUAL:
        r = widen(tl.load(r_ptr + row[:, None] * s_r + cols[None, :], mask=mask, other=0.0), tl.float32)
        h = convert(h + alpha * r, h_ptr.dtype.element_ty)
        if STORE:
            tl.store(h_ptr + row[:, None] * s_h + cols[None, :], h, mask=mask)
        h = widen(h, tl.float32)
    return h, mask, col_mask


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, col_mask, s_w, s_b, WEIGHT: tl.constexpr, BIAS: tl.constexpr):
    """``xhat * w + b`` (each where given; read at their strides), in float32."""
    if WEIGHT:
        xhat = xhat * widen(tl.load(w_ptr + cols * s_w, mask=col_mask), tl.float32)[None, :]
    if BIAS:
        xhat = xhat + widen(tl.load(b_ptr + cols * s_b, mask=col_mask), tl.float32)[None, :]
    return xhat


@triton.jit
def norm_forward_kernel(
    # pointers: inputs, outputs (h only with RESIDUAL), per-row statistics (float32)
    x_ptr,
    r_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    h_ptr,
    mean_ptr,
    rstd_ptr,
    # scalars
    eps,
    alpha,
    # sizes
    rows,
    n,
    # row strides (columns have stride 1), then the weight's and bias's element strides
    s_x,
    s_r,
    s_y,
    s_h,
    s_w,
    s_b,
    # compile-time switches
    RMS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    WEIGHT: tl.constexpr,
    BIAS: tl.constexpr,
    STATS: tl.constexpr,  # store mean (LayerNorm) and rstd for the backward
    ONE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = row < rows
    row = row.to(tl.int64)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        h, mask, col_mask = _h_block(x_ptr, r_ptr, h_ptr, row, row_mask, cols, n, s_x, s_r, s_h, alpha, RESIDUAL, True)
        if RMS:
            mean = tl.zeros([BLOCK_M], tl.float32)
            centred = h
        else:
            mean = tl.sum(h, axis=1) / n
            centred = tl.where(mask, h - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / n + eps)
        y = _affine(centred * rstd[:, None], w_ptr, b_ptr, cols, col_mask, s_w, s_b, WEIGHT, BIAS)
        tl.store(y_ptr + row[:, None] * s_y + cols[None, :], convert(y, y_ptr.dtype.element_ty), mask=mask)
    else:  # one row a program (BLOCK_M == 1), in chunks: statistics, then the output
        mean = tl.zeros([BLOCK_M], tl.float32)
        m2 = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, n, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            h, mask, col_mask = _h_block(
                x_ptr, r_ptr, h_ptr, row, row_mask, cols, n, s_x, s_r, s_h, alpha, RESIDUAL, True
            )
            if RMS:
                m2 += tl.sum(h * h, axis=1)
            else:  # Chan et al.: merge this chunk's mean and squared deviations into the row's
                count = tl.minimum(n - start, BLOCK_N).to(tl.float32)
                chunk_mean = tl.sum(h, axis=1) / count
                dev = tl.where(mask, h - chunk_mean[:, None], 0.0)
                delta = chunk_mean - mean
                seen = start * 1.0  # (a float32 in compiled code; the interpreter loops over ints)
                mean += delta * (count / (seen + count))
                m2 += tl.sum(dev * dev, axis=1) + delta * delta * (seen * count / (seen + count))
        rstd = 1.0 / tl.sqrt(m2 / n + eps)
        for start in range(0, n, BLOCK_N):  # (h again from x and residual: this pass stores only y)
            cols = start + tl.arange(0, BLOCK_N)
            h, mask, col_mask = _h_block(
                x_ptr, r_ptr, h_ptr, row, row_mask, cols, n, s_x, s_r, s_h, alpha, RESIDUAL, False
            )
            y = _affine((h - mean[:, None]) * rstd[:, None], w_ptr, b_ptr, cols, col_mask, s_w, s_b, WEIGHT, BIAS)
            tl.store(y_ptr + row[:, None] * s_y + cols[None, :], convert(y, y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        if not RMS:
            tl.store(mean_ptr + row, mean, mask=row_mask)
        tl.store(rstd_ptr + row, rstd, mask=row_mask)


@triton.jit
def _row_grads(dy_ptr, h_ptr, w_ptr, row, row_mask, cols, n, s_dy, s_h, s_w, mean, rstd, WEIGHT: tl.constexpr):
    """One block of rows: ``xhat`` and ``g = dy * w`` (float32), ``dy``, and the block's masks
    (rows past the program's last read as zeros: they add nothing to the parameters' sums)."""
    col_mask = cols < n
    mask = row_mask[:, None] & col_mask[None, :]
    dy = widen(tl.load(dy_ptr + row[:, None] * s_dy + cols[None, :], mask=mask, other=0.0), tl.float32)
    h = widen(tl.load(h_ptr + row[:, None] * s_h + cols[None, :], mask=mask, other=0.0), tl.float32)
    xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if WEIGHT:
        g = dy * widen(tl.load(w_ptr + cols * s_w, mask=col_mask, other=0.0), tl.float32)[None, :]
    return xhat, g, dy, mask, col_mask


@triton.jit
def norm_backward_kernel(
    # pointers: the output's gradient, the normalised input (h), the weight, the statistics,
    # the gradient reaching h itself (RESIDUAL_GRAD), the input's gradient, per-program
    # partial sums of the weight's and bias's gradients (float32, [programs, n])
    dy_ptr,
    h_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dh_out_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    # sizes: rows, columns, rows a program takes (a contiguous run, a multiple of BLOCK_M)
    rows,
    n,
    rows_per_program,
    # row strides
    s_dy,
    s_h,
    s_dh_out,
    s_dx,
    s_w,  # (the weight's element stride)
    # compile-time switches
    RMS: tl.constexpr,
    WEIGHT: tl.constexpr,  # the output was scaled by a weight
    BIAS: tl.constexpr,  # compute the bias's gradient
    RESIDUAL_GRAD: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows an iteration (1 with chunks)
    BLOCK_N: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr = True,  # compute the weight's gradient (with WEIGHT)
):
    pid = tl.program_id(0)
    first = pid * rows_per_program  # (a multiple of BLOCK_M)
    last = tl.minimum(first + rows_per_program, rows)
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n
        dw = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        db = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # (BLOCK_M rows an iteration where they are narrow: one 768-wide row a step left the
    # loads of a program too few to cover DRAM's latency)
    for start in range(first, last, BLOCK_M):
        row = start + tl.arange(0, BLOCK_M)
        row_mask = row < last
        row = row.to(tl.int64)
        rstd = tl.load(rstd_ptr + row, mask=row_mask, other=0.0)
        if RMS:
            mean = tl.zeros([BLOCK_M], tl.float32)
        else:
            mean = tl.load(mean_ptr + row, mask=row_mask, other=0.0)
        if ONE_PASS:
            xhat, g, dy, mask, col_mask = _row_grads(
                dy_ptr, h_ptr, w_ptr, row, row_mask, cols, n, s_dy, s_h, s_w, mean, rstd, WEIGHT
            )
            dot = tl.sum(g * xhat, axis=1) / n
            dh = g - xhat * dot[:, None]
            if not RMS:
                dh -= (tl.sum(g, axis=1) / n)[:, None]
            dh *= rstd[:, None]
            if RESIDUAL_GRAD:
                dh += widen(tl.load(dh_out_ptr + row[:, None] * s_dh_out + cols[None, :], mask=mask), tl.float32)
            tl.store(dx_ptr + row[:, None] * s_dx + cols[None, :], convert(dh, dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT and WEIGHT_GRAD:
                dw += dy * xhat
            if BIAS:
                db += dy
        else:  # one row (BLOCK_M == 1) in chunks: the two row sums, then the gradients
            dot = tl.zeros([BLOCK_M], tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            for chunk in range(0, n, BLOCK_N):
                cols = chunk + tl.arange(0, BLOCK_N)
                xhat, g, dy, mask, col_mask = _row_grads(
                    dy_ptr, h_ptr, w_ptr, row, row_mask, cols, n, s_dy, s_h, s_w, mean, rstd, WEIGHT
                )
                dot += tl.sum(g * xhat, axis=1)
                total += tl.sum(g, axis=1)
            for chunk in range(0, n, BLOCK_N):
                cols = chunk + tl.arange(0, BLOCK_N)
                xhat, g, dy, mask, col_mask = _row_grads(
                    dy_ptr, h_ptr, w_ptr, row, row_mask, cols, n, s_dy, s_h, s_w, mean, rstd, WEIGHT
                )
                dh = g - xhat * (dot / n)[:, None]
                if not RMS:
                    dh -= (total / n)[:, None]
                dh *= rstd[:, None]
                if RESIDUAL_GRAD:
                    dh += widen(tl.load(dh_out_ptr + row[:, None] * s_dh_out + cols[None, :], mask=mask), tl.float32)
                tl.store(dx_ptr + row[:, None] * s_dx + cols[None, :], convert(dh, dx_ptr.dtype.element_ty), mask=mask)
                # (this program's own partial row: read, add, written back; no other program touches it)
                if WEIGHT and WEIGHT_GRAD:
                    part = dw_ptr + pid.to(tl.int64) * n + cols[None, :]
                    tl.store(part, tl.load(part, mask=mask) + dy * xhat, mask=mask)
                if BIAS:
                    part = db_ptr + pid.to(tl.int64) * n + cols[None, :]
                    tl.store(part, tl.load(part, mask=mask) + dy, mask=mask)
    if ONE_PASS:
        if WEIGHT and WEIGHT_GRAD:
            tl.store(dw_ptr + pid.to(tl.int64) * n + cols, tl.sum(dw, axis=0), mask=col_mask)
        if BIAS:
            tl.store(db_ptr + pid.to(tl.int64) * n + cols, tl.sum(db, axis=0), mask=col_mask)


__all__ = ["CHUNK", "MAX_ONE_PASS", "norm_backward_kernel", "norm_forward_kernel", "triton"]
