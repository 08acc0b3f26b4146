"""Triton helpers shared by every fusedkit kernel.

Kernels see a problem as ``(batch, rows, cols)`` tiles: the host collapses the
broadcast shape to at most ``MAX_BATCH_DIMS`` leading dimensions plus a 2-D tile
plane (see ``fusedkit.runtime.layout``). A contiguous tensor becomes one row of ``n``
columns, so the 1-D fast path is the same code with ``BLOCK_R == 1``.

``INT64`` is chosen on the host: offsets are 32-bit unless some reachable offset
needs more, so small tensors keep cheap 32-bit index arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) was built for Triton's interpreter:
    Triton decides this once, when the decorator runs (``TRITON_INTERPRET=1`` then), so the
    answer comes from the kernel object and not from the environment now."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def divide_by_invariant(n, magic, shift):
    """``n // d`` for ``0 <= n < 2**31`` and the divisor ``d >= 1`` that the host encoded as
    ``magic = ceil(2**shift / d)``, ``shift = 31 + ceil(log2(d))`` (``layout.division_magic``):
    one 64-bit multiply and a shift where a division by a runtime value takes about 25
    instructions (Granlund and Montgomery's division by invariant integers)."""
    return ((n.to(tl.int64) * magic) >> shift).to(tl.int32)


@triton.jit
def tile_coords(pid, tiles_c, tiles_c_magic, tiles_c_shift, tiles_per_batch, BATCHED: tl.constexpr):
    """Split a flat program id into (batch index, tile row, tile column); the batch index is
    0 unless ``BATCHED``."""
    if BATCHED:
        batch = pid // tiles_per_batch
        tile = pid % tiles_per_batch
    else:
        batch = pid * 0
        tile = pid
    tile_r = divide_by_invariant(tile, tiles_c_magic, tiles_c_shift)
    return batch, tile_r, tile - tile_r * tiles_c


@triton.jit
def block_range(tile, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """Indices ``tile * BLOCK + [0, BLOCK)``, in 64-bit when ``INT64``."""
    if INT64:
        idx = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        idx = tile * BLOCK + tl.arange(0, BLOCK)
    return idx


@triton.jit
def block_is_full(tile, BLOCK: tl.constexpr, size, INT64: tl.constexpr):
    """True when block ``tile`` lies wholly inside ``[0, size)``."""
    if INT64:
        end = (tile.to(tl.int64) + 1) * BLOCK
    else:
        end = (tile + 1) * BLOCK
    return end <= size


@triton.jit
def tile_mask(rows, cols, size_r, size_c):
    """In-bounds mask of a ``[BLOCK_R, BLOCK_C]`` tile."""
    return (rows < size_r)[:, None] & (cols < size_c)[None, :]


@triton.jit
def batch_index(batch, size1, size2, size3):
    """Unravel a batch index over up to four leading dims (row-major, dim 0 outermost)."""
    i3 = batch % size3
    batch = batch // size3
    i2 = batch % size2
    batch = batch // size2
    i1 = batch % size1
    i0 = batch // size1
    return i0, i1, i2, i3


@triton.jit
def strided_offsets(
    i0,
    i1,
    i2,
    i3,
    rows,
    cols,
    s0,
    s1,
    s2,
    s3,
    s_r,
    s_c,
    UNIT_R: tl.constexpr,
    UNIT_C: tl.constexpr,
    INT64: tl.constexpr,
):
    """Element offsets of one operand's tile, read through its strides.

    Broadcast dims carry stride 0. ``UNIT_R`` / ``UNIT_C`` say that the row or
    column stride is 1: the compiler then sees contiguous addresses and issues
    wide, coalesced loads along that axis (a transposed operand has ``UNIT_R``).
    """
    if INT64:
        base = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2 + i3.to(tl.int64) * s3
    else:
        base = i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3
    if UNIT_R:
        r_off = rows
    else:
        r_off = rows * s_r
    if UNIT_C:
        c_off = cols
    else:
        c_off = cols * s_c
    return base + r_off[:, None] + c_off[None, :]


@triton.jit
def scalar_value(bits, DTYPE: tl.constexpr, IS_FLOAT: tl.constexpr):
    """A host scalar passed as 64 bits, as torch would use it in a computation of ``DTYPE``.

    Floats travel as the bit pattern of a float64 and ints as int64, because a Python
    float kernel argument is narrowed to float32 (by the interpreter at least), which
    would round a float64 computation's scalar. The value is then converted with
    :func:`convert`, the way torch converts a wrapped Python number.
    """
    bits64 = tl.cast(bits, tl.int64)
    if IS_FLOAT:
        value = tl.cast(bits64, tl.float64, bitcast=True)
    else:
        value = bits64
    return convert(value, DTYPE)


@triton.jit
def bf16_bits_to_fp32(value):
    """A bfloat16 tile widened to fp32 through its bits: exact, subnormals included."""
    bits = value.to(tl.uint16, bitcast=True).to(tl.uint32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(value):
    """An fp32 tile rounded to bfloat16, to nearest with ties to even, through its bits:
    what ``cvt.rn.bf16.f32`` does on the GPU (subnormals kept, NaN stays a quiet NaN)."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + (BF16_ROUND_BIAS + ((bits >> 16) & 1))) >> 16
    quiet_nan = (bits >> 16) | BF16_QUIET_BIT
    return tl.where(value == value, rounded, quiet_nan).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def convert(value, DTYPE: tl.constexpr):
    """``value`` converted to ``DTYPE`` as PyTorch converts between its dtypes.

    Anything bound for a 16-bit float goes through fp32 first, as c10's ``Half`` and
    ``BFloat16`` are built from a float (int64 16777217 -> fp16 rounds twice in torch
    too); everything else converts directly, so an int64 operand of a float64 result
    is exact. fp32 -> bf16 rounds to nearest even: Triton's interpreter would
    truncate it (and flush subnormals), so interpreted kernels do it in integer ops.
    """
    if value.dtype != DTYPE:
        if DTYPE == tl.bfloat16 or DTYPE == tl.float16 or value.dtype == tl.bfloat16:
            value = widen(value, tl.float32)  # (exact from bfloat16)
        if value.dtype != DTYPE:
            if DTYPE == tl.bfloat16 and INTERPRETED:
                value = fp32_to_bf16_bits(value)
            else:
                value = value.to(DTYPE)
    return value


@triton.jit
def widen(value, DTYPE: tl.constexpr):
    """``value.to(DTYPE)``, with bfloat16 inputs widened exactly in the interpreter too."""
    if value.dtype == tl.bfloat16 and INTERPRETED:
        value = bf16_bits_to_fp32(value)
    return value.to(DTYPE)


@triton.jit
def load_operand(ptr, offsets, mask, RESULT_DTYPE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr):
    """Load a tile in its storage dtype, convert it to the result dtype (as PyTorch casts
    every input to the common dtype: int32 2049 + fp16 x is 2048 + x), then widen it to the
    compute dtype (fp16 and bf16 compute in fp32, PyTorch's "opmath")."""
    return widen(convert(tl.load(ptr + offsets, mask=mask), RESULT_DTYPE), COMPUTE_DTYPE)


@triton.jit
def store_result(ptr, offsets, value, mask, RESULT_DTYPE: tl.constexpr):
    """Round the computed tile to the result dtype, then convert it to the output's dtype
    when ``out=`` has another one (PyTorch rounds twice too), and store it."""
    value = convert(convert(value, RESULT_DTYPE), ptr.dtype.element_ty)
    tl.store(ptr + offsets, value, mask=mask)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (tile row, tile col), walking GROUP_M tile rows per column band for L2 reuse."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % size_m)
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def outer_sum(a, b, ACC_DTYPE: tl.constexpr):
    """``a @ b`` for an (M, K) and a (K, N) block as a broadcast multiply and a sum over K,
    in ``ACC_DTYPE``: exact fp32 on CUDA cores. Blocks of fewer than 16 rows only: from 16
    up in every dimension Triton rewrites this pattern into a ``tl.dot`` with TF32 inputs."""
    return tl.sum(a[:, :, None].to(ACC_DTYPE) * b[None, :, :].to(ACC_DTYPE), axis=1)


#: Clears the 13 low mantissa bits of an fp32 bit pattern (0xFFFFE000 as int32): what
#: is left (sign, exponent, 10 mantissa bits) is exactly a TF32 value.
TF32_KEEP_BITS = tl.constexpr(-(1 << 13))
#: Half a TF32 unit in the last place, in fp32 bits: added before the mask, it rounds the
#: magnitude to nearest with ties away from zero, as ``cvt.rna.tf32.f32`` does.
TF32_HALF_ULP_BITS = tl.constexpr(1 << 12)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
#: fp32 -> bf16 round to nearest even in integer ops: add 0x7FFF plus the kept part's lowest
#: bit, then drop the low 16 bits.
BF16_ROUND_BIAS = tl.constexpr(0x7FFF)
#: The quiet bit of a bf16 NaN (the top mantissa bit).
BF16_QUIET_BIT = tl.constexpr(0x40)


#: ``x`` rounded to TF32, to nearest with ties away from zero, saturating to the largest
#: finite TF32 value (the fp32 maximum truncated) where rounding would overflow: one
#: instruction on sm_80 and newer.
TF32_ROUND_ASM = tl.constexpr("cvt.rna.satfinite.tf32.f32 $0, $1;")


@triton.jit
def _float32_asm(ASM: tl.constexpr, x):
    """The one-operand float32 instruction ``ASM`` on each element of ``x``."""
    return tl.inline_asm_elementwise(
        ASM, "=r,r", [x.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1
    ).to(tl.float32, bitcast=True)


@triton.jit
def tf32_round_bits(x):
    """``cvt.rna.satfinite.tf32.f32`` in integer operations, for finite ``x``: what the
    interpreter runs. Compiled kernels use the instruction, as this costs about 10 operations
    an element: the tf32x3 product ran 13% slower with it at M = 512, K = N = 4096 (H200;
    docs/matmul.md, "TF32")."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + TF32_HALF_ULP_BITS) & TF32_KEEP_BITS).to(tl.float32, bitcast=True)
    truncated = (bits & TF32_KEEP_BITS).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(rounded) <= FP32_MAX, rounded, truncated)


@triton.jit
def tf32_round(x):
    """Finite fp32 ``x`` rounded to TF32 as ``TF32_ROUND_ASM`` rounds it: the instruction
    in compiled kernels, ``tf32_round_bits`` in the interpreter."""
    if NATIVE_TF32_ROUND:
        return _float32_asm(TF32_ROUND_ASM, x)
    else:
        return tf32_round_bits(x)


@triton.jit
def tf32_big(x):
    """fp32 ``x`` as a TF32 value: rounded to nearest (as Triton's "tf32x3" rounds it),
    except where rounding would overflow to inf, where it is truncated, so inputs near the
    fp32 maximum stay finite (Triton's turn into inf); inf and NaN are kept."""
    return tl.where(tl.abs(x) <= FP32_MAX, tf32_round(x), x)


@triton.jit
def tf32_split(x):
    """fp32 ``x`` as ``big + small`` exactly, ``big`` its ``tf32_big``; the ``small`` of inf
    and NaN is NaN."""
    big = tf32_big(x)
    return big, x - big


#: ``1 / x`` in float32 to 1 ulp, denormal inputs and results flushed to zero (so 0 for
#: |x| > 2^126 and infinities): one MUFU instruction where ``1 / x`` compiles to seven, its
#: range scaling included.
RCP_APPROX_ASM = tl.constexpr("rcp.approx.ftz.f32 $0, $1;")
#: ``2^x`` in float32 to 2 ulp, results below 2^-126 flushed to 0: one MUFU instruction where
#: ``tl.exp2`` adds three to keep denormal results.
EX2_APPROX_ASM = tl.constexpr("ex2.approx.ftz.f32 $0, $1;")
#: float32's smallest normal magnitude: what the ``.ftz`` instructions flush below.
FP32_TINY = tl.constexpr(2.0**-126)


@triton.jit
def _flush_denormal(x):
    """``x`` with denormals flushed to a zero of their sign, as ``.ftz`` instructions flush."""
    return tl.where(tl.abs(x) < FP32_TINY, x * 0, x)


@triton.jit
def reciprocal_approx(x):
    """``1 / x`` for float32 ``x`` as ``RCP_APPROX_ASM`` gives it; the interpreter divides
    and flushes as the instruction does."""
    if INTERPRETED:
        result = _flush_denormal(1 / _flush_denormal(x))
    else:
        result = _float32_asm(RCP_APPROX_ASM, x)
    return result


@triton.jit
def exp2_approx(x):
    """``2^x`` for float32 ``x`` as ``EX2_APPROX_ASM`` gives it; the interpreter calls
    ``tl.exp2`` and flushes as the instruction does."""
    if INTERPRETED:
        result = _flush_denormal(tl.exp2(x))
    else:
        result = _float32_asm(EX2_APPROX_ASM, x)
    return result


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """``acc + a @ b`` at ``INPUT_PRECISION``; "tf32x3" is three TF32 tensor-core products,
    big * big + (small * big + big * small), in Triton's own tf32x3 order: at M = 64, K = N
    = 4096 on the H200 5.05e-7 max error / max |ref|, the same as Triton's tf32x3, against
    torch's fp32 5.99e-7. An infinite input's small part is inf - inf = NaN: those small
    sums are dropped, so infinities pass as in fp32."""
    if INPUT_PRECISION == "tf32x3":
        a_big, a_small = tf32_split(a)
        b_big, b_small = tf32_split(b)
        small = tl.dot(a_small, b_big, input_precision="tf32")
        small = tl.dot(a_big, b_small, small, input_precision="tf32")
        small = tl.where(small == small, small, 0.0)
        # This block's products start from zero in the tensor cores and join ``acc`` by an
        # fp32 add, as in Triton's own tf32x3: accumulating into ``acc`` inside the tensor
        # cores (with a truncating split) measures 3.1e-6 in the case above.
        acc += tl.dot(a_big, b_big, small, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
    return acc


#: Whether these kernels run in Triton's interpreter (decided when Triton decorated them,
#: so this module's own function answers): there ``tf32_round`` runs its integer emulation
#: (no inline assembly) and bfloat16 conversions go through their bits.
INTERPRETED = tl.constexpr(is_interpreted(tf32_split))
NATIVE_TF32_ROUND = tl.constexpr(not INTERPRETED.value)
