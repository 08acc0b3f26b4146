"""Host-side layout planning for the strided elementwise kernel.

Given the broadcast output shape and every operand's strides, the planner
1. gives broadcast dims stride 0 (an ``expand`` is never materialised),
2. drops size-1 dims and orders the rest by the output's strides, so the
   output's fastest dim is the tile's column axis,
3. merges neighbouring dims that are contiguous in *every* operand (a dense
   tensor of any rank becomes one row: the 1-D fast path),
4. picks the tile's row axis: the fastest dim of a transposed input if there is
   one (so its tile loads coalesce too), else the next dim,
5. chooses 32- or 64-bit offsets from the largest offset any program can form.

Everything here is plain Python on shapes and strides; it never touches data.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ShapeError
from .configs import TileConfig, cdiv, elementwise_tile

#: Leading dims that the kernel unravels per program, besides the 2-D tile plane.
MAX_BATCH_DIMS = 4
#: Largest offset that 32-bit index arithmetic can hold.
INT32_MAX = 2**31 - 1

Strides = tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """How one elementwise launch walks its operands.

    ``strides[k]`` holds operand ``k``'s (s0, s1, s2, s3, s_r, s_c) in elements,
    operand 0 being the output; ``None`` marks a scalar operand. Plans are cached,
    so everything a launch reads is computed once, here.
    """

    batch_sizes: tuple[int, int, int, int]
    size_r: int
    size_c: int
    strides: tuple[Strides | None, ...]
    tile: TileConfig
    int64: bool
    tiles_c: int = field(init=False)
    #: ``tiles_c`` encoded for the kernel's division by it (:func:`division_magic`).
    tiles_c_magic: int = field(init=False)
    tiles_c_shift: int = field(init=False)
    tiles_per_batch: int = field(init=False)
    #: More than one batch (some batch size above 1): the kernel then splits its program id.
    batched: bool = field(init=False)
    grid: int = field(init=False)
    #: Bit ``k`` set when operand ``k``'s row (column) stride is 1.
    unit_r_mask: int = field(init=False)
    unit_c_mask: int = field(init=False)

    def __post_init__(self) -> None:
        tiles_c = cdiv(self.size_c, self.tile.block_c)
        tiles_per_batch = cdiv(self.size_r, self.tile.block_r) * tiles_c
        magic, shift = division_magic(max(tiles_c, 1))  # (an empty plan launches nothing)
        derived = dict(
            tiles_c=tiles_c,
            tiles_c_magic=magic,
            tiles_c_shift=shift,
            tiles_per_batch=tiles_per_batch,
            batched=math.prod(self.batch_sizes) > 1,
            grid=math.prod(self.batch_sizes) * tiles_per_batch,
            unit_r_mask=sum(1 << k for k, s in enumerate(self.strides) if s is not None and s[-2] == 1),
            unit_c_mask=sum(1 << k for k, s in enumerate(self.strides) if s is not None and s[-1] == 1),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: set once, at construction


def division_magic(d: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``(n * magic) >> shift == n // d`` for every ``0 <= n < 2**31``:
    ``shift = 31 + ceil(log2(d))``, ``magic = ceil(2**shift / d)``. The rounding error
    ``e = magic * d - 2**shift`` is below ``d <= 2**(shift - 31)``, so ``n * e < 2**shift``
    and the quotient never rounds past ``n // d``. ``magic`` lies in ``[2**31, 2**32)``: one
    integer type (int64) for every divisor, and ``n * magic`` fits in 63 bits."""
    if d < 1:
        raise ValueError(f"division_magic(): the divisor must be positive, got {d}")
    shift = 31 + (d - 1).bit_length()
    return cdiv(1 << shift, d), shift


class TooManyDims(ShapeError):
    """A layout with more non-mergeable dims than the kernel walks: the launcher splits it."""


def output_strides(shape: Sequence[int], operands: Sequence[tuple[Sequence[int], Sequence[int]] | None]) -> Strides:
    """Strides of a new elementwise result, as PyTorch's TensorIterator chooses them.

    ``operands`` holds each operand's (shape, strides), None for a host number. When
    every operand has the result's shape and all are contiguous, all channels-last, or
    all dense with one set of strides, the result takes that layout; otherwise dims are
    ordered by the operands' strides (the first operand that orders two dims decides,
    broadcast dims abstain, equal strides put the smaller dim inner) and the result is
    dense in that order. So a channels-last operand beside a broadcast bias gives a
    channels-last result.
    """
    ndim = len(shape)
    if ndim == 0:
        return ()
    if 0 in shape:
        return _contiguous(shape)  # an empty result: torch gives it contiguous strides
    tensors = [op for op in operands if op is not None]
    if len(tensors) == len(operands) and all(tuple(s) == tuple(shape) for s, _ in tensors):
        first = tuple(tensors[0][1])
        if all(_is_contiguous(shape, st) for _, st in tensors):
            return _contiguous(shape)
        if ndim == 4 and all(_is_contiguous(*_nhwc(shape, st)) for _, st in tensors):
            return _from_nhwc(_contiguous(_nhwc(shape, shape)[0]))
        if all(tuple(st) == first for _, st in tensors) and is_dense_permutation(shape, first):
            return first
    # Each operand's strides over the result's dims; 0 where it is broadcast.
    strides = []
    for s, st in tensors:
        pad = ndim - len(s)
        strides.append([0] * pad + [0 if n == 1 and shape[pad + i] != 1 else st[i] for i, n in enumerate(s)])

    def should_swap(d0: int, d1: int) -> int:
        for st in strides:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))  # innermost first
    for i in range(1, ndim):  # TensorIterator's insertion sort, ambiguous pairs left in place
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    if perm == list(range(ndim - 1, -1, -1)):
        return _contiguous(shape)
    result = [0] * ndim
    step = 1
    for d in perm:  # as TensorIterator's compatible strides: no floor at 1 for empty dims
        result[d] = step
        step *= shape[d]
    return tuple(result)


def _contiguous(shape: Sequence[int]) -> Strides:
    result, step = [], 1
    for n in reversed(shape):
        result.append(step)
        step *= max(n, 1)
    return tuple(reversed(result))


def _is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_contiguous()``: size-1 dims may have any stride."""
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 0:
            return True
        if n != 1:
            if s != expected:
                return False
            expected *= n
    return True


def _nhwc(shape, strides):
    """An NCHW shape and strides reordered as NHWC (channels last is contiguity in that order)."""
    order = (0, 2, 3, 1)
    return tuple(shape[d] for d in order), tuple(strides[d] for d in order)


def _from_nhwc(strides):
    n, h, w, c = strides
    return (n, c, h, w)


def broadcast_strides(shape: Sequence[int], strides: Sequence[int], out_shape: Sequence[int]) -> Strides:
    """Strides of ``shape`` expanded to ``out_shape``: broadcast dims get stride 0."""
    pad = len(out_shape) - len(shape)
    result = []
    for d in range(len(out_shape)):
        k = d - pad
        result.append(0 if k < 0 or shape[k] == 1 else strides[k])
    return tuple(result)


def is_dense_permutation(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the tensor covers its memory exactly once, in some dim order."""
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(shape, strides) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def may_self_overlap(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Conservative: False only when no two elements can share an address."""
    reach = 0
    for size, stride in sorted(((n, s) for n, s in zip(shape, strides) if n > 1), key=lambda p: p[1]):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def span_bytes(t) -> tuple[int, int]:
    """``[first, last)`` byte addresses a non-empty tensor can touch."""
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (reach + 1) * t.element_size()


def broadcast_shape(shapes: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
    """The broadcast of ``shapes``, or None when they do not broadcast.

    Plain Python: ``torch.broadcast_shapes`` runs its reference implementation, several
    times slower, and a small op's call is bound by its host time (docs/why-fusion.md).
    """
    first = shapes[0]
    if all(s == first for s in shapes):
        return tuple(first)
    rank = max(len(s) for s in shapes)
    result = [1] * rank
    for s in shapes:
        for i, n in enumerate(s, rank - len(s)):
            if n != 1:
                if result[i] not in (1, n):
                    return None
                result[i] = n
    # A 0-size dim broadcasts only against 0 or 1; the loop above already refused 0 vs n > 1.
    return tuple(result)


#: Distinct layouts kept planned; a model calls few shapes over and over.
PLAN_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_elementwise(
    out_shape: tuple[int, ...], operand_strides: tuple[Strides | None, ...], itemsize: int = 4
) -> Plan:
    """Plan a launch over ``out_shape``; ``operand_strides`` (output first) are already broadcast;
    ``itemsize``: the result's bytes an element (it sets the 1-D block).

    Pure function of its (hashable) arguments, so plans are cached.
    """
    tensors = [k for k, s in enumerate(operand_strides) if s is not None]
    dims = [d for d, n in enumerate(out_shape) if n != 1]
    # Output's slowest dim first, fastest last; the output never self-overlaps, so its
    # strides order the dims completely.
    dims.sort(key=lambda d: tuple(-operand_strides[k][d] for k in tensors))

    sizes: list[int] = []
    strides: dict[int, list[int]] = {k: [] for k in tensors}
    for d in dims:
        n = out_shape[d]
        if sizes and all(strides[k][-1] == operand_strides[k][d] * n for k in tensors):
            sizes[-1] *= n
            for k in tensors:
                strides[k][-1] = operand_strides[k][d]
            continue
        sizes.append(n)
        for k in tensors:
            strides[k].append(operand_strides[k][d])

    if not sizes:  # a single element
        sizes = [1]
        strides = {k: [0] for k in tensors}

    # Row axis: the fastest dim of an input that is not contiguous along the columns.
    row = len(sizes) - 2
    for k in tensors[1:]:
        if strides[k][-1] > 1:
            unit = [d for d in range(len(sizes) - 1) if strides[k][d] == 1]
            if unit:
                row = unit[0]
                break
    order = [d for d in range(len(sizes) - 1) if d != row] + ([row] if row >= 0 else []) + [len(sizes) - 1]
    sizes = [sizes[d] for d in order]
    strides = {k: [v[d] for d in order] for k, v in strides.items()}
    if len(sizes) == 1:
        sizes.insert(0, 1)
        for v in strides.values():
            v.insert(0, 0)

    n_batch = len(sizes) - 2
    if n_batch > MAX_BATCH_DIMS:
        raise TooManyDims(
            f"one launch walks at most {MAX_BATCH_DIMS + 2} non-mergeable dims; this one needs "
            f"{len(sizes)} (shape {tuple(out_shape)} with these strides)"
        )
    pad = MAX_BATCH_DIMS - n_batch
    batch_sizes = (1,) * pad + tuple(sizes[:n_batch])
    size_r, size_c = sizes[-2], sizes[-1]

    transposed = any(strides[k][-2] == 1 and strides[k][-1] > 1 for k in tensors)
    tile = elementwise_tile(size_r, size_c, transposed, itemsize)

    packed: list[Strides | None] = []
    int64 = cdiv(size_c, tile.block_c) * tile.block_c > INT32_MAX
    padded = (*batch_sizes, cdiv(size_r, tile.block_r) * tile.block_r, cdiv(size_c, tile.block_c) * tile.block_c)
    for k, s in enumerate(operand_strides):
        if s is None:
            packed.append(None)
            continue
        full = (0,) * pad + tuple(strides[k])
        packed.append(full)
        if sum((n - 1) * st for n, st in zip(padded, full)) > INT32_MAX:
            int64 = True
    return Plan(batch_sizes, size_r, size_c, tuple(packed), tile, int64)
