"""Differential fuzzing against PyTorch: random shapes, broadcasts, views, dtypes,
scalars, alpha, special values and ``out=``, ``FUSEDKIT_FUZZ_EXAMPLES`` examples
for each registered binary kernel and for the matmul (60 in CI; the GPU script's
``fuzz`` stage runs 2,000, split over ``FUSEDKIT_FUZZ_SHARDS`` tests per op)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import DEVICE
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import fusedkit
from fusedkit.settings import override as settings_override
from fusedkit.testing import assert_matches_reference, poisoned, reference_result

pytestmark = pytest.mark.slow  # hypothesis runs many examples

EXAMPLES = int(os.environ.get("FUSEDKIT_FUZZ_EXAMPLES", "60"))
#: Tests each op's examples are split over, each drawing its own (seeded by its shard), so
#: pytest-xdist runs them in parallel. On a GPU most of the fuzz's time is compiling: at
#: 2,000 examples an elementwise op meets about 450 distinct kernel specialisations
#: (dtypes, alignment, unit and 16-divisible sizes and strides; counted on the CPU).
SHARDS = int(os.environ.get("FUSEDKIT_FUZZ_SHARDS", "1"))
BINARY = [k for k in fusedkit.registry.kernels() if k.arity == 2]


@st.composite
def operand(draw, shape, dtype):
    """A tensor that reads as ``shape``: maybe broadcast, transposed, sliced or offset."""
    # Broadcast: drop leading dims and set some dims to 1.
    rank = draw(st.integers(0, len(shape)))
    own = [1 if draw(st.booleans()) and draw(st.booleans()) else n for n in shape[len(shape) - rank :]]
    steps = [draw(st.sampled_from([1, 1, 2, 3])) for _ in own]
    offset = draw(st.integers(0, 3))
    base_shape = [n * s for n, s in zip(own, steps)]
    numel = 1
    for n in base_shape:
        numel *= n
    flat = _rand(numel + offset, dtype, draw(SEEDS), specials=draw(st.booleans()) and draw(st.booleans()))
    t = flat[offset:].view(base_shape) if base_shape else flat[offset : offset + 1].view(())
    t = t[tuple(slice(None, None, s) for s in steps)] if steps else t
    if t.dim() >= 2 and draw(st.booleans()):
        perm = draw(st.permutations(range(t.dim())))
        t = t.permute(*perm).contiguous().permute(*[perm.index(i) for i in range(t.dim())])
    return t


#: Values that must survive: NaN, both infinities and a negative zero.
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0)


def _rand(n, dtype, seed: int, specials: bool = False):
    """``n`` random values from ``seed`` (a value Hypothesis drew, so a replayed example
    gets the same tensors: Hypothesis replays draws, not PyTorch's generator)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(n, device=DEVICE, generator=gen) * 3).to(dtype)
        if specials and n:
            idx = torch.randint(0, n, (min(n, 4),), device=DEVICE, generator=gen)
            t[idx] = torch.tensor(SPECIALS[: len(idx)], device=DEVICE, dtype=dtype)
        return t
    return torch.randint(1, 40, (n,), device=DEVICE, dtype=dtype, generator=gen)


SEEDS = st.integers(0, 2**31 - 1)


@st.composite
def case(draw, kernel):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=6)))
    dx, dy = draw(st.sampled_from(kernel.dtypes)), draw(st.sampled_from(kernel.dtypes))
    x = draw(operand(shape, dx))
    y = draw(operand(shape, dy))
    scalar = draw(st.sampled_from([None, "x", "y"]))
    if scalar == "x":
        x = draw(st.sampled_from([2, -3, 1.5, -0.25]))
    elif scalar == "y":
        y = draw(st.sampled_from([2, -3, 1.5, -0.25]))
    dtype = torch.result_type(x, y)
    alpha = draw(st.sampled_from([1, 2, -1] + ([0.5, -1.25] if dtype.is_floating_point else [])))
    use_out = draw(st.sampled_from(["none", "none", "fresh", "transposed", "inplace"]))
    return kernel, x, y, alpha, use_out


def _fuzz(strategy, check, shard: int, record_property) -> None:
    """``check`` on this shard's share of ``EXAMPLES`` draws of ``strategy``; the shard
    seeds the draws, so a run is repeatable and no two shards draw alike. The number of
    examples run goes to the JUnit report (``--junitxml``) as the ``examples`` property.
    Shares round up, so the shards together run at least ``EXAMPLES`` (12 shards of 2,000
    rounded down ran 1,992 on the H200, 2026-12-03)."""
    share = settings(
        max_examples=max(1, -(-EXAMPLES // SHARDS)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    runs = []

    def counted(args):
        runs.append(1)
        check(args)

    seed(shard)(share(given(strategy)(counted)))()
    record_property("examples", len(runs))


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("kernel", BINARY, ids=lambda k: k.name)
def test_matches_torch(kernel, shard, record_property):
    _fuzz(case(kernel), _check_elementwise, shard, record_property)


def _check_elementwise(args):
    kernel, x, y, alpha, use_out = args
    if kernel.param is None:
        alpha = None
    expected = reference_result(kernel, (x, y), alpha)
    param = {} if kernel.param is None else {kernel.param: alpha}
    dtype = torch.result_type(x, y)
    out = None
    if use_out == "fresh":
        out = poisoned(expected.shape, dtype, DEVICE)
    elif use_out == "transposed" and expected.dim() >= 2:
        out = poisoned(expected.shape[::-1], dtype, DEVICE).permute(*reversed(range(expected.dim())))
    elif (
        use_out == "inplace"
        and isinstance(x, torch.Tensor)
        and x.shape == expected.shape
        and x.dtype == dtype
        and not _self_overlapping(x)
    ):
        out = x  # in place, as a residual join does
    if out is None:
        first = fusedkit.elementwise(kernel, x, y, **param)
        result = fusedkit.elementwise(kernel, x, y, **param)  # the same signature again: the fast path
        assert_matches_reference(first, expected, dtype)
    else:
        result = fusedkit.elementwise(kernel, x, y, **param, out=out)
        assert result is out
    assert result.shape == expected.shape and result.dtype == dtype
    assert_matches_reference(result, expected, dtype)


def _self_overlapping(t: torch.Tensor) -> bool:
    from fusedkit.runtime.layout import may_self_overlap

    return may_self_overlap(t.shape, t.stride())


MATMUL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
MATMUL_ACTS = [None, "relu", "gelu", "gelu_tanh", "silu"]


@st.composite
def matmul_case(draw):
    m, n, k = (draw(st.integers(0, 70)) for _ in range(3))
    dtype = draw(st.sampled_from(MATMUL_DTYPES))
    seed = draw(SEEDS)
    a = (
        _rand(m * k * 2, dtype, seed).view(m, 2 * k)[:, ::2]
        if draw(st.booleans())
        else _rand(m * k, dtype, seed).view(m, k)
    )
    b = (
        _rand(n * k, dtype, seed + 1).view(n, k).t()
        if draw(st.booleans())
        else _rand(k * n, dtype, seed + 1).view(k, n)
    )
    bias = _rand(n, dtype, seed + 2) if draw(st.booleans()) else None
    if draw(st.booleans()) and m % 2 == 0:
        a = a.view(2, m // 2, k) if a.is_contiguous() else a.unflatten(0, (2, m // 2))  # batched (..., M, K)
    kernel = draw(st.sampled_from(["pointer", "tma"]))
    split = draw(st.sampled_from([1, 2, 3])) if kernel == "pointer" else 1  # split-K: the pointer kernel's
    return a, b, bias, draw(st.sampled_from(MATMUL_ACTS)), kernel, split


@contextlib.contextmanager
def _split_k(split: int):
    """The untuned tile (GPU) and the interpreter's tile split ``split`` ways over K, with
    no kept call plans (a plan records the split it was made with)."""
    from fusedkit.runtime import matmul as mm

    saved = mm.MATMUL_FIXED_TILE, mm.MATMUL_INTERPRETER_TILE
    if split > 1:
        mm.MATMUL_FIXED_TILE = dict(mm.MATMUL_FIXED_TILE, SPLIT_K=split)
        mm.MATMUL_INTERPRETER_TILE = dict(mm.MATMUL_INTERPRETER_TILE, SPLIT_K=split)
        fusedkit.clear_caches()
    try:
        yield
    finally:
        mm.MATMUL_FIXED_TILE, mm.MATMUL_INTERPRETER_TILE = saved
        if split > 1:
            fusedkit.clear_caches()


@pytest.mark.parametrize("shard", range(SHARDS))
def test_matmul_matches_torch(shard, record_property):
    _fuzz(matmul_case(), _check_matmul, shard, record_property)


def _check_matmul(args):
    from fusedkit.runtime.matmul import matmul_reference
    from fusedkit.testing import assert_rel_err, matmul_error_floor, matmul_rel_err

    a, b, bias, activation, kernel, split = args
    # every random shape would otherwise be tuned afresh; both kernels are drawn
    with settings_override(autotune=False, matmul_kernel=kernel), _split_k(split):
        out = fusedkit.matmul(a, b, bias, activation)
        if split > 1 and out.numel() and a.shape[-1]:
            from fusedkit.runtime import matmul as mm

            plans = [r.plan.split_k for r in mm.KEPT.values()]
            assert plans == [split], f"the call was planned with split-K {plans}, not {split}"
    wide = [None if t is None else t.double().cpu() for t in (a, b, bias)]
    expected = matmul_reference(*wide, activation)
    assert out.shape == expected.shape and out.dtype == a.dtype
    # Results an activation sends far below their products' size are held to an absolute
    # error on that scale (two examples the H200 fuzz found are regular tests in test_matmul).
    assert_rel_err(out, expected, matmul_rel_err(a.dtype), floor=matmul_error_floor(a, b, bias))
