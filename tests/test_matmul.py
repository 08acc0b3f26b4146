"""matmul / matmul_relu / linear_relu / nn.LinearReLU against float64 PyTorch."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE
from helpers import rand, slow_unless

import fusedkit
from fusedkit.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from fusedkit.kernels import helpers
from fusedkit.runtime import matmul as mm
from fusedkit.runtime.configs import matmul_configs, prune_matmul_configs
from fusedkit.runtime.matmul import ACTIVATION_NAMES, MATMUL_DTYPES, launch_matmul, matmul_reference
from fusedkit.testing import assert_rel_err, matmul_rel_err, poisoned

# Autotuning every odd test shape and variant on a GPU would compile hundreds of
# kernels; the suite uses the fixed config, and test_autotuned_path covers tuning.
pytestmark = pytest.mark.usefixtures("fixed_matmul_config")


@pytest.fixture
def fixed_matmul_config(fk_settings, monkeypatch, request):
    fk_settings(autotune="autotuned" in request.node.name)


#: The kernels the autouse fixture runs every test with. Where the operands are no TMA
#: layout (float64; a row of a, b or the output not a multiple of 16 bytes) the TMA setting
#: runs the pointer kernel again: such tests parametrise ``matmul_kernel`` themselves
#: (``indirect``) with their TMA runs slow (docs/design.md, "The test grid").
MATMUL_KERNELS = ["pointer", "tma"]


@pytest.fixture(autouse=True, params=MATMUL_KERNELS)
def matmul_kernel(fk_settings, monkeypatch, request):
    """Every test runs both kernels (the TMA one where the operands allow it)."""
    fk_settings(matmul_kernel=request.param)
    return request.param


ACTS = [None, *ACTIVATION_NAMES]


def ref64(a, b, bias=None, activation=None):
    wide = lambda t: None if t is None else t.detach().to("cpu", torch.float64)
    return matmul_reference(wide(a), wide(b), wide(bias), activation)


def mk(*shape, dtype=torch.float32):
    return rand(shape, dtype, DEVICE)


# For the activations and the dtypes; quick: each once with the pointer kernel (float32 and
# relu the representatives). K = 33 is no TMA layout in any dtype.
@pytest.mark.parametrize(
    "matmul_kernel,dtype,activation",
    slow_unless(
        lambda kernel, dtype, activation: kernel == "pointer" and (dtype == torch.float32 or activation == "relu"),
        [(k, d, a) for k in MATMUL_KERNELS for d in MATMUL_DTYPES for a in ACTS],
    ),
    indirect=["matmul_kernel"],
)
def test_every_activation_and_dtype(dtype, activation):
    a, b, bias = mk(70, 33, dtype=dtype), mk(33, 45, dtype=dtype), mk(45, dtype=dtype)
    for with_bias in (bias, None):
        out = fusedkit.matmul(a, b, with_bias, activation)
        assert out.dtype == dtype and out.shape == (70, 45)
        assert_rel_err(out, ref64(a, b, with_bias, activation), matmul_rel_err(dtype))


# For the sizes; quick: each with the pointer kernel, and (64, 64, 64), the one TMA takes, with both.
@pytest.mark.parametrize(
    "matmul_kernel,m,n,k",
    slow_unless(
        lambda kernel, *size: kernel == "pointer" or size == (64, 64, 64),
        [
            (kernel, *size)
            for kernel in MATMUL_KERNELS
            for size in [
                (1, 1, 1),
                (7, 129, 250),
                (129, 7, 33),
                (250, 250, 7),
                (1, 250, 129),
                (64, 64, 64),
                (33, 65, 97),
            ]
        ],
    ),
    indirect=["matmul_kernel"],
)
def test_odd_sizes(m, n, k):
    a, b, bias = mk(m, k), mk(k, n), mk(n)
    assert_rel_err(fusedkit.matmul_relu(a, b, bias), ref64(a, b, bias, "relu"), matmul_rel_err(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("block_m", [1, 4])
def test_multiply_and_sum_tiles(dtype, block_m, matmul_kernel):
    # The DOT=False tiles that exact fp32 / fp64 tune over at decode-sized M, launched
    # directly (autotuning picks them only on a GPU): ragged M, N and K, a K-major B.
    if matmul_kernel == "tma":
        pytest.skip("the multiply-and-sum tiles are the pointer kernel's")
    m, n, k = 3, 45, 70
    a, b, bias = mk(m, k, dtype=dtype), mk(n, k, dtype=dtype).t(), mk(n, dtype=dtype)
    out = poisoned((m, n), dtype, DEVICE)
    args, meta = mm.launch_config(a, b, bias, "relu", out)
    tile = dict(BLOCK_M=block_m, BLOCK_N=16, BLOCK_K=32, GROUP_M=8, DOT=False)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, tile["BLOCK_N"]),)
    mm.matmul_kernel[grid](*args, **meta, **tile, EVEN_K=k % tile["BLOCK_K"] == 0)
    assert_rel_err(out, ref64(a, b, bias, "relu"), matmul_rel_err(dtype))


def test_exact_fp32_tunes_the_multiply_and_sum_tiles_at_small_m():
    configs = matmul_configs()
    a32, a16 = torch.empty(1, 1, device="meta"), torch.empty(1, 1, device="meta", dtype=torch.bfloat16)

    def dot_flags(bucket, a, precision):
        return {
            c.kwargs["DOT"]
            for c in prune_matmul_configs(configs, {"M_BUCKET": bucket, "a_ptr": a}, INPUT_PRECISION=precision)
        }

    assert dot_flags(1, a32, "ieee") == {True, False}
    assert dot_flags(64, a32, "ieee") == {True, False}
    assert dot_flags(1, a32, "tf32") == {True}
    assert dot_flags(1, a32, "tf32x3") == {True, False}  # fp32's own math, no tl.dot
    assert dot_flags(1, a16, "ieee") == {True}
    assert dot_flags(128, a32, "ieee") == {True}

    def tall(bucket, a, precision):
        return sum(
            c.kwargs["BLOCK_M"] >= bucket and c.kwargs["SPLIT_K"] > 1
            for c in prune_matmul_configs(
                configs,
                {"M_BUCKET": bucket, "a_ptr": a, "ws_ptr": a, "c_ptr": None, "M": bucket, "N": 64},
                INPUT_PRECISION=precision,
            )
        )

    # Tall split FMA tiles only for exact fp32 / fp64 at M in 33..64.
    assert tall(64, a32, "ieee") > tall(64, a32, "tf32x3") == tall(64, a16, "ieee")


def test_tma_prune_drops_only_configs_that_overflow_shared_memory():
    from types import SimpleNamespace

    from fusedkit.runtime.configs import (
        HOPPER_SMEM_BYTES,
        TMA_FP32_TILES,
        matmul_tma_configs,
        prune_tma_configs,
        tma_stage_bytes,
        tma_tile_of,
    )

    configs = matmul_tma_configs()

    def kept(dtype):
        desc = SimpleNamespace(base=torch.empty(1, 1, device="meta", dtype=dtype))
        return prune_tma_configs(configs, {"a_desc": desc})

    def tiles(cs):
        return {tma_tile_of(c) for c in cs}

    half = kept(torch.bfloat16)  # every tile but fp32's own fits half-precision operands
    assert len(half) == len(configs) - len(TMA_FP32_TILES) and not tiles(half) & set(TMA_FP32_TILES)
    fp32 = kept(torch.float32)
    assert tiles(fp32) >= set(TMA_FP32_TILES) and len(fp32) < len(configs)
    assert all(tma_stage_bytes(c, 4) <= HOPPER_SMEM_BYTES for c in fp32)


def test_every_output_element_is_written():
    a, b, bias = mk(50, 40), mk(40, 70), mk(70)
    out = poisoned((50, 70), torch.float32, DEVICE)
    launch_matmul(a, b, bias, "relu", out)
    assert_rel_err(out, ref64(a, b, bias, "relu"), matmul_rel_err(torch.float32))


def test_strided_transposed_and_batched_operands():
    w = mk(45, 60)  # an nn.Linear weight (out, in)
    a = mk(3, 4, 60)
    out = fusedkit.matmul(a, w.t(), mk(45), "relu")
    assert out.shape == (3, 4, 45)
    bias = mk(45)
    assert_rel_err(
        fusedkit.matmul(a, w.t(), bias, "gelu"), ref64(a, w.t(), bias, "gelu"), matmul_rel_err(torch.float32)
    )
    big = mk(80, 130)
    a_strided = big[::2, 1:121:2]  # (40, 60), both strides > 1
    assert_rel_err(fusedkit.matmul(a_strided, w.t()), ref64(a_strided, w.t()), matmul_rel_err(torch.float32))
    a_t = mk(60, 40).t()
    b_t = mk(45, 60).t()
    assert_rel_err(fusedkit.matmul(a_t, b_t), ref64(a_t, b_t), matmul_rel_err(torch.float32))


def test_linear_weight_is_not_copied(monkeypatch):
    seen = []
    real = launch_matmul

    def spy(a, b, *rest, **kw):
        seen.append(b)
        return real(a, b, *rest, **kw)

    monkeypatch.setattr(mm, "launch_matmul", spy)
    w = mk(30, 20)
    fusedkit.linear_relu(mk(5, 20), w)
    assert seen and seen[0].data_ptr() == w.data_ptr() and seen[0].stride() == (1, 20)


@pytest.mark.parametrize("m,n,k", [(0, 5, 7), (5, 0, 7), (5, 7, 0)])
def test_empty_dims_like_torch(m, n, k):
    a, b, bias = mk(m, k), mk(k, n), mk(n)
    out = fusedkit.matmul(a, b, bias, "relu")
    assert out.shape == (m, n)
    torch.testing.assert_close(out.cpu(), torch.relu(a.cpu() @ b.cpu() + bias.cpu()))


def test_bad_input_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(mm, "launch_matmul", lambda *a, **k: pytest.fail("launched on bad input"))
    a, b = mk(4, 5), mk(5, 6)
    cases = [
        ((a, mk(6, 6)), {}, ShapeError, "K differs"),
        ((a, mk(5)), {}, ShapeError, "2-D"),
        ((a[0, 0], b), {}, ShapeError, "at least 1 dim"),
        ((a, b, mk(5)), {}, ShapeError, r"bias must have shape \(6,\)"),
        ((a, b.double()), {}, DTypeError, "share a dtype"),
        ((a.int(), b.int()), {}, DTypeError, "'a' has dtype torch.int32"),
        ((a, "b"), {}, DTypeError, "'b' must be a Tensor"),
        ((a, b.to("meta")), {}, DeviceError, "'b' is on meta"),
        ((a, b), {"activation": "tanh"}, ArgumentError, "unknown activation"),
    ]
    for args, kw, error, words in cases:
        with pytest.raises(error, match=words):
            fusedkit.matmul(*args, **kw)
    with pytest.raises(ShapeError, match="weight must be 2-D"):
        fusedkit.linear_relu(a, mk(5, 5, 5))
    with pytest.raises(ShapeError, match="K differs"):
        fusedkit.linear_relu(a, mk(4), mk(4))
    with pytest.raises(ShapeError, match="does not broadcast to the product's shape"):
        fusedkit.linear_relu(a, mk(6, 5), mk(2, 4, 6))  # torch's addmm refuses to widen the result


# For the activations' backward; quick: each with the pointer kernel (float64 is no TMA dtype).
@pytest.mark.parametrize(
    "matmul_kernel,activation",
    slow_unless(lambda kernel, activation: kernel == "pointer", [(k, a) for k in MATMUL_KERNELS for a in ACTS]),
    indirect=["matmul_kernel"],
)
def test_gradcheck_float64(activation):
    # small: gradcheck perturbs every element, two interpreted launches each
    a = mk(3, 4, dtype=torch.float64).requires_grad_()
    b = mk(4, 3, dtype=torch.float64).requires_grad_()
    bias = mk(3, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, y, z: fusedkit.matmul(x, y, z, activation), (a, b, bias), eps=1e-6, atol=1e-5, rtol=1e-4
    )


# For the activations' backward in float32 and bfloat16; quick: each with the pointer kernel
# (the output's 31 columns are no TMA layout).
@pytest.mark.parametrize(
    "matmul_kernel,dtype,activation",
    slow_unless(
        lambda kernel, dtype, activation: kernel == "pointer",
        [(k, d, a) for k in MATMUL_KERNELS for d in (torch.float32, torch.bfloat16) for a in ACTS],
    ),
    indirect=["matmul_kernel"],
)
def test_gradients_match_torch(dtype, activation):
    a = mk(2, 17, 24, dtype=dtype).requires_grad_()
    w = mk(31, 24, dtype=dtype).requires_grad_()
    bias = mk(31, dtype=dtype).requires_grad_()
    out = fusedkit.matmul(a, w.t(), bias, activation)
    g = mk(*out.shape, dtype=dtype)
    out.backward(g)
    a64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (a, w, bias))
    matmul_reference(a64, w64.t(), b64, activation).backward(g.double().cpu())
    bound = 3e-2 if dtype == torch.bfloat16 else matmul_rel_err(torch.float32) * 10
    for got, ref in ((a.grad, a64.grad), (w.grad, w64.grad), (bias.grad, b64.grad)):
        assert_rel_err(got, ref, bound)


@pytest.mark.slow  # second derivatives of a matmul
def test_training_outputs_take_in_place_ops_and_second_derivatives():
    # The first call of a shape (no kept recipe) returns the result itself, not a view of
    # it: an autograd Function's output that is a view refuses in-place ops.
    fusedkit.clear_caches()
    a, w = mk(7, 5, dtype=torch.float64).requires_grad_(), mk(6, 5, dtype=torch.float64).requires_grad_()
    z = fusedkit.matmul(a, w.t())
    z += 1
    z.square().sum().backward()
    a64, w64 = (t.detach().requires_grad_() for t in (a, w))
    ((a64 @ w64.t() + 1).square().sum()).backward()
    torch.testing.assert_close(a.grad, a64.grad)
    torch.testing.assert_close(w.grad, w64.grad)
    # Second derivatives: exact for None and relu; refused where the saved pre-activation
    # carries no graph (GELU, SiLU), rather than silently missing a term.
    b = mk(5, 4, dtype=torch.float64).requires_grad_()
    x = mk(6, 5, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda p, q: fusedkit.matmul(p, q, None, "relu"), (x, b))
    out = fusedkit.matmul(x, b, None, "gelu")
    torch.autograd.grad(out.sum(), x)  # first order: fine
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(fusedkit.matmul(x, b, None, "silu").sum(), x, create_graph=True)


def test_relu_saves_output_not_pre_activation():
    a, b = mk(8, 6).requires_grad_(), mk(6, 5).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        fusedkit.matmul_relu(a, b)
    assert saved == [(8, 6), (6, 5), (8, 5)]  # a, b and the output: no extra pre-activation


def test_linear_relu_module_is_a_drop_in():
    torch.manual_seed(1)
    ref = torch.nn.Sequential(torch.nn.Linear(24, 31), torch.nn.ReLU()).to(DEVICE)
    mod = fusedkit.nn.LinearReLU(24, 31, device=DEVICE)
    mod.load_state_dict(ref[0].state_dict())
    x = mk(3, 7, 24)
    assert_rel_err(mod(x), ref(x), matmul_rel_err(torch.float32))
    mod(x).sum().backward()
    ref(x).sum().backward()
    assert_rel_err(mod.weight.grad, ref[0].weight.grad, matmul_rel_err(torch.float32) * 10)
    assert_rel_err(mod.bias.grad, ref[0].bias.grad, matmul_rel_err(torch.float32) * 10)
    half = fusedkit.nn.LinearReLU.from_linear(ref[0]).to(torch.float64)
    assert half.weight.dtype == torch.float64 and half(x.double()).dtype == torch.float64


#: (M, N, K, dtype, activation, weight given as nn.Linear's (N, K)) of the autotuned cases:
#: one per dtype and M bucket, so every config of both sets compiles for each dtype.
#: Separate cases so pytest-xdist tunes them in parallel (each tunes ~10 configs).
AUTOTUNED_CASES = [
    (300, 384, 512, torch.bfloat16, "relu", True),
    (300, 384, 512, torch.float16, "relu", True),
    (1024, 512, 256, torch.float32, "silu", False),
    (8, 256, 256, torch.float32, "relu", False),  # decode-sized M: the small-tile set must fit every dtype
    (8, 256, 256, torch.float64, "relu", False),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on a GPU only")
@pytest.mark.parametrize(
    "m,n,k,dtype,activation,linear",
    AUTOTUNED_CASES,
    ids=[f"{c[0]}x{c[1]}x{c[2]}-{str(c[3])[6:]}" for c in AUTOTUNED_CASES],
)
def test_autotuned_path(m, n, k, dtype, activation, linear):
    a = mk(m, k, dtype=dtype)
    if linear:
        w, bias = mk(n, k, dtype=dtype), mk(n, dtype=dtype)
        out, want = fusedkit.linear_relu(a, w, bias), ref64(a, w.t(), bias, "relu")
    else:
        b = mk(k, n, dtype=dtype)
        out, want = fusedkit.matmul(a, b, None, activation), ref64(a, b, None, activation)
    assert_rel_err(out, want, matmul_rel_err(dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on a GPU only")
@pytest.mark.parametrize("m", [1, 8, 64, 1024])
def test_autotuned_ieee_fp32_path(fk_settings, m, monkeypatch):
    """``fp32_precision="ieee"`` with TF32 off tunes over its own tiles (multiply-and-sum tiles
    beside the ``tl.dot`` ones at decode-sized M, split-K among them): every M bucket they serve."""
    if mm.tf32_enabled():
        pytest.skip("PyTorch allows TF32 here: the setting applies with TF32 off")
    fk_settings(fp32_precision="ieee")
    n, k = 200, 264  # sizes no other test tunes
    a, w, bias = mk(m, k, dtype=torch.float32), mk(n, k, dtype=torch.float32), mk(n, dtype=torch.float32)
    for _ in range(2):  # tuned, then the kept launch
        assert_rel_err(fusedkit.linear_relu(a, w, bias), ref64(a, w.t(), bias, "relu"), matmul_rel_err(torch.float32))
    assert {r.plan.meta["INPUT_PRECISION"] for r in mm.KEPT.values() if r.m == m and r.n == n} == {"ieee"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on a GPU only")
def test_autotuned_tma_tunes_each_fp32_precision(tf32_allowed, matmul_kernel):
    """The TMA kernel tunes TF32 and tf32x3 apart at one shape (a TF32 tile can need more
    shared memory than tf32x3 has left), and the results stand within their bounds."""
    from fusedkit.runtime import matmul_tma

    if matmul_kernel != "tma" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel's tuning (matmul_kernel='tma' on Hopper)")
    m, n, k = 136, 208, 272  # sizes no other test tunes; 16-byte rows
    a, b = mk(m, k), mk(k, n)
    before = len(matmul_tma.matmul_tma_tuned.cache)
    for tf32 in (True, False):  # the fixture turns TF32 off again afterwards
        torch.backends.cuda.matmul.allow_tf32 = tf32
        assert_rel_err(fusedkit.matmul(a, b), ref64(a, b), matmul_rel_err(torch.float32))
    assert len(matmul_tma.matmul_tma_tuned.cache) == before + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_large_shapes_on_gpu(dtype):
    a, b, bias = mk(512, 4096, dtype=dtype), mk(4096, 1024, dtype=dtype), mk(1024, dtype=dtype)
    assert_rel_err(fusedkit.matmul_relu(a, b, bias), ref64(a, b, bias, "relu"), matmul_rel_err(dtype))


def test_tma_path_taken_exactly_when_eligible(matmul_kernel, monkeypatch):
    from fusedkit.runtime import matmul_tma

    if matmul_kernel != "tma" or (DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] < 9):
        pytest.skip("checks the TMA kernel's dispatch (needs matmul_kernel='tma' and Hopper or the interpreter)")
    calls = []
    real = matmul_tma.launch_tma
    monkeypatch.setattr(matmul_tma, "launch_tma", lambda *a, **k: calls.append(1) or real(*a, **k))
    fusedkit.clear_caches()
    x, w = mk(40, 64, dtype=torch.float16), mk(48, 64, dtype=torch.float16)
    assert_rel_err(fusedkit.linear_relu(x, w), ref64(x, w.t(), None, "relu"), matmul_rel_err(torch.float16))
    assert len(calls) == 1
    odd = mk(40, 33, dtype=torch.float16)  # 66-byte rows: TMA cannot address them
    fusedkit.matmul(odd, mk(33, 48, dtype=torch.float16))
    assert len(calls) == 1
    # A column-major a (the weight gradient x.t() @ grad of a backward pass) is read
    # through a descriptor of the row-major x, transposed in shared memory.
    xt, g = mk(64, 40, dtype=torch.float16).t(), mk(64, 48, dtype=torch.float16)
    assert_rel_err(fusedkit.matmul(xt, g), ref64(xt, g, None, None), matmul_rel_err(torch.float16))
    assert len(calls) == 2


def test_auto_kernel_choice_by_rows(fk_settings, monkeypatch):
    from fusedkit.runtime.configs import (
        MATMUL_TMA_HALF_M_BUCKET,
        MATMUL_TMA_MIN_M,
        MATMUL_TMA_MIN_M_TRANSPOSED,
        matmul_kernel_choice,
    )

    fk_settings(matmul_kernel="auto")
    assert matmul_kernel_choice(MATMUL_TMA_MIN_M - 1) == "pointer"
    assert matmul_kernel_choice(MATMUL_TMA_MIN_M) == "tma"
    assert MATMUL_TMA_MIN_M_TRANSPOSED < MATMUL_TMA_MIN_M
    assert matmul_kernel_choice(MATMUL_TMA_MIN_M_TRANSPOSED - 1, transposed=True) == "pointer"
    assert matmul_kernel_choice(MATMUL_TMA_MIN_M_TRANSPOSED, transposed=True) == "tma"
    # 2-byte operands also in one small-M bucket (33..64 rows), others not
    lo = MATMUL_TMA_HALF_M_BUCKET // 2
    assert [
        matmul_kernel_choice(m, half=True) for m in (lo, lo + 1, MATMUL_TMA_HALF_M_BUCKET, MATMUL_TMA_HALF_M_BUCKET + 1)
    ] == ["pointer", "tma", "tma", "pointer"]
    assert matmul_kernel_choice(MATMUL_TMA_HALF_M_BUCKET) == "pointer"
    # fp32 on TF32 tensor cores with a row-major b is the transposed product; nn.Linear's b is not
    a, w = torch.empty(8, 16, device="meta"), torch.empty(32, 16, device="meta")
    assert mm.matmul_tma.transposed_product(a, w.t().contiguous(), "tf32x3")
    assert not mm.matmul_tma.transposed_product(a, w.t(), "tf32")
    assert not mm.matmul_tma.transposed_product(a, w.t().contiguous(), "ieee")
    assert not mm.matmul_tma.transposed_product(a.half(), w.t().contiguous().half(), "ieee")
    fk_settings(matmul_kernel="pointer")
    assert matmul_kernel_choice(1 << 20) == "pointer"
    with pytest.raises(ValueError, match="matmul_kernel='fast'"):
        fk_settings(matmul_kernel="fast")
    assert fusedkit.settings.current().matmul_kernel == "pointer"


@pytest.mark.parametrize("activation", ["gelu", "silu", "relu"])
def test_backward_through_either_kernel(activation):
    x = mk(24, 64).requires_grad_()
    w = mk(32, 64).requires_grad_()
    bias = mk(32).requires_grad_()
    out = fusedkit.matmul(x, w.t(), bias, activation)
    g = mk(24, 32)
    out.backward(g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, bias))
    matmul_reference(xr, wr.t(), br, activation).backward(g.double())
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (bias.grad, br.grad)):
        assert_rel_err(got, want, matmul_rel_err(torch.float32))


def test_negated_views_and_broadcast_operands():
    z = torch.randn(40, 32, dtype=torch.complex64, device=DEVICE)
    neg = z.conj().imag  # a lazily negated view
    assert neg.is_neg()
    b = mk(32, 24)
    assert_rel_err(fusedkit.matmul(neg, b), ref64(neg.resolve_neg(), b), matmul_rel_err(torch.float32))
    # zero-stride (broadcast) operands: the pointer kernel reads them; TMA cannot
    row, col = mk(1, 32), mk(32, 1)
    a, bb = row.expand(40, 32), col.expand(32, 24)
    assert_rel_err(fusedkit.matmul(a, bb, None, "relu"), ref64(a, bb, None, "relu"), matmul_rel_err(torch.float32))


def test_unhashable_activation_is_a_value_error():
    with pytest.raises(ValueError, match="unknown activation"):
        fusedkit.matmul(mk(4, 8), mk(8, 4), None, ["relu"])


# --- Split-K: programs share a tile's K range; the last to arrive runs the epilogue ---------


def _split_cases():
    from fusedkit.runtime.configs import MATMUL_EXACT_SPLIT_K_TILES, MATMUL_MID_M_SPLIT_K_TILES, MATMUL_SPLIT_K_TILES

    cases = [(t, torch.bfloat16) for t in MATMUL_SPLIT_K_TILES + MATMUL_MID_M_SPLIT_K_TILES]
    return cases + [(t, d) for t in MATMUL_EXACT_SPLIT_K_TILES for d in (torch.float32, torch.float64)]


# For the tiles; quick: each tile once, the exact ones in float32 and one of them in float64 too.
@pytest.mark.parametrize(
    "tile,dtype",
    slow_unless(
        lambda tile, dtype: dtype != torch.float64 or tile == _split_cases()[-1][0],
        _split_cases(),
        ids=[f"{'x'.join(map(str, t[:3]))}-s{t[5]}-{str(d)[6:]}" for t, d in _split_cases()],
    ),
)
def test_split_k_configs(tile, dtype, matmul_kernel):
    """Every split-K config tuning may pick, launched directly: ragged M, N and K (a last
    partial K step; with 8 splits, splits left without a K step), bias, a kept
    pre-activation, a K-major B; counters back at zero; a rerun bit-identical."""
    if matmul_kernel == "tma":
        pytest.skip("split-K is the pointer kernel's")
    bm, bn, bk, stages, warps, split = tile
    m, n, k = 37, 70, 3 * bk + 5
    a, b, bias = mk(m, k, dtype=dtype), mk(n, k, dtype=dtype).t(), mk(n, dtype=dtype)
    out, pre = poisoned((m, n), dtype, DEVICE), poisoned((m, n), dtype, DEVICE)
    ws_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    ws, arrivals = mm.split_k_buffers(out.device, split, m, n, ws_dtype)
    ws.fill_(float("nan"))  # partials are written before they are read
    args, meta = mm.launch_config(a, b, bias, "gelu", out, pre, (ws, arrivals))
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, DOT=True, SPLIT_K=split, EVEN_K=k % bk == 0)
    options = {} if mm.INTERPRETED else dict(num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    mm.matmul_kernel[grid](*args, **meta, **cfg, **options)
    assert_rel_err(out, ref64(a, b, bias, "gelu"), matmul_rel_err(dtype))
    assert_rel_err(pre, ref64(a, b, bias), matmul_rel_err(dtype))
    assert not arrivals.any(), "a launch left split-K counters behind"
    first = out.clone()
    mm.matmul_kernel[grid](*args, **meta, **cfg, **options)
    assert torch.equal(out, first)


def test_split_k_through_the_public_path(monkeypatch, matmul_kernel):
    """The launcher's split-K buffers, forward and backward, with the interpreter's tile
    split three ways (on a GPU the tuned path picks split-K; see the next test)."""
    if not mm.INTERPRETED:
        pytest.skip("the interpreter's tile; GPUs take split-K through tuning")
    monkeypatch.setattr(mm, "MATMUL_INTERPRETER_TILE", dict(mm.MATMUL_INTERPRETER_TILE, SPLIT_K=3))
    fusedkit.clear_caches()
    for dtype in (torch.float32, torch.bfloat16):
        a, w, bias = mk(9, 100, dtype=dtype), mk(33, 100, dtype=dtype), mk(33, dtype=dtype)
        ref = ref64(a, w.t(), bias, "relu")
        for _ in range(2):  # the second call takes the kept plan
            assert_rel_err(fusedkit.linear_relu(a, w, bias), ref, matmul_rel_err(dtype))
    x = mk(9, 100, dtype=torch.float64).requires_grad_()
    w = mk(33, 100, dtype=torch.float64).requires_grad_()
    g = mk(9, 33, dtype=torch.float64)
    got = torch.autograd.grad(fusedkit.matmul(x, w.t(), None, "silu"), (x, w), g)
    want = torch.autograd.grad(torch.nn.functional.silu(x @ w.t()), (x, w), g)
    for have, ref in zip(got, want):
        assert_rel_err(have, ref, matmul_rel_err(torch.float64))
    assert all(not arrivals.any() for _, arrivals in mm.SPLIT_K_BUFFERS.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on a GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_autotuned_split_k_path(dtype, monkeypatch, matmul_kernel):
    """Tuning over split-K tiles alone (decode-sized M), then the kept direct launch."""
    from fusedkit.runtime import configs

    if matmul_kernel == "tma":
        # Split-K is the pointer kernel's. With the TMA kernel forced this test read a
        # tuning result left by another test on its worker, or failed where none was
        # (the H200, ecf415d, the matmul tests alone).
        pytest.skip("split-K is the pointer kernel's")

    monkeypatch.setattr(configs, "MATMUL_DECODE_TILES", ())
    monkeypatch.setattr(configs, "MATMUL_REDUCE_TILES", ())
    m, n, k = 24, 328, 1032  # sizes no other test tunes, so this tuning runs here
    a, w, bias = mk(m, k, dtype=dtype), mk(n, k, dtype=dtype), mk(n, dtype=dtype)
    ref = ref64(a, w.t(), bias, "relu")
    for _ in range(3):
        assert_rel_err(fusedkit.linear_relu(a, w, bias), ref, matmul_rel_err(dtype))
    assert mm.matmul_tuned.best_config.kwargs["SPLIT_K"] > 1
    torch.cuda.synchronize()
    assert all(not arrivals.any() for _, arrivals in mm.SPLIT_K_BUFFERS.values())


def test_fp32_tf32x3_setting(fk_settings, monkeypatch, matmul_kernel):
    """``fp32_precision="tf32x3"`` (the default): float32 products as three TF32
    products, within fp32's error bound, infinities kept as fp32 keeps them; a plan of its
    own beside the IEEE one; an unknown value raises before any launch."""
    if mm.tf32_enabled():
        pytest.skip("PyTorch allows TF32 here: the setting applies with TF32 off")
    m, n, k = 37, 70, 132  # ragged M, N and K; 16-byte rows, so the TMA kernel takes it too
    a, w, bias = mk(m, k, dtype=torch.float32), mk(n, k, dtype=torch.float32).abs() + 0.1, mk(n, dtype=torch.float32)
    a[3, 5] = float("inf")  # row 3: inf * positive weights, +inf after the ReLU
    ref = ref64(a, w.t(), bias, "relu")
    finite = torch.ones(m, dtype=torch.bool)
    finite[3] = False
    fk_settings(fp32_precision="ieee")
    assert_rel_err(fusedkit.linear_relu(a, w, bias)[finite.to(DEVICE)], ref[finite], matmul_rel_err(torch.float32))
    fk_settings(fp32_precision="tf32x3")
    assert mm.fp32_precision() == "tf32x3"
    for _ in range(2):  # the second call takes the kept plan
        got = fusedkit.linear_relu(a, w, bias)
        assert got[3].isposinf().all()
        assert_rel_err(got[finite.to(got.device)], ref[finite], matmul_rel_err(torch.float32))
    precisions = {r.plan.meta["INPUT_PRECISION"] for r in mm.KEPT.values() if r.dtype == torch.float32}
    assert {"ieee", "tf32x3"} <= precisions
    with pytest.raises(ValueError, match="fp32_precision='fast'"):
        fusedkit.set_fp32_precision("fast")
    assert fusedkit.get_fp32_precision() == "tf32x3"


@pytest.fixture
def tf32_allowed():
    """PyTorch's TF32 switch for fp32 matmuls on for one test (set through the old flag,
    which newer PyTorch maps onto ``fp32_precision``), then off again."""
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("layout", ["row-major", "linear"])
def test_fp32_with_tf32_allowed(tf32_allowed, matmul_kernel, layout):
    """float32 where PyTorch allows TF32: within TF32's bound with ``b`` row-major (the TMA
    kernel's transposed product, ``b^T`` rounded in registers) or an nn.Linear weight's
    transpose; inf and NaN inputs pass as in torch."""
    assert mm.fp32_precision() == "tf32"
    m, n, k = 37, 68, 132  # ragged; 16-byte rows either way, so the TMA kernel takes it
    a, w, bias = mk(m, k), mk(n, k).abs() + 0.1, mk(n)
    b = w.t().contiguous() if layout == "row-major" else w.t()
    a[3, 5] = float("inf")  # inf * positive weights: +inf after the ReLU
    a[9, 0] = float("nan")
    ref = ref64(a, b, bias, "relu")
    finite = torch.ones(m, dtype=torch.bool)
    finite[[3, 9]] = False
    for _ in range(2):  # the second call takes the kept plan
        got = fusedkit.matmul_relu(a, b, bias)
        assert got[3].isposinf().all() and got[9].isnan().all()
        assert_rel_err(got[finite.to(got.device)], ref[finite], matmul_rel_err(torch.float32))


def test_kmajor_copy_is_exact(matmul_kernel):
    """``kmajor_copy``: the same bits (signed zeros and inf included; NaN stays NaN, its
    payload not kept: the H200 returned 0x7fffffff for 0x7fc00000) in a K-major layout,
    from a row-major or strided ``b``, which is left as it was."""
    if matmul_kernel == "tma":
        pytest.skip("no matmul kernel involved: once is enough")
    for b in (mk(37, 70), mk(40, 150)[:, ::2]):
        b[1, 2], b[3, 3], b[4, 4], b[5, 5] = float("nan"), -0.0, float("-inf"), float("inf")
        before = b.clone()
        launch = mm.kmajor_copy_launch(b)
        assert launch is not None and mm.kmajor_copy_launch(b) is launch  # kept, once per signature
        for c in (mm.kmajor_copy(b), mm.kmajor_copy(b, launch), mm.kmajor_copy(b, launch)):
            assert c.shape == b.shape and c.stride() == (1, b.shape[0])
            nan = b.isnan()
            assert torch.equal(c.isnan(), nan) and nan.sum() == 1
            assert torch.equal(c.view(torch.int32)[~nan], b.contiguous().view(torch.int32)[~nan])
        assert torch.equal(b.contiguous().view(torch.int32), before.contiguous().view(torch.int32))


def test_tf32_row_major_b_runs_on_a_kmajor_copy_from_min_m(fk_settings, tf32_allowed, matmul_kernel, monkeypatch):
    """ "auto" with TF32 and row-major ``a`` and ``b``: from ``MATMUL_TF32_COPY_MIN_M`` rows
    the launch runs ``a @ b`` on a K-major copy of ``b`` (left as it was), below it not;
    a forced kernel never copies."""
    from fusedkit.runtime.configs import MATMUL_TF32_COPY_MIN_M, MATMUL_TMA_MIN_M

    if matmul_kernel == "tma":
        pytest.skip("the choice of 'auto': once is enough")
    # The copy pays only with the TMA kernel's a @ b after it (H200, 99b4b22: M = 256 with the
    # pointer kernel after the copy 98.1 TFLOP/s against 118.7 for the transposed product).
    assert MATMUL_TF32_COPY_MIN_M >= MATMUL_TMA_MIN_M
    n, k = 40, 48
    b, bias = mk(k, n), mk(n)
    b_before = b.clone()
    for m, kernel, copies in (
        (MATMUL_TF32_COPY_MIN_M, "auto", True),
        (MATMUL_TF32_COPY_MIN_M - 1, "auto", False),
        (MATMUL_TF32_COPY_MIN_M, "pointer", False),
    ):
        fk_settings(matmul_kernel=kernel)
        a = mk(m, k)
        out = poisoned((m, n), torch.float32, DEVICE)
        plan = mm.plan_matmul(a, b, bias, "relu", out)
        assert plan.copy_b == copies and (plan.copy_launch is not None) == copies, (m, kernel)
        mm.launch_matmul(a, b, bias, "relu", out, plan=plan)
        assert_rel_err(out, ref64(a, b, bias, "relu"), matmul_rel_err(torch.float32))
        assert b.stride() == (n, 1) and torch.equal(b, b_before)
    # the plan follows TF32: with it off (tf32x3) nothing is copied
    torch.backends.cuda.matmul.allow_tf32 = False
    fk_settings(matmul_kernel="auto")
    assert not mm.plan_matmul(
        mk(MATMUL_TF32_COPY_MIN_M, k), b, bias, "relu", torch.empty(MATMUL_TF32_COPY_MIN_M, n, device=DEVICE)
    ).copy_b


@triton.jit
def _tf32_split_kernel(x_ptr, big_ptr, small_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    big, small = helpers.tf32_split(x)
    tl.store(big_ptr + offs, big, mask=offs < n)
    tl.store(small_ptr + offs, small, mask=offs < n)


def test_tf32_split_rounds_to_nearest_and_stays_finite(matmul_kernel):
    """``helpers.tf32_split``, the tf32x3 mode's split: ``big + small == x`` exactly, ``big`` a
    TF32 value (13 low bits clear) within half a TF32 unit of ``x`` (ties away from zero, as
    ``cvt.rna``), finite for every finite ``x`` (truncated where rounding would overflow);
    inf and NaN (any payload) are their own ``big``."""
    if matmul_kernel == "tma":
        pytest.skip("a jit helper's test: once is enough")
    f32 = torch.finfo(torch.float32)
    bits = lambda *v: torch.tensor(v, dtype=torch.int32).view(torch.float32)
    ties = torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11), 1 + 3 * 2.0**-11])
    finite = torch.cat(
        [
            rand((300,), torch.float32, "cpu") * 10.0 ** torch.randint(-30, 30, (300,)),
            ties,
            torch.tensor([f32.max, -f32.max, f32.max * (1 - 2.0**-20), f32.tiny / 7, 0.0, -0.0]),
        ]
    )
    special = torch.cat([torch.tensor([float("inf"), -float("inf"), float("nan")]), bits(-1, 0x7F800001, -4096)])
    x = torch.cat([finite, special]).to(DEVICE)
    big, small = poisoned(x.shape, torch.float32, DEVICE), poisoned(x.shape, torch.float32, DEVICE)
    _tf32_split_kernel[(1,)](x, big, small, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    big, small, x = big.cpu(), small.cpu(), x.cpu()
    n = finite.numel()
    assert big[:n].isfinite().all()
    assert torch.equal(big[:n].double() + small[:n].double(), x[:n].double())
    assert not (big[:n].view(torch.int32) & ((1 << 13) - 1)).any()
    normal = x[:n].abs() >= f32.tiny
    normal[n - 6 : n - 3] = False  # the maximum's three: truncated, up to a whole unit
    bad = normal & (small[:n].abs() > x[:n].abs() * 2.0**-11)  # half a TF32 unit is at most that
    assert not bad.any(), list(zip(x[:n][bad].tolist(), small[:n][bad].tolist()))
    assert big[n - 9 : n - 6].tolist() == [1 + 2.0**-10, -(1 + 2.0**-10), 1 + 2 * 2.0**-10]  # ties away from 0
    assert big[n - 6] < f32.max and big[n - 5] > -f32.max  # truncated at the top, not inf
    assert big[n : n + 2].tolist() == [float("inf"), -float("inf")] and small[n : n + 2].isnan().all()
    assert big[n + 2 :].isnan().all() and small[n + 2 :].isnan().all()


def test_fp32_tf32x3_keeps_inputs_near_the_fp32_maximum_finite(fk_settings, monkeypatch, matmul_kernel):
    """The tf32x3 split truncates: the fp32 maximum's TF32 part is below it, not inf (Triton's
    own rounding split, ``cvt.rna``, turns inputs within 0.025% of the maximum into inf).
    A product of it by 0.5 is finite and as exact as the other rows."""
    if mm.tf32_enabled():
        pytest.skip("PyTorch allows TF32 here: the setting applies with TF32 off")
    fk_settings(fp32_precision="tf32x3")
    m, n, k = 20, 40, 48
    a, b = mk(m, k, dtype=torch.float32), mk(k, n, dtype=torch.float32) * 0.1
    a[2, 3] = torch.finfo(torch.float32).max
    a[5, 7] = -torch.finfo(torch.float32).max * (1 - 2.0**-20)  # within 0.025% of the maximum
    b[3, :] = b[7, :] = 0.5
    got, ref = fusedkit.matmul(a, b).cpu(), ref64(a, b)
    assert got.isfinite().all()
    big = torch.zeros(m, dtype=torch.bool)
    big[[2, 5]] = True
    assert_rel_err(got[big], ref[big], matmul_rel_err(torch.float32))
    assert_rel_err(got[~big], ref[~big], matmul_rel_err(torch.float32))  # not judged against the maximum


@pytest.mark.parametrize(
    "dtype,a_val,b_val,activation",
    [
        (torch.float16, 2.0, -0.5, "silu"),  # pre-activation -24: SiLU -9e-10, float16's 0
        (torch.float32, 3.1821, -2.8535, "gelu_tanh"),  # -9.08: float64's GELU-tanh is -0, fp32's -2.9e-29
    ],
    ids=["float16-silu", "float32-gelu_tanh"],
)
def test_activation_tail_results(dtype, a_val, b_val, activation, matmul_kernel):
    """Results an activation sends to almost zero (examples the fuzz found on the H200,
    2026-12-03): within a few units of the dtype's rounding of their products' size, where
    a relative error says nothing; ``matmul_error_floor`` is how the fuzz judges them."""
    from fusedkit.testing import matmul_error_floor

    k = 24 if dtype == torch.float16 else 1
    a = torch.full((1, k), a_val, dtype=dtype, device=DEVICE)
    b = torch.full((k, 1), b_val, dtype=dtype, device=DEVICE)
    out = fusedkit.matmul(a, b, None, activation)
    ref = ref64(a, b, None, activation)
    scale = (a.double().abs().cpu() @ b.double().abs().cpu()).abs().max().item()
    assert (out.double().cpu() - ref).abs().max().item() <= 4 * torch.finfo(dtype).eps * scale
    assert_rel_err(out, ref, matmul_rel_err(dtype), floor=matmul_error_floor(a, b))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_activation_backward_is_one_fused_kernel(activation, monkeypatch):
    """The gradient through a kept pre-activation runs one fusedkit kernel (fp32 math for half
    types), not a composition of torch ops, and matches float64."""
    from fusedkit import dispatch

    ran = []
    real = dispatch.elementwise
    monkeypatch.setattr(dispatch, "elementwise", lambda kernel, *args: ran.append(kernel.name) or real(kernel, *args))
    for dtype in (torch.float32, torch.bfloat16):
        a = mk(33, 48, dtype=dtype).requires_grad_()
        w = mk(40, 48, dtype=dtype).requires_grad_()
        g = mk(33, 40, dtype=dtype)
        got = torch.autograd.grad(fusedkit.matmul(a, w.t(), None, activation), (a, w), g)
        a64, w64 = (t.detach().to("cpu", torch.float64).requires_grad_() for t in (a, w))
        want = torch.autograd.grad(matmul_reference(a64, w64.t(), None, activation), (a64, w64), g.cpu().double())
        for have, ref in zip(got, want):
            assert_rel_err(have, ref, matmul_rel_err(dtype))
    assert ran.count(f"{activation}_grad") == 2
