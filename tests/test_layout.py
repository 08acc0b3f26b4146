"""Host-side layout planning: broadcast, dim collapse, tile axes, 32/64-bit choice."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusedkit.runtime.layout import (
    INT32_MAX,
    broadcast_shape,
    broadcast_strides,
    division_magic,
    is_dense_permutation,
    may_self_overlap,
    plan_elementwise,
)


def test_broadcast_shape_agrees_with_torch():
    sizes = [0, 1, 2, 3]
    shapes = [s for r in range(4) for s in itertools.product(sizes, repeat=r)]
    for a, b in itertools.product(shapes, repeat=2):
        try:
            expected = tuple(torch.broadcast_shapes(a, b))
        except RuntimeError:
            expected = None
        assert broadcast_shape([a, b]) == expected, (a, b)


def plan_for(*tensors, out=None):
    out = out if out is not None else torch.empty(torch.broadcast_shapes(*(t.shape for t in tensors)))
    strides = (tuple(out.stride()),) + tuple(broadcast_strides(t.shape, t.stride(), out.shape) for t in tensors)
    return plan_elementwise(tuple(out.shape), strides)


def test_dense_tensors_of_any_rank_collapse_to_one_row():
    x = torch.empty(2, 3, 4, 5)
    plan = plan_for(x, x)
    assert (plan.size_r, plan.size_c, plan.batch_sizes) == (1, 120, (1, 1, 1, 1))
    assert plan.tile.block_r == 1 and plan.unit_c_mask == 0b111
    xt = torch.empty(5, 4).t()
    plan = plan_for(xt, xt, out=torch.empty(5, 4).t())
    assert (plan.size_r, plan.size_c) == (1, 20)


def test_bias_keeps_stride_zero_rows():
    plan = plan_for(torch.empty(64, 32), torch.empty(32))
    assert (plan.size_r, plan.size_c) == (64, 32)
    assert plan.strides[2][-2:] == (0, 1)


def test_transposed_input_takes_the_row_axis_and_a_square_tile():
    plan = plan_for(torch.empty(300, 200).t(), torch.empty(200, 300))
    assert (plan.size_r, plan.size_c) == (200, 300)
    assert plan.strides[1][-2:] == (1, 200)
    assert plan.unit_r_mask == 0b010 and plan.tile.block_r == plan.tile.block_c


def test_int64_only_when_offsets_need_it():
    assert not plan_for(torch.empty(1 << 20, device="meta")).int64
    big = torch.empty(2**31 + 5, device="meta")
    assert plan_for(big).int64
    far = torch.empty(3, 2**30 + 64, device="meta")[:, ::2]
    assert far.numel() < INT32_MAX and plan_for(far, out=torch.empty(far.shape, device="meta")).int64


def test_too_many_uncollapsible_dims_is_a_clear_error():
    x = torch.empty([2] * 7).permute(6, 4, 2, 0, 5, 3, 1)
    with pytest.raises(ValueError, match="non-mergeable dims"):
        plan_for(x, torch.empty([2] * 7))


@pytest.mark.parametrize(
    "shape,strides,dense,overlap",
    [
        ((2, 3), (3, 1), True, False),
        ((2, 3), (1, 2), True, False),
        ((2, 3), (4, 1), False, False),
        ((2, 3), (0, 1), False, True),
        ((2, 3), (1, 1), False, True),
        ((4, 1), (1, 0), True, False),
    ],
)
def test_dense_and_overlap_predicates(shape, strides, dense, overlap):
    assert is_dense_permutation(shape, strides) == dense
    assert may_self_overlap(shape, strides) == overlap


_PIDS = st.integers(0, 2**31 - 1)


@given(d=st.integers(1, 2**31 - 1), n=_PIDS)
def test_division_magic_divides_every_program_id(d, n):
    magic, shift = division_magic(d)
    assert 2**31 <= magic < 2**32  # always an int64 launch argument; n * magic < 2**63
    for k in (n, n // d * d, n // d * d - 1, 2**31 - 1, d, d - 1):
        if 0 <= k < 2**31:
            assert (k * magic) >> shift == k // d, (d, k)


@pytest.mark.parametrize("d", [1, 2, 3, 7, 1000, 2**16 + 1, 2**30, 2**30 + 1, 2**31 - 1])
def test_division_magic_at_the_largest_program_ids(d):
    magic, shift = division_magic(d)
    top = 2**31 - 1
    near = [k for q in (top // d, top // d - 1) for k in (q * d - 1, q * d, q * d + 1)]
    for k in [*range(top - 64, top + 1), *near]:
        if 0 <= k <= top:
            assert (k * magic) >> shift == k // d, (d, k)


def test_division_magic_refuses_a_zero_divisor():
    with pytest.raises(ValueError, match="positive"):
        division_magic(0)


def test_only_batched_plans_split_the_program_id_by_batch():
    assert not plan_for(torch.empty(64, 32), torch.empty(32)).batched
    x = torch.empty(12, 10, 12)[::2, ::2, ::3]  # three dims that do not merge: a batch of 6
    plan = plan_for(x, x, out=torch.empty(x.shape))
    assert plan.batched and plan.batch_sizes == (1, 1, 1, 6)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 3)])
def test_empty_shapes_plan_an_empty_grid(shape):
    x = torch.empty(shape)
    assert plan_for(x, x).grid == 0
