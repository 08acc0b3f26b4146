"""Every registered elementwise kernel against its PyTorch reference in float64.

Parametrised from the registry: a new entry is tested here without new code.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DEVICE
from helpers import one_at_a_time, rand, slow_unless, two_at_a_time, value_id, views

import fusedkit
from fusedkit.runtime import configs
from fusedkit.runtime import elementwise as ew
from fusedkit.testing import assert_matches_reference, poisoned, reference_result

KERNELS = list(fusedkit.registry.kernels())
CASES = [(k, d) for k in KERNELS for d in k.dtypes]
IDS = [f"{k.name}-{str(d).removeprefix('torch.')}" for k, d in CASES]
#: The representative op and dtype of the layout tests' quick subset: the flagship op, which
#: takes every dtype and a scalar parameter (docs/design.md, "The test grid").
REP = ("add_relu", "float32")


def run_and_check(kernel, operands, param=None, out=None, dtype=None):
    """Run ``kernel`` into a NaN-poisoned output and compare with the float64 reference."""
    kwargs = {} if param is None or kernel.param is None else {kernel.param: param}
    result = fusedkit.elementwise(kernel, *operands, out=out, **kwargs)
    expected = reference_result(kernel, operands, param)
    assert result.shape == expected.shape
    assert_matches_reference(result, expected, dtype or result.dtype)
    return result


def operands_for(kernel, tensors):
    return tuple(tensors[: kernel.arity]) + tuple(tensors[0] for _ in range(kernel.arity - len(tensors)))


def test_kernels_run_here():
    """CI must exercise the Triton kernels, not the PyTorch fallback."""
    assert fusedkit.backend_for(DEVICE) in ("triton", "interpreter")


SHAPES = [(), (0,), (1,), (7,), (1000,), (4097,), (3, 0, 5), (37, 53), (2, 3, 4, 5)]


# For the shapes; quick: every op in every dtype at (37, 53), and every shape with REP.
@pytest.mark.parametrize(
    "kernel,dtype,shape",
    slow_unless(
        lambda k, d, shape: shape == (37, 53) or (k.name, value_id(d)) == REP,
        [(k, d, s) for k, d in CASES for s in SHAPES],
    ),
)
def test_contiguous(kernel, dtype, shape):
    ops = [rand(shape, dtype, DEVICE) for _ in range(kernel.arity)]
    out = poisoned(shape, dtype, DEVICE)
    result = run_and_check(kernel, ops, out=out)
    assert result is out
    fresh = run_and_check(kernel, ops)
    assert fresh.is_contiguous() and fresh.dtype == dtype and fresh.device.type == DEVICE.type


BROADCASTS = [
    ((37, 53), (53,)),
    ((37, 1), (1, 53)),
    ((5, 1, 7), (4, 1)),
    ((), (6, 7)),
    ((3, 4, 5), (1, 4, 1)),
    ((2, 1, 3, 1, 5), (4, 1, 6, 1)),
]


# For the broadcast patterns; quick: each pattern with REP; each op (float32) and dtype (add_relu) on a
# bias; slow: the pairs of axes (helpers.two_at_a_time says why not the whole cube).
@pytest.mark.parametrize(
    "kernel,dtype,shapes", two_at_a_time([(*c, s) for c in CASES for s in BROADCASTS], (*REP, BROADCASTS[0]))
)
def test_broadcast(kernel, dtype, shapes):
    a, b = (rand(s, dtype, DEVICE) for s in shapes)
    for ops in ((a, b), (b, a)):
        run_and_check(kernel, operands_for(kernel, ops))


VIEWS = ["transposed", "row_sliced", "col_strided", "offset", "expanded_row", "expanded_col"]


# For the view kinds; quick: each view with REP; each op (float32) and dtype (add_relu) on a transposed
# view; slow: the pairs of axes, as for the broadcasts.
@pytest.mark.parametrize(
    "kernel,dtype,view", two_at_a_time([(*c, v) for c in CASES for v in VIEWS], (*REP, "transposed"))
)
def test_strided_views(kernel, dtype, view):
    shape = (67, 45)
    v = views(shape, dtype, DEVICE)[view]
    dense = rand(shape, dtype, DEVICE)
    run_and_check(kernel, operands_for(kernel, (v, dense)))
    run_and_check(kernel, operands_for(kernel, (dense, v)))
    run_and_check(kernel, operands_for(kernel, (v, v)))


# For the permuted layouts in its body; quick: REP alone; slow: each op in float32 and each dtype
# with add_relu (the layouts are indexing every op shares; a dtype reaches it by its size alone).
@pytest.mark.parametrize(
    "kernel,dtype",
    slow_unless(
        lambda k, d: (k.name, value_id(d)) == REP,
        [(k, d) for k, d in CASES if k.name == REP[0] or value_id(d) == REP[1]],
        ids=[i for (k, d), i in zip(CASES, IDS) if k.name == REP[0] or value_id(d) == REP[1]],
    ),
)
def test_high_rank_permuted(kernel, dtype):
    """Permuted 4-D and 6-D views that no dims collapse in."""
    a = rand((3, 4, 5, 6), dtype, DEVICE).permute(2, 0, 3, 1)
    b = rand((5, 3, 6, 4), dtype, DEVICE)
    run_and_check(kernel, operands_for(kernel, (a, b)))
    c = rand((2, 3, 2, 3, 2, 3), dtype, DEVICE).permute(5, 3, 1, 0, 2, 4)
    d = rand((3, 3, 3, 2, 2, 2), dtype, DEVICE)[:, :, :, :, :, :1]
    run_and_check(kernel, operands_for(kernel, (c, d)))


# For the alphas and the scalar operands; quick: each alpha with REP; each op (float32) and dtype
# (add_relu) at alpha 3, an integer, which integer results take too.
@pytest.mark.parametrize(
    "kernel,dtype,alpha", one_at_a_time([(*c, a) for c in CASES for a in [1, 0, -1, 3, 2.5, -0.75]], (*REP, 3))
)
def test_scalars_and_alpha(kernel, dtype, alpha):
    if kernel.param is None:
        pytest.skip(f"{kernel.name} has no scalar parameter")
    if not dtype.is_floating_point and isinstance(alpha, float):
        pytest.skip("integer results take integer alpha (a float alpha is tested as an error)")
    x = rand((33, 17), dtype, DEVICE)
    scalar = 2 if not dtype.is_floating_point else 1.3
    for ops in (
        (x, scalar),
        (scalar, x),
        (x, torch.tensor(scalar, dtype=dtype)),
        (torch.tensor(-scalar, dtype=dtype, device=DEVICE), x),
    ):
        run_and_check(kernel, operands_for(kernel, ops), param=alpha, dtype=dtype)


def test_float64_scalar_keeps_double_precision():
    x = rand((64,), torch.float64, DEVICE)
    result = fusedkit.add(x, 0.1, alpha=1 / 3)
    # fp32 rounding of the scalar would err by ~1e-9; a GPU fma by at most an ulp (2e-16).
    torch.testing.assert_close(result.cpu(), x.cpu() + (1 / 3) * 0.1, rtol=1e-15, atol=0)


MIXED = [
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float16),
    (torch.int32, torch.float16),
    (torch.int32, torch.int64),
    (torch.float64, torch.bfloat16),
    (torch.int64, torch.float32),
]


MIXED_CASES = [(k, d) for k in KERNELS for d in MIXED if all(x in k.dtypes for x in d)]


# For the dtype pairs; quick: each pair with add_relu, and each op with float16 and float32.
@pytest.mark.parametrize(
    "kernel,dtypes",
    one_at_a_time(MIXED_CASES, ("add_relu", MIXED[0]), ids=[f"{k.name}-{d}" for k, d in MIXED_CASES]),
)
def test_mixed_dtypes(kernel, dtypes):
    ops = [rand((19, 23), d, DEVICE) for d in dtypes]
    result = run_and_check(kernel, operands_for(kernel, ops))
    assert result.dtype == torch.result_type(ops[0], ops[1])
    # Python scalars promote like torch: an int tensor and a float scalar give float32.
    r2 = run_and_check(kernel, operands_for(kernel, (ops[0], 0.5)))
    assert r2.dtype == torch.result_type(ops[0], 0.5)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_integer_and_half_operands_round_like_torch(kernel, half):
    """torch casts an int operand to the half result dtype before computing: 2049 -> 2048 in fp16."""
    if half not in kernel.dtypes or torch.int32 not in kernel.dtypes:
        pytest.skip(f"{kernel.name} does not take int32 and {half} operands")
    ints = torch.tensor([2049, 70000, -4097, 255, 3], dtype=torch.int32, device=DEVICE)
    halves = torch.tensor([1.0, -60000.0, 0.5, -0.25, 2.0], dtype=half, device=DEVICE)
    ours = fusedkit.elementwise(kernel, *operands_for(kernel, (ints, halves)))
    theirs = kernel.reference(ints.cpu(), halves.cpu(), *((kernel.param_default,) if kernel.param else ()))
    assert ours.dtype == theirs.dtype == half
    assert torch.equal(ours.cpu(), theirs)


#: 1e13 and 1e20: finite, but their cubes (gelu_tanh's) and squares overflow float32.
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.5, -2.25, 1e13, -1e13, 1e20]


@pytest.mark.parametrize(
    "kernel,dtype",
    [c for c in CASES if c[1].is_floating_point],
    ids=[i for c, i in zip(CASES, IDS) if c[1].is_floating_point],
)
def test_special_values(kernel, dtype):
    pairs = list(itertools.product(SPECIALS, repeat=2))
    x = torch.tensor([p[0] for p in pairs], dtype=dtype, device=DEVICE)
    y = torch.tensor([p[1] for p in pairs], dtype=dtype, device=DEVICE)
    run_and_check(kernel, operands_for(kernel, (x, y)))
    run_and_check(kernel, operands_for(kernel, (x, -0.0)))


# For the out= layouts and in-place runs in its body; quick: each op in float32, add_relu in each dtype.
@pytest.mark.parametrize("kernel,dtype", one_at_a_time(CASES, REP, ids=IDS))
def test_out_layouts_and_aliasing(kernel, dtype):
    shape = (29, 41)
    x, y = rand(shape, dtype, DEVICE), rand(shape, dtype, DEVICE)
    ops = operands_for(kernel, (x, y))
    expected = reference_result(kernel, ops)
    # A transposed out.
    out_t = poisoned((shape[1], shape[0]), dtype, DEVICE).t()
    assert_matches_reference(fusedkit.elementwise(kernel, *ops, out=out_t), expected, dtype)
    # A slice of a larger buffer: elements outside the slice stay untouched.
    buf = poisoned((shape[0] + 2, shape[1] * 2), dtype, DEVICE)
    sentinel = rand(buf.shape, dtype, DEVICE)
    buf.copy_(sentinel)
    view = buf[1:-1, ::2]
    fusedkit.elementwise(kernel, *ops, out=view)
    assert_matches_reference(view, expected, dtype)
    keep = torch.ones(buf.shape, dtype=torch.bool, device=DEVICE)
    keep[1:-1, ::2] = False
    assert torch.equal(buf[keep], sentinel[keep])
    # In place into each input.
    for k in range(kernel.arity):
        inputs = [t.clone() for t in ops]
        expected_k = reference_result(kernel, inputs)
        result = fusedkit.elementwise(kernel, *inputs, out=inputs[k])
        assert result is inputs[k]
        assert_matches_reference(result, expected_k, dtype)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_in_place_on_broadcast_and_transposed_views(kernel):
    x = rand((40, 30), torch.float32, DEVICE)
    bias = rand((30,), torch.float32, DEVICE)
    expected = reference_result(kernel, operands_for(kernel, (x, bias)))
    assert fusedkit.elementwise(kernel, *operands_for(kernel, (x, bias)), out=x) is x
    assert_matches_reference(x, expected)
    xt = rand((30, 40), torch.float32, DEVICE).t()
    expected = reference_result(kernel, operands_for(kernel, (xt, xt)))
    fusedkit.elementwise(kernel, *operands_for(kernel, (xt, xt)), out=xt)
    assert_matches_reference(xt, expected)


def test_result_layout_follows_shared_input_layout():
    a = rand((20, 30), torch.float32, DEVICE).t()
    b = rand((20, 30), torch.float32, DEVICE).t()
    assert fusedkit.add(a, b).stride() == torch.add(a, b).stride() == a.stride()
    # Mixed layouts: the first operand that orders the dims decides, as in TensorIterator.
    assert fusedkit.add(a, b.contiguous()).stride() == torch.add(a, b.contiguous()).stride() == a.stride()
    assert fusedkit.add(b.contiguous(), a).is_contiguous()


def test_integer_results_are_exact_and_wrap_like_torch():
    info = torch.iinfo(torch.int32)
    x = torch.tensor([info.max, info.min, 5, -7], dtype=torch.int32, device=DEVICE)
    y = torch.tensor([1, -1, 3, 2], dtype=torch.int32, device=DEVICE)
    for fn, ref in (
        (fusedkit.add, lambda a, b: torch.add(a, b, alpha=3)),
        (fusedkit.add_relu, lambda a, b: torch.relu(torch.add(a, b, alpha=3))),
    ):
        assert torch.equal(fn(x, y, alpha=3).cpu(), ref(x.cpu(), y.cpu()))


def test_inputs_are_read_in_place_not_copied():
    """The launch receives the caller's tensors themselves: no hidden .contiguous() or expand copy."""
    x = rand((50, 40), torch.float32, DEVICE).t()
    bias = rand((50,), torch.float32, DEVICE)
    out = torch.empty(40, 50, device=DEVICE)
    _, args, _ = ew.launch_config(fusedkit.registry.get("add_relu"), (x, bias), 1, out)
    assert args[0] is out and args[1] is x and args[2] is bias


def test_backend_for():
    assert fusedkit.backend_for(torch.device("meta")) == "torch"
    expected = "interpreter" if ew.INTERPRETED else "triton"
    if torch.cuda.is_available():
        assert fusedkit.backend_for(torch.zeros(1, device="cuda")) == expected
    assert fusedkit.backend_for("cpu") == ("interpreter" if ew.INTERPRETED else "torch")


def test_inputs_requiring_grad_run_under_no_grad():
    x = rand((8, 9), torch.float32, DEVICE).requires_grad_()
    with torch.no_grad():
        result = fusedkit.add_relu(x, 1.0)
    assert result.grad_fn is None and not result.requires_grad
    assert_matches_reference(result, torch.relu(x.detach().double().cpu() + 1.0))


def test_meta_tensors_take_the_reference_path():
    x = torch.empty(3, 4, device="meta")
    assert fusedkit.add_relu(x, x).shape == (3, 4)


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 3 * 1024 + 7])
def test_block_boundaries(n):
    x, y = rand((n,), torch.float32, DEVICE), rand((n,), torch.float32, DEVICE)
    run_and_check(fusedkit.registry.get("add_relu"), (x, y))
    r, c = n, 3
    run_and_check(
        fusedkit.registry.get("add_relu"),
        (rand((r, c), torch.float32, DEVICE).t(), rand((c, r), torch.float32, DEVICE)),
    )


@pytest.mark.parametrize("case", ["bias", "batched"])
def test_every_tile_of_a_grid_of_several_tile_columns(case):
    # Program ids map to (tile row, tile column) by a multiply with the host's division
    # constant (layout.division_magic): 3 tile columns of 1024 (the last partial; not a power
    # of two, whose constant is a plain shift) over 19 tile rows, and the same behind a batch
    # dim that does not merge.
    cols = 2 * 1024 + 5
    if case == "bias":
        x, y = rand((37, cols), torch.float32, DEVICE), rand((cols,), torch.float32, DEVICE)
    else:
        x = rand((6, 10, 3 * cols), torch.float32, DEVICE)[::2, ::2, ::3]  # no two dims merge
        y = rand((3, 5, cols), torch.float32, DEVICE)
    run_and_check(fusedkit.registry.get("add_relu"), (x, y))


_NARROW = configs.BLOCK_1D_NARROW


@pytest.mark.parametrize("n", [_NARROW - 1, _NARROW, _NARROW + 1, 2 * _NARROW + 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_block_boundaries(n, dtype):
    # 1- and 2-byte results take configs.BLOCK_1D_NARROW elements a program; an fp32 out= of
    # a bf16 result keeps the result's block
    x, y = rand((n,), dtype, DEVICE), rand((n,), dtype, DEVICE)
    run_and_check(fusedkit.registry.get("add_relu"), (x, y))
    out = torch.full((n,), float("nan"), device=DEVICE)
    run_and_check(fusedkit.registry.get("silu_mul"), (x, y), out=out, dtype=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_more_than_2_pow_31_elements_bf16():
    n = 2**31 + 4099
    need = 3 * n * 2 + (1 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-4, 4)
    y = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-4, 4)
    out = torch.full_like(x, float("nan"))
    fusedkit.add_relu(x, y, out=out)
    for sl in (slice(0, 4096), slice(2**31 - 2048, 2**31 + 2048), slice(n - 4096, n)):
        assert torch.equal(out[sl], torch.relu(x[sl] + y[sl])), sl
    assert not out.isnan().any()
    del out
    torch.cuda.empty_cache()
    result = fusedkit.add(x, y)
    tail = slice(n - 4096, n)
    assert torch.equal(result[tail], x[tail] + y[tail])
