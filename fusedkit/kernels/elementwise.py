"""The one elementwise kernel: every registry entry runs it, its math a compile-time argument.

A launch sees its problem as ``(batch, rows, cols)`` tiles (the host plans them:
``fusedkit.runtime.layout``); each program loads one tile of every operand through
its strides, converts it as PyTorch would, applies ``FN`` and stores the result.
Each registry entry compiles its own specialisation. With ``NUM_OUTPUTS == 2``, ``FN``
returns a pair and the second value goes to ``out2_ptr``, laid out as ``out_ptr``: a
backward that gives two gradients from one read of its inputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import helpers

__all__ = ["elementwise_kernel", "NOT_SPECIALISED", "POINTER_ARGS"]

#: The kernel's leading pointer parameters: out, the three operand slots, out2 (the second
#: output's; out's own address in a one-output launch).
POINTER_ARGS = 5


@triton.jit
def _operand(
    ptr,
    bits,
    i0,
    i1,
    i2,
    i3,
    rows,
    cols,
    mask,
    s0,
    s1,
    s2,
    s3,
    s_r,
    s_c,
    IS_SCALAR: tl.constexpr,
    UNIT_R: tl.constexpr,
    UNIT_C: tl.constexpr,
    INT64: tl.constexpr,
    RESULT_DTYPE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    COMPUTE_IS_FLOAT: tl.constexpr,
):
    if IS_SCALAR:
        # A wrapped Python number goes straight to the compute dtype, as torch's CUDA
        # kernels read it (fp16 x + 2049.0001 is x + 2049.0001f, not x + 2048).
        value = helpers.scalar_value(bits, COMPUTE_DTYPE, COMPUTE_IS_FLOAT)
    else:
        offsets = helpers.strided_offsets(i0, i1, i2, i3, rows, cols, s0, s1, s2, s3, s_r, s_c, UNIT_R, UNIT_C, INT64)
        value = helpers.load_operand(ptr, offsets, mask, RESULT_DTYPE, COMPUTE_DTYPE)
    return value


#: Arguments Triton must not specialise on: scalar bit patterns (a new ``alpha``
#: would otherwise compile a new kernel when its bits happen to be 1 or a multiple
#: of 16) and the batch sizes, tile counts and their division constants, which only feed
#: index arithmetic.
#: Strides and the row / column sizes stay specialised: their divisibility by 16
#: is what lets Triton prove 16-byte accesses.
NOT_SPECIALISED = (
    "a_bits",
    "b_bits",
    "c_bits",
    "param_bits",
    "size1",
    "size2",
    "size3",
    "tiles_c",
    "tiles_c_magic",
    "tiles_c_shift",
    "tiles_per_batch",
)


@triton.jit(do_not_specialize=NOT_SPECIALISED)
def elementwise_kernel(
    # Pointers: out, the three operand slots (out's where a slot is a scalar or unused), out2 (out's if unused).
    out_ptr, a_ptr, b_ptr, c_ptr, out2_ptr,
    # Host scalars as 64-bit patterns (``helpers.scalar_value``): each operand slot's, the parameter's.
    a_bits, b_bits, c_bits, param_bits,
    # Sizes and tile counts: batch dims 1-3, rows, columns; tile columns, its division constants; tiles per batch.
    size1, size2, size3, size_r, size_c, tiles_c, tiles_c_magic, tiles_c_shift, tiles_per_batch,
    # Strides of the output, then of each operand slot: batch dims 0-3, the tile's row axis, its column axis.
    o_s0, o_s1, o_s2, o_s3, o_sr, o_sc,
    a_s0, a_s1, a_s2, a_s3, a_sr, a_sc,
    b_s0, b_s1, b_s2, b_s3, b_sr, b_sc,
    c_s0, c_s1, c_s2, c_s3, c_sr, c_sc,
    # Compile-time switches: the op; per-operand flags (bit k: operand k, 0 the output); dtypes; tiling.
    FN: tl.constexpr, NUM_INPUTS: tl.constexpr, HAS_PARAM: tl.constexpr, NUM_OUTPUTS: tl.constexpr,
    SCALAR_MASK: tl.constexpr, UNIT_R_MASK: tl.constexpr, UNIT_C_MASK: tl.constexpr,
    RESULT_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, COMPUTE_IS_FLOAT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INT64: tl.constexpr, BATCHED: tl.constexpr,
):  # fmt: skip
    # Without batch dims (BATCHED false) the program's coordinates take no division by a
    # runtime value: five of them (four for the batch index, one for the tile row) made each
    # thread run 149 instructions before its first load, now 22 to 24 (bf16 silu_mul, sm_90).
    batch, tile_r, tile_c = helpers.tile_coords(
        tl.program_id(0), tiles_c, tiles_c_magic, tiles_c_shift, tiles_per_batch, BATCHED
    )
    rows = helpers.block_range(tile_r, BLOCK_R, INT64)
    cols = helpers.block_range(tile_c, BLOCK_C, INT64)
    if BATCHED:
        i0, i1, i2, i3 = helpers.batch_index(batch, size1, size2, size3)
    else:
        i0, i1, i2, i3 = batch, batch, batch, batch
    # Interior tiles skip the mask: a bound that is not a multiple of 16 would
    # otherwise stop Triton from issuing 16-byte accesses for the whole launch
    # (what that cost: docs/design.md, "Interior tiles run unmasked").
    full = helpers.block_is_full(tile_r, BLOCK_R, size_r, INT64) & helpers.block_is_full(tile_c, BLOCK_C, size_c, INT64)
    for MASKED in tl.static_range(2):  # the tile twice, unmasked and masked; each program runs one
        if full == (MASKED == 0):
            if MASKED:
                mask = helpers.tile_mask(rows, cols, size_r, size_c)
            else:
                mask = None
            # Operand k (0 = output, 1..3 = inputs) owns bit k of the masks.
            a = _operand(
                a_ptr,
                a_bits,
                i0,
                i1,
                i2,
                i3,
                rows,
                cols,
                mask,
                a_s0,
                a_s1,
                a_s2,
                a_s3,
                a_sr,
                a_sc,
                (SCALAR_MASK >> 1) & 1,
                (UNIT_R_MASK >> 1) & 1,
                (UNIT_C_MASK >> 1) & 1,
                INT64,
                RESULT_DTYPE,
                COMPUTE_DTYPE,
                COMPUTE_IS_FLOAT,
            )
            if HAS_PARAM:  # torch converts the parameter straight to the compute dtype
                p = helpers.scalar_value(param_bits, COMPUTE_DTYPE, COMPUTE_IS_FLOAT)
            if NUM_INPUTS >= 2:
                b = _operand(
                    b_ptr,
                    b_bits,
                    i0,
                    i1,
                    i2,
                    i3,
                    rows,
                    cols,
                    mask,
                    b_s0,
                    b_s1,
                    b_s2,
                    b_s3,
                    b_sr,
                    b_sc,
                    (SCALAR_MASK >> 2) & 1,
                    (UNIT_R_MASK >> 2) & 1,
                    (UNIT_C_MASK >> 2) & 1,
                    INT64,
                    RESULT_DTYPE,
                    COMPUTE_DTYPE,
                    COMPUTE_IS_FLOAT,
                )
            if NUM_INPUTS == 3:
                c = _operand(
                    c_ptr,
                    c_bits,
                    i0,
                    i1,
                    i2,
                    i3,
                    rows,
                    cols,
                    mask,
                    c_s0,
                    c_s1,
                    c_s2,
                    c_s3,
                    c_sr,
                    c_sc,
                    (SCALAR_MASK >> 3) & 1,
                    (UNIT_R_MASK >> 3) & 1,
                    (UNIT_C_MASK >> 3) & 1,
                    INT64,
                    RESULT_DTYPE,
                    COMPUTE_DTYPE,
                    COMPUTE_IS_FLOAT,
                )
            if NUM_INPUTS == 1:
                if HAS_PARAM:
                    result = FN(a, p)
                else:
                    result = FN(a)
            elif NUM_INPUTS == 2:
                if HAS_PARAM:
                    result = FN(a, b, p)
                else:
                    result = FN(a, b)
            else:
                if HAS_PARAM:
                    result = FN(a, b, c, p)
                else:
                    result = FN(a, b, c)
            out_offsets = helpers.strided_offsets(
                i0, i1, i2, i3, rows, cols, o_s0, o_s1, o_s2, o_s3, o_sr, o_sc, UNIT_R_MASK & 1, UNIT_C_MASK & 1, INT64
            )
            if NUM_OUTPUTS == 1:
                helpers.store_result(out_ptr, out_offsets, result, mask, RESULT_DTYPE)
            else:
                helpers.store_result(out_ptr, out_offsets, result[0], mask, RESULT_DTYPE)
                helpers.store_result(out2_ptr, out_offsets, result[1], mask, RESULT_DTYPE)
