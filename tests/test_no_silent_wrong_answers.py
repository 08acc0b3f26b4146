"""Regression tests for the "never a silent wrong answer" list: each test is named after
the promise it keeps, and each failed before the fix it guards.

The module runs on the active backend (the GPU, or Triton's interpreter on a CPU) and,
through ``test_the_pytorch_path_keeps_them_too``, once more on the PyTorch path that CPU
tensors take without the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, ON_GPU
from helpers import rand

import fusedkit
from fusedkit import library, registry
from fusedkit.errors import (
    ArgumentError,
    DTypeError,
    FusedkitError,
    NotDifferentiableError,
    OverlapError,
    SignatureError,
    UnknownKernelError,
)
from fusedkit.nn import AddReLU, LinearReLU
from fusedkit.testing import assert_matches_reference, assert_rel_err, matmul_rel_err, poisoned

ROOT = Path(__file__).resolve().parents[1]
PYTORCH_PATH = os.environ.get("FUSEDKIT_TEST_CPU_BACKEND") == "torch"


# 1. out= bumps autograd's version counter; inference tensors are refused outside inference mode.


def test_out_bumps_the_version_counter_so_autograd_refuses_stale_values():
    a = rand((6,), torch.float32, DEVICE).requires_grad_()
    w = rand((6,), torch.float32, DEVICE)
    before = w._version
    y = a * w  # saves w for the backward
    fusedkit.add(w, 1, out=w)
    assert w._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    x = rand((4, 5), torch.float32, DEVICE)
    y = a[:5] * x[0]
    AddReLU(inplace=True)(x, rand((5,), torch.float32, DEVICE))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_out_refuses_an_inference_tensor_outside_inference_mode():
    with torch.inference_mode():
        frozen = torch.ones(3, device=DEVICE)
    with pytest.raises(FusedkitError, match="inference tensor"):
        fusedkit.add(torch.ones(3, device=DEVICE), 1, out=frozen)
    assert torch.equal(frozen.cpu(), torch.ones(3))
    with torch.inference_mode():
        assert torch.equal(fusedkit.add(torch.ones(3, device=DEVICE), 1, out=frozen).cpu(), torch.full((3,), 2.0))


# 2. Integer operands convert exactly as torch converts them.


def test_integer_operands_of_a_float64_result_convert_exactly():
    ints = torch.tensor([16777217, 2**53 - 1, -(2**62) - 1, 3], device=DEVICE)
    zeros = torch.zeros(4, dtype=torch.float64, device=DEVICE)
    expected = torch.add(ints.cpu(), zeros.cpu())
    assert torch.equal(fusedkit.add(ints, zeros).cpu(), expected)
    assert torch.equal(fusedkit.add(zeros, ints, alpha=1).cpu(), expected)
    assert torch.equal(fusedkit.add(ints.int(), zeros).cpu(), torch.add(ints.int().cpu(), zeros.cpu()))
    # Into float32 an int64 rounds once (as torch), into float16 it goes through float32 (as c10::Half).
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        z = torch.zeros(4, dtype=dtype, device=DEVICE)
        assert torch.equal(fusedkit.add(ints, z).cpu(), torch.add(ints.cpu(), z.cpu()))


# 3. out= a lazily negated view.


def test_out_a_lazily_negated_view_is_written_as_torch_writes_it():
    z = torch.zeros(5, dtype=torch.complex64, device=DEVICE)
    out = z.conj().imag
    assert out.is_neg()
    x = rand((5,), torch.float32, DEVICE)
    assert fusedkit.add_relu(x, 1.5, out=out) is out
    assert torch.equal(out.cpu(), torch.relu(x.cpu() + 1.5))
    assert torch.equal(z.imag.cpu(), -torch.relu(x.cpu() + 1.5))


# 4. Built-in kernels cannot be replaced; fusedkit's gradients hold kernel objects.


def test_builtin_kernels_cannot_be_replaced_and_gradients_hold_their_kernels():
    fake = registry.ElementwiseKernel(
        name="relu_grad",
        math=registry.get("add").math,
        reference=lambda g, o, alpha=1: g,
        arg_names=("grad", "out"),
        unfused=("torch.mul",),
    )
    for name in registry.BUILTIN_NAMES:
        with pytest.raises(ArgumentError, match="cannot be replaced"):
            registry.register(registry.ElementwiseKernel(**{**fake.__dict__, "name": name}), replace=True)
    assert registry.get("relu_grad") is library.RELU_GRAD
    x = rand((8,), torch.float32, DEVICE).requires_grad_()
    fusedkit.add_relu(x, -1.0).sum().backward()
    assert torch.equal(x.grad.cpu(), (x.detach().cpu() - 1 > 0).float())


# 5. An alpha torch refuses raises.


@pytest.mark.parametrize("alpha", [1e300, -1e300, 2**64, -(2**63) - 1], ids=str)
def test_an_alpha_torch_refuses_raises(alpha):
    x = rand((4,), torch.float32, DEVICE)
    out = poisoned((4,), torch.float32, DEVICE)
    with pytest.raises(ArgumentError):
        fusedkit.add(x, x, alpha=alpha, out=out)
    assert out.isnan().all()  # nothing written
    with pytest.raises(ArgumentError):
        fusedkit.add_relu(x, x, alpha=alpha)
    with pytest.raises(ArgumentError):
        fusedkit.add(x, x, alpha=alpha)  # a signature seen before (the fast path) checks too


def test_alphas_torch_takes_still_run():
    x = rand((4,), torch.float32, DEVICE)
    for alpha in (float("inf"), float("nan"), 2**63, 1e30):
        assert_matches_reference(
            fusedkit.add(x, x, alpha=alpha), torch.add(x.cpu().double(), x.cpu().double(), alpha=alpha), torch.float32
        )
    x64 = x.double()
    assert torch.equal(fusedkit.add(x64, x64, alpha=1e300).cpu(), torch.add(x64.cpu(), x64.cpu(), alpha=1e300))


# 6. Numerics: bf16 rounds to nearest even, keeps subnormals; x + alpha * y rounds once.


def test_bf16_stores_round_to_nearest_even_and_keep_subnormals():
    bits = torch.randint(0, 2**31 - 1, (4096,), dtype=torch.int32)
    values = bits.view(torch.float32)
    values = torch.cat(
        [
            values,
            -values,
            torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e-39, -3e-40, 2e-45, float("inf"), float("nan"), 3.3895e38]),
        ]
    )
    values = values[values.isfinite() | values.isinf() | values.isnan()].to(DEVICE)
    out = torch.empty(values.shape, dtype=torch.bfloat16, device=DEVICE)
    fusedkit.add(values, 0.0, out=out)  # fp32 result converted into a bf16 out
    expected = values.cpu().bfloat16()
    same = (out.cpu().view(torch.int16) == expected.view(torch.int16)) | (out.cpu().isnan() & expected.isnan())
    assert same.all()
    # bf16 subnormal inputs are read exactly.
    sub = torch.tensor([1e-39, -5e-40, 9.2e-41], dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(fusedkit.add(sub, sub).cpu(), (sub.cpu().float() * 2).bfloat16())
    assert torch.equal(fusedkit.add(sub, torch.zeros(3, device=DEVICE)).cpu(), sub.cpu().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_add_with_alpha_rounds_once_as_a_fused_multiply_add(dtype):
    x, y = rand((2048,), dtype, DEVICE), rand((2048,), dtype, DEVICE)
    alpha = 0.3
    # torch's CUDA kernel: alpha in float32, one fma in float32, one rounding to the dtype.
    # float64 holds x + alpha * y exactly for these operands, so one rounding to float32 is the fma's.
    a32 = torch.tensor(alpha, dtype=torch.float32).double()
    expected = (x.cpu().double() + y.cpu().double() * a32).float().to(dtype)
    got = fusedkit.add(x, y, alpha=alpha).cpu()
    assert torch.equal(got, expected)
    if ON_GPU:
        assert torch.equal(got, torch.add(x, y, alpha=alpha).cpu())
    elif dtype == torch.float32:
        assert torch.equal(got, torch.add(x.cpu(), y.cpu(), alpha=alpha))  # torch's CPU kernel fuses too


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("alpha", [70000, 70000.0, 2**31, 2**40, 2**63 - 1, 3.5e38, 1e39, float("inf")])
def test_an_alpha_is_checked_as_torch_checks_it_on_the_device(dtype, alpha):
    # torch converts alpha with an overflow check: to float32 for half types on CUDA, to the
    # result dtype itself on the CPU (fp16 + 70000 * y raises there). fusedkit refuses what torch
    # refuses, before launching, and computes what it computes.
    x, y = rand((64,), dtype, DEVICE), rand((64,), dtype, DEVICE) * 1e-6
    try:
        expected = torch.add(x, y, alpha=alpha)
    except RuntimeError as exc:
        assert "without overflow" in str(exc)
        with pytest.raises(fusedkit.ArgumentError, match="without overflow"):
            fusedkit.add(x, y, alpha=alpha)
        return
    # float64 holds x + alpha32 * y exactly enough: one rounding to float32, then to the dtype
    a32 = torch.tensor(alpha, dtype=torch.float32).double()
    got = fusedkit.add(x, y, alpha=alpha)
    want = (x.cpu().double() + y.cpu().double() * a32).float().to(dtype)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    if ON_GPU:
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_python_number_operands_convert_as_torchs_cuda_kernels_read_them():
    # A wrapped number goes to the compute dtype, not through the half result dtype.
    h = torch.ones(1, dtype=torch.float16, device=DEVICE)
    assert fusedkit.add(h, 2049.0001).item() == fusedkit.add(h, 2049).item() == 2050.0
    if ON_GPU:
        assert torch.add(h, 2049.0001).item() == 2050.0
    # An int beyond float64's exact range rounds once into float32, as an int64 converts.
    x = torch.zeros(2, device=DEVICE)
    n = 2**60 + 2**36 + 1
    expected = torch.tensor(n).float().item()
    assert fusedkit.add(x, n)[0].item() == expected
    import numpy as np

    assert fusedkit.add(x, np.int64(n))[0].item() == expected
    # uint64-range ints: a float result takes them, as torch does; an integral one would wrap.
    assert fusedkit.add(x, 2**63)[0].item() == torch.add(torch.zeros(2), 2**63)[0].item()
    with pytest.raises(OverflowError):
        fusedkit.add(torch.ones(2, dtype=torch.int64, device=DEVICE), 2**63)
    assert fusedkit.add(x, torch.ones(2, device=DEVICE), alpha=n)[0].item() == expected
    assert fusedkit.add_relu(x, n)[0].item() == expected


def test_matmul_bf16_rounds_to_nearest_even_and_keeps_subnormals():
    a = torch.tensor([[1.0, 2**-8 + 2**-9]], dtype=torch.bfloat16, device=DEVICE)
    assert fusedkit.matmul(a, torch.ones(2, 1, dtype=torch.bfloat16, device=DEVICE)).item() == 1.0078125
    tiny = torch.full((1, 2), 2.0**-130, dtype=torch.bfloat16, device=DEVICE)
    huge = torch.full((2, 1), 2.0**100, dtype=torch.bfloat16, device=DEVICE)
    assert fusedkit.matmul(tiny, huge).item() == pytest.approx(2.0**-29)


# 7. linear_relu / LinearReLU: every input F.linear takes, autocast.


def _linear_samples(dtype):
    """The shapes of PyTorch's OpInfo samples for nn.functional.linear, and the other bias shapes F.linear takes."""
    for bias in (True, False):
        for fin, fout in ((3, 4), (8, 8)):
            for batch in ((), (0,), (8,), (2, 3)):
                yield (
                    rand((*batch, fin), dtype, DEVICE),
                    rand((fout, fin), dtype, DEVICE),
                    rand((fout,), dtype, DEVICE) if bias else None,
                )
    yield rand((2, 1, 2, 1, 2), dtype, DEVICE), rand((4, 2), dtype, DEVICE), None
    yield rand((2, 1, 2, 1, 2), dtype, DEVICE), rand((4, 2), dtype, DEVICE), rand((4,), dtype, DEVICE)
    yield rand((3, 4), dtype, DEVICE), rand((5, 4), dtype, DEVICE), rand((1,), dtype, DEVICE)
    yield rand((3, 4), dtype, DEVICE), rand((5, 4), dtype, DEVICE), rand((), dtype, DEVICE)
    yield rand((2, 3, 4), dtype, DEVICE), rand((5, 4), dtype, DEVICE), rand((3, 5), dtype, DEVICE)
    yield rand((4,), dtype, DEVICE), rand((4,), dtype, DEVICE), rand((), dtype, DEVICE)
    yield rand((2, 4), dtype, DEVICE), rand((4,), dtype, DEVICE), None  # a 1-D weight, no bias
    yield rand((2, 5, 4), dtype, DEVICE), rand((4,), dtype, DEVICE), None
    yield rand((4,), dtype, DEVICE), rand((3, 4), dtype, DEVICE), rand((1, 3), dtype, DEVICE)
    yield rand((2, 4), dtype, DEVICE), rand((3, 4), dtype, DEVICE), rand((2, 3), dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_linear_relu_takes_every_input_f_linear_takes(dtype):
    for x, w, b in _linear_samples(dtype):
        expected = torch.relu(F.linear(x.cpu().double(), w.cpu().double(), None if b is None else b.cpu().double()))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = fusedkit.linear_relu(xg, wg, b)
        assert got.shape == expected.shape, (x.shape, w.shape, None if b is None else b.shape)
        assert_rel_err(got, expected, matmul_rel_err(dtype))
        if got.numel():
            got.sum().backward()
            xr, wr = x.cpu().double().requires_grad_(), w.cpu().double().requires_grad_()
            torch.relu(F.linear(xr, wr, None if b is None else b.cpu().double())).sum().backward()
            assert_rel_err(xg.grad, xr.grad, matmul_rel_err(dtype))
            assert_rel_err(wg.grad, wr.grad, matmul_rel_err(dtype))
    m = LinearReLU(4, 3, device=DEVICE, dtype=dtype)
    assert m(rand((4,), dtype, DEVICE)).shape == (3,)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_linear_relu_follows_autocast_as_f_linear_does(device_type):
    if device_type == "cuda" and not ON_GPU:
        pytest.skip("CUDA autocast needs a GPU")
    if device_type == "cpu" and ON_GPU:
        pytest.skip("the GPU suite runs the cuda case")
    fast = torch.bfloat16
    m = LinearReLU(16, 8, device=DEVICE)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 8, device=DEVICE), torch.nn.ReLU())
    ref[0].load_state_dict(m.state_dict())
    x = rand((4, 16), torch.float32, DEVICE)
    with torch.autocast(device_type, dtype=fast):
        got, expected = m(x), ref(x)
        mixed = fusedkit.linear_relu(x.to(fast), m.weight, m.bias)  # a bf16 activation with fp32 weights
        batch_bias = fusedkit.linear_relu(x, m.weight, torch.ones(4, 8, device=DEVICE))  # F.linear's other path
        assert batch_bias.dtype == fast
        kept = fusedkit.matmul(x.double(), m.weight.double().t())  # float64 is not cast
    assert got.dtype == expected.dtype == mixed.dtype == fast and kept.dtype == torch.float64
    assert_rel_err(got, expected.float(), matmul_rel_err(fast))
    got.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32


# 8. nn.AddReLU: numbers and integer tensors.


def test_addrelu_module_takes_numbers_and_integer_tensors():
    x = rand((4, 5), torch.float32, DEVICE)
    expected = torch.relu(x.cpu() + 1.5)
    assert AddReLU(inplace=True)(x, 1.5) is x
    assert torch.equal(x.cpu(), expected)
    assert AddReLU().alpha == 1 and isinstance(AddReLU().alpha, int)
    i, j = rand((6,), torch.int64, DEVICE), rand((6,), torch.int64, DEVICE)
    expected = torch.relu(i.cpu() + j.cpu())
    assert torch.equal(AddReLU()(i, j).cpu(), expected)
    assert AddReLU(inplace=True)(i, j) is i
    assert torch.equal(i.cpu(), expected)


# 9. torch.func.


def test_torch_func_vmap_and_grad_over_the_ops():
    from torch.func import grad, jacrev, vmap

    x, y = rand((5, 3), torch.float64, DEVICE), rand((3,), torch.float64, DEVICE)
    for fused, plain in (
        (fusedkit.add_relu, lambda a, b: torch.relu(a + 2 * b)),
        (fusedkit.add, lambda a, b: a + 2 * b),
    ):
        f = lambda a, b, fused=fused: fused(a, b, alpha=2)
        torch.testing.assert_close(vmap(f)(x, x), vmap(plain)(x, x))
        torch.testing.assert_close(
            vmap(f, in_dims=(1, None))(x, rand((5,), torch.float64, DEVICE)).shape, torch.Size([3, 5])
        )
        torch.testing.assert_close(
            vmap(f, in_dims=(0, None))(x, rand((2, 1, 3), torch.float64, DEVICE)).shape, torch.Size([5, 2, 1, 3])
        )
        torch.testing.assert_close(grad(lambda a: f(a, y).sum())(x), grad(lambda a: plain(a, y).sum())(x))
        torch.testing.assert_close(vmap(grad(lambda a: f(a, y).sum()))(x), vmap(grad(lambda a: plain(a, y).sum()))(x))
        torch.testing.assert_close(jacrev(lambda a: f(a, y))(y), jacrev(lambda a: plain(a, y))(y))
    a3, w, b = (
        rand((4, 6, 5), torch.float64, DEVICE),
        rand((3, 5), torch.float64, DEVICE),
        rand((3,), torch.float64, DEVICE),
    )
    ws = rand((4, 3, 5), torch.float64, DEVICE)
    for act in (None, "relu", "gelu"):
        torch.testing.assert_close(
            vmap(lambda a: fusedkit.matmul(a, w.t(), b, act))(a3), fusedkit.matmul(a3, w.t(), b, act)
        )
        fl = lambda a, ww: torch.relu(F.linear(a, ww, b))
        torch.testing.assert_close(vmap(lambda a, ww: fusedkit.linear_relu(a, ww, b))(a3, ws), vmap(fl)(a3, ws))
        torch.testing.assert_close(
            grad(lambda ww: fusedkit.matmul(a3[0], ww.t(), b, act).sum())(w),
            grad(lambda ww: _ref_act(a3[0] @ ww.t() + b, act).sum())(w),
        )
        torch.testing.assert_close(
            vmap(grad(lambda a: fusedkit.linear_relu(a, w, b).sum()))(a3), vmap(grad(lambda a: fl(a, w).sum()))(a3)
        )


def test_vmap_promotes_a_per_example_0d_operand_as_torch_does():
    from torch.func import vmap

    for a, b in (
        (torch.randn(3, 4).half(), torch.randn(3)),
        (torch.randn(3, 4), torch.randn(3).double()),
        (torch.randn(3, 4).bfloat16(), torch.randn(3).half()),
    ):
        a, b = a.to(DEVICE), b.to(DEVICE)
        ours, theirs = vmap(fusedkit.add_relu)(a, b), vmap(lambda u, v: torch.relu(u + v))(a, b)
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs)


def test_out_under_torch_func():
    from torch.func import grad, vmap

    x, out = rand((3, 4), torch.float32, DEVICE), torch.zeros(3, 4, device=DEVICE)
    vmap(lambda a, o: fusedkit.add(a, 1, out=o))(x, out)
    assert torch.equal(out.cpu(), x.cpu() + 1)

    def through_a_buffer(a):  # out= on tensors grad does not differentiate through: allowed, as in torch
        buf = torch.empty(3, 4, device=DEVICE)
        fusedkit.add_relu(x, 1.0, out=buf)
        return (a * buf).sum()

    torch.testing.assert_close(grad(through_a_buffer)(x), torch.relu(x + 1))
    with pytest.raises(FusedkitError, match="out= does not support automatic differentiation"):
        grad(lambda a: fusedkit.add(a, 1, out=torch.zeros(4, device=DEVICE)).sum())(rand((4,), torch.float32, DEVICE))


def _ref_act(v, act):
    return v if act is None else torch.relu(v) if act == "relu" else F.gelu(v)


# 10. Threads.


def test_concurrent_calls_from_threads_are_correct():
    cases = []
    for _k, (shape, dtype) in enumerate(
        [
            ((33, 17), torch.float32),
            ((8, 64), torch.bfloat16),
            ((129,), torch.int64),
            ((5, 6, 7), torch.float16),
            ((16, 16), torch.float64),
            ((3, 40), torch.int32),
        ]
    ):
        x, y = rand(shape, dtype, DEVICE), rand(shape[-1:], dtype, DEVICE)
        cases.append(
            (
                x,
                y,
                torch.relu(x.cpu().double() + y.cpu().double())
                if dtype.is_floating_point
                else torch.relu(x.cpu() + y.cpu()),
            )
        )
    a, b = rand((12, 20), torch.float32, DEVICE), rand((20, 9), torch.float32, DEVICE)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(4):
                x, y, expected = cases[(t + i) % len(cases)]
                out = poisoned(x.shape, x.dtype, DEVICE)
                fusedkit.add_relu(x, y, out=out)
                assert_matches_reference(out, expected)
                view = x.t() if x.dim() == 2 else x
                wide = view.cpu().double() if view.is_floating_point() else view.cpu()
                assert_matches_reference(fusedkit.add_relu(view, 0), torch.relu(wide))
                assert_rel_err(
                    fusedkit.matmul(a, b, None, "relu"),
                    torch.relu(a.cpu().double() @ b.cpu().double()),
                    matmul_rel_err(torch.float32),
                )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


# 11. Broadcasts of any rank.


def test_broadcasts_of_more_than_six_unmergeable_dims_work():
    x = rand((2, 1, 2, 1, 2, 1, 2), torch.float32, DEVICE)
    y = rand((1, 2, 1, 2, 1, 2, 1), torch.float32, DEVICE)
    assert torch.equal(fusedkit.add_relu(x, y).cpu(), torch.relu(x.cpu() + y.cpu()))
    z = rand((3, 1, 2, 1, 3, 1, 2, 1, 2), torch.float32, DEVICE)
    w = rand((1, 2, 1, 3, 1, 2, 1, 2, 1), torch.float32, DEVICE).transpose(0, 8)
    out = poisoned(torch.broadcast_shapes(z.shape, w.shape), torch.float32, DEVICE)
    fusedkit.add(z, w, alpha=2, out=out)
    assert torch.equal(out.cpu(), torch.add(z.cpu(), w.cpu(), alpha=2))


# 12. Every bad input raises a FusedkitError (with the built-in base kept).


def test_every_bad_input_raises_a_fusedkit_error():
    x = rand((3,), torch.float32, DEVICE)
    cases = [
        (lambda: fusedkit.matmul(x[None], x[:, None], activation="tanh"), ValueError),
        (lambda: fusedkit.elementwise("no_such_kernel", x), KeyError),
        (lambda: fusedkit.elementwise(42, x), TypeError),
        (lambda: fusedkit.elementwise("add", x), TypeError),
        (lambda: fusedkit.elementwise("add", x, x, beta=2), TypeError),
        (lambda: fusedkit.add(x, x, alpha=1e300), ValueError),
        (lambda: registry.unregister("no_such_kernel"), KeyError),
        (lambda: registry.register("add"), TypeError),
        (lambda: fusedkit.add(x, 2**64), OverflowError),
        (lambda: AddReLU(inplace=True)(x, "y"), TypeError),
        (lambda: fusedkit.elementwise("t_no_backward", x.detach().requires_grad_(), x), NotImplementedError),
    ]
    registry.register(
        registry.ElementwiseKernel(
            name="t_no_backward",
            math=registry.get("relu_grad").math,
            reference=lambda v, w, alpha=1: v,
            arg_names=("v", "w"),
            unfused=("torch.clone",),
        ),
        replace=True,
    )
    try:
        for call, base in cases:
            with pytest.raises(FusedkitError) as info:
                call()
            assert isinstance(info.value, base), (info.value, base)
    finally:
        registry.unregister("t_no_backward")
    assert issubclass(SignatureError, TypeError) and issubclass(UnknownKernelError, KeyError)
    assert issubclass(NotDifferentiableError, NotImplementedError)
    assert str(UnknownKernelError("plain message")) == "plain message"


# 13. out= rules as torch's.


def test_out_takes_any_dtype_the_result_casts_to():
    x, y = rand((7, 5), torch.float16, DEVICE), rand((5,), torch.float16, DEVICE)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        out = poisoned((7, 5), dtype, DEVICE)
        fusedkit.add_relu(x, y, out=out)
        # Rounded to the float16 result first, then converted, as torch does.
        assert torch.equal(out.cpu(), torch.relu(torch.add(x.cpu(), y.cpu())).to(dtype))
    i = rand((6,), torch.int64, DEVICE)
    out = poisoned((6,), torch.float32, DEVICE)
    assert torch.equal(fusedkit.add(i, i, out=out).cpu(), (i.cpu() * 2).float())
    # Dtypes the kernel cannot store, which torch casts to: through a temporary and copy_.
    small = torch.zeros(6, dtype=torch.int16, device=DEVICE)
    assert torch.equal(fusedkit.add(i, 1, out=small).cpu(), (i.cpu() + 1).to(torch.int16))
    z = torch.zeros(7, 5, dtype=torch.complex64, device=DEVICE)
    fusedkit.add(x.float(), 1, out=z)
    assert torch.equal(z.cpu().real, x.cpu().float() + 1) and not z.imag.any()
    with pytest.raises(DTypeError, match="can't be cast"):
        fusedkit.add(x, y, out=torch.empty(7, 5, dtype=torch.int32, device=DEVICE))


def test_out_sharing_memory_follows_torch_and_never_answers_wrong():
    base = rand((20,), torch.float32, DEVICE)
    b = base.clone()
    fusedkit.add(b[0::2], 1, out=b[1::2])  # no shared element: torch allows it
    expected = base.cpu().clone()
    expected[1::2] = base.cpu()[0::2] + 1
    assert torch.equal(b.cpu(), expected)
    b = base.clone()
    fusedkit.add(b[0:16:2], 1, out=b[2:18:2])  # shared elements, strided: torch checks nothing
    expected = base.cpu().clone()
    expected[2:18:2] = base.cpu()[0:16:2] + 1  # the answer, as if the input were read first
    assert torch.equal(b.cpu(), expected)
    with pytest.raises(OverlapError, match="partially overlaps"):
        fusedkit.add(b[0:10], 1, out=b[1:11])  # both dense: torch refuses


# 14. New results take torch's layout.


def test_result_layout_matches_torch():
    nchw = rand((2, 3, 4, 5), torch.float32, DEVICE).contiguous(memory_format=torch.channels_last)
    bias = rand((3, 1, 1), torch.float32, DEVICE)
    dense = rand((2, 3, 4, 5), torch.float32, DEVICE)
    for operands in (
        (nchw, dense),
        (dense, nchw),
        (nchw, bias),
        (bias, nchw),
        (nchw, 2.0),
        (nchw.permute(0, 2, 3, 1), dense.permute(0, 2, 3, 1)),
    ):
        ours = fusedkit.add(*operands)
        theirs = torch.add(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in operands))
        assert ours.stride() == theirs.stride(), [getattr(t, "shape", t) for t in operands]
        assert torch.equal(ours.cpu(), theirs)
    assert fusedkit.add_relu(nchw, dense).is_contiguous(memory_format=torch.channels_last)
    empty = rand((0, 2, 2, 1), torch.float32, DEVICE).permute(3, 1, 2, 0).permute(3, 1, 2, 0)
    assert (
        fusedkit.add(empty, rand((2, 1, 1), torch.float32, DEVICE)).stride()
        == torch.add(empty.cpu(), torch.ones(2, 1, 1)).stride()
    )


@pytest.mark.slow  # a second pytest session
def test_the_pytorch_path_keeps_them_too():
    """The same module on the PyTorch path (CPU tensors without Triton's interpreter)."""
    if ON_GPU or PYTORCH_PATH:
        pytest.skip("runs from an interpreter session on a CPU machine")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    env["FUSEDKIT_TEST_CPU_BACKEND"] = "torch"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "failed" not in proc.stdout.splitlines()[-1]


def test_this_module_runs_on_the_backend_it_names():
    assert fusedkit.backend_for(DEVICE) == ("triton" if ON_GPU else "torch" if PYTORCH_PATH else "interpreter")


@pytest.mark.slow  # torch.compile
def test_compiled_calls_take_new_python_numbers():
    # A number that varies between calls is traced as a SymFloat / SymInt: it must be taken.
    f = torch.compile(lambda x, s: fusedkit.add_relu(x, s, alpha=2), fullgraph=True)
    g = torch.compile(lambda x, a: fusedkit.add(x, x, alpha=a), fullgraph=True)
    x = rand((8,), torch.float32, DEVICE)
    for s in (1.5, 2.5, -0.25):
        assert_matches_reference(f(x, s), torch.relu(x.cpu().double() + 2 * s), torch.float32)
    for a in (2, 3, 0.5):
        assert_matches_reference(g(x, a), torch.add(x.cpu().double(), x.cpu().double(), alpha=a), torch.float32)


def test_jit_trace_is_refused_not_recorded_without_the_kernel():
    """torch.jit.trace cannot record a Triton launch: a trace would silently lack the kernel."""
    x, y = rand((5, 7), torch.float32, DEVICE), rand((5, 7), torch.float32, DEVICE)
    w = rand((7, 3), torch.float32, DEVICE)
    for _ in range(2):  # a kept signature too
        fusedkit.add_relu(x, y)
        fusedkit.matmul(x, w, None, "relu")
    with pytest.raises(fusedkit.TracingError, match="torch.jit.trace"):
        torch.jit.trace(lambda a, b: fusedkit.add_relu(a, b), (x, y))
    with pytest.raises(fusedkit.TracingError, match="torch.jit.trace"):
        torch.jit.trace(lambda a: fusedkit.matmul(a, w, None, "relu"), (x,))
    assert isinstance(fusedkit.TracingError("x"), NotImplementedError)


def test_forward_mode_ad_answers_with_the_tangent_every_time():
    # A dual tensor's call carries its tangent (tests/test_forward_ad.py checks the values), also
    # the second time, when a kept launch (or the C++ table) would take a plain call.
    import torch.autograd.forward_ad as fwAD

    x, t, w = (
        rand((3, 4), torch.float32, DEVICE),
        rand((3, 4), torch.float32, DEVICE),
        rand((4, 2), torch.float32, DEVICE),
    )
    for _ in range(2):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, t)
            for call in (
                lambda: fusedkit.add_relu(dual, 1.0),
                lambda: fusedkit.add(x, dual),
                lambda: fusedkit.silu_mul(dual, x),
                lambda: fusedkit.matmul(dual, w),
            ):
                assert fwAD.unpack_dual(call()).tangent is not None
            with pytest.raises(fusedkit.NotDifferentiableError, match="forward-mode AD"):
                fusedkit.add(dual, x, out=torch.empty_like(x))
            assert fwAD.unpack_dual(fusedkit.add_relu(x, 1.0)).tangent is None  # no tangent: none out
        fusedkit.add_relu(x, x)
        fusedkit.matmul(x, w)
