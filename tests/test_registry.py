"""The registry: validation, user kernels of every arity, byte models."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401 - Triton needs it visible to jit functions
from conftest import DEVICE
from helpers import rand

import fusedkit
from fusedkit.errors import ArgumentError, DTypeError, SignatureError
from fusedkit.kernels.activations import relu
from fusedkit.registry import ElementwiseKernel, Traffic, get, register, unregister
from fusedkit.runtime import elementwise as ew
from fusedkit.testing import assert_matches_reference, reference_result


@triton.jit
def _neg_relu_math(x):
    return relu(-x)


@triton.jit
def _mul_add_relu_math(a, b, c, alpha):
    return relu(a * b + c * alpha)


@triton.jit
def _mul_math(x, y):
    return x * y


def _spec(**overrides):
    base = dict(
        name="neg_relu",
        math=_neg_relu_math,
        reference=lambda x: torch.relu(torch.neg(x)),
        arg_names=("x",),
        param=None,
        formula="relu(-x)",
        unfused=("torch.neg", "torch.relu"),
    )
    base.update(overrides)
    return ElementwiseKernel(**base)


@pytest.fixture
def user_kernels():
    unary = register(_spec())
    ternary = register(
        ElementwiseKernel(
            name="mul_add_relu",
            math=_mul_add_relu_math,
            arg_names=("a", "b", "c"),
            reference=lambda a, b, c, alpha=1: torch.relu(torch.add(torch.mul(a, b), c, alpha=alpha)),
            formula="relu(a * b + alpha * c)",
            unfused=("torch.mul", "torch.add", "torch.relu"),
        )
    )
    yield unary, ternary
    unregister("neg_relu")
    unregister("mul_add_relu")


def test_builtins_listed():
    assert {"add", "add_relu"} <= set(fusedkit.registry.names())
    assert get("add_relu").formula == "relu(x + alpha * y)"
    assert get("add_relu").intermediates == 1 and get("add").intermediates == 0


@pytest.mark.parametrize(
    "bad,error,words",
    [
        ({"name": "not an identifier"}, ValueError, "identifier"),
        ({"math": lambda x: x}, TypeError, "@triton.jit"),
        ({"reference": 3}, TypeError, "callable"),
        ({"arg_names": ()}, ValueError, "arity"),
        ({"arg_names": ("x", "x")}, ValueError, "distinct"),
        ({"arg_names": ("x", "y")}, ValueError, "math takes 1 arguments, expected 2"),
        ({"dtypes": (torch.complex64,)}, ValueError, "subset"),
        ({"dtypes": ()}, ValueError, "subset"),
        ({"param": "alpha"}, ValueError, "math takes 1 arguments, expected 2"),
        ({"unfused": ()}, ValueError, "unfused"),
        ({"backward_kernels": lambda p: ()}, ValueError, "backward_kernels"),
    ],
)
def test_spec_validation(bad, error, words):
    with pytest.raises(error, match=words):
        _spec(**bad)


# Each field's wrong type or value, as a hostile caller gives it (issue 45): the entry is refused
# with the class the built-in expects and the field's name, never taken as another value.
_BAD_FIELDS = [
    ({"name": 3}, DTypeError, "kernel name must be a str, got int 3"),
    ({"arg_names": (1, 2)}, DTypeError, "arg_names must be a tuple of operand names, got int 1"),
    ({"arg_names": "x"}, DTypeError, "arg_names must be a tuple of operand names, got str 'x'"),
    ({"dtypes": torch.float32}, DTypeError, "dtypes must be a tuple of torch dtypes, got dtype torch.float32"),
    ({"dtypes": ("float32",)}, DTypeError, "dtypes must be a tuple of torch dtypes, got str 'float32'"),
    ({"param": 3, "math": _mul_math}, DTypeError, "param must be a str or None, got int 3"),
    ({"param": "out", "math": _mul_math}, ArgumentError, "param 'out' is a name the call reserves"),
    ({"param": "kernel", "math": _mul_math}, ArgumentError, "param 'kernel' is a name the call reserves"),
    ({"param": "x", "math": _mul_math}, ArgumentError, "param 'x' is a name the call reserves"),
    ({"param_default": "1"}, DTypeError, "param_default must be a real number, got str '1'"),
    ({"param_default": True}, DTypeError, "param_default must be a real number, got bool True"),
    ({"formula": 3}, DTypeError, "formula must be a str, got int 3"),
    ({"unfused": "torch.sub"}, DTypeError, "unfused must be a tuple of op names, got str 'torch.sub'"),
    ({"unfused": ("torch.neg", None)}, DTypeError, "unfused must be a tuple of op names, got NoneType None"),
    ({"unfused": ("torch.neg", "")}, ArgumentError, "unfused must name the eager ops"),
    ({"saves": ["inputs"]}, DTypeError, "saves must be a str"),
    (
        {"backward": lambda g, s, p: (g,), "saves": "inputs", "backward_kernels": 3},
        DTypeError,
        "backward_kernels must be callable or None",
    ),
    ({"outputs": True}, DTypeError, "outputs must be an int, 1 or 2, got bool True"),
    ({"outputs": 2.0}, DTypeError, "outputs must be an int, 1 or 2, got float 2.0"),
]


@pytest.mark.parametrize(
    "bad,error,words", _BAD_FIELDS, ids=[next(iter(b)) + f"-{i}" for i, (b, _, _) in enumerate(_BAD_FIELDS)]
)
def test_every_field_is_checked_when_the_entry_is_made(bad, error, words):
    with pytest.raises(error, match=re.escape(f"{'' if 'name' in bad else 'neg_relu: '}{words}")):
        _spec(**bad)


def test_a_list_for_a_tuple_field_is_stored_as_a_tuple():
    spec = _spec(arg_names=["x"], dtypes=[torch.float32], unfused=["torch.neg", "torch.relu"])
    assert (spec.arg_names, spec.dtypes, spec.unfused) == (("x",), (torch.float32,), ("torch.neg", "torch.relu"))
    hash(spec)  # a frozen entry hashes its fields: no list among them
    x = torch.empty(1024)
    assert spec.bytes_unfused(x) == Traffic(2 * 1024 * FP32, 2 * 1024 * FP32)  # one intermediate


@triton.jit
def _sub_math(x, y):
    return x - y


def _one_gradient(grad, saved, _param):
    return (grad,)


@pytest.mark.parametrize(
    "backward,words",
    [
        (_one_gradient, "sub_test: backward returned 1 gradient(s) for its 2 operand(s) (x, y)"),
        (lambda grad, saved, _param: grad, "sub_test: backward returned a Tensor for its 2 operand(s)"),
        (lambda grad, saved, _param: (grad, 1.0), "sub_test: backward returned a float as y's gradient"),
    ],
    ids=["one-for-two", "not-a-sequence", "not-a-tensor"],
)
def test_a_backward_giving_the_wrong_gradients_is_refused(backward, words):
    """A user's backward must give one gradient (a tensor or None) per operand: one for two
    failed with an IndexError inside autograd, and the C++ node's ``zip`` dropped the second."""
    kernel = register(
        ElementwiseKernel(
            name="sub_test",
            math=_sub_math,
            reference=lambda x, y: torch.sub(x, y),
            param=None,
            formula="x - y",
            unfused=("torch.sub",),
            saves="inputs",
            backward=backward,
        )
    )
    try:
        a = rand((4, 5), torch.float32, DEVICE).requires_grad_()
        b = rand((4, 5), torch.float32, DEVICE).requires_grad_()
        with pytest.raises(SignatureError, match=re.escape(words)):
            fusedkit.elementwise("sub_test", a, b).sum().backward()
        # The C++ autograd node's backward (dry run: called as the node calls it).
        signature = ((torch.float32, (4, 5), (5, 1)),) * 2
        node_backward = fusedkit.autograd.native_backward(kernel, None, signature, DEVICE, (4, 5), torch.float32)[0]
        with pytest.raises(SignatureError, match=re.escape(words)):
            node_backward(torch.ones(4, 5), (a.detach(), b.detach()))
    finally:
        unregister("sub_test")


_PLANNED = [k for k in (get(n) for n in fusedkit.registry.names()) if k.backward_kernels is not None]


@pytest.mark.parametrize("kernel", _PLANNED, ids=[k.name for k in _PLANNED])
@pytest.mark.parametrize("param", [1, 2.5, -0.5])
def test_backward_kernels_state_the_backward(kernel, param):
    """A kernel's ``backward_kernels`` (what the C++ autograd node launches, on the gradient
    and what the call saved) gives the same gradients as its ``backward`` (what the Python
    path runs), bit for bit."""
    operands = [rand((33, 17), torch.float32, DEVICE) for _ in range(kernel.arity)]
    value = param if kernel.param is not None else None
    out = fusedkit.elementwise(kernel, *operands, **({kernel.param: param} if kernel.param else {}))
    grad = rand(out.shape, out.dtype, DEVICE)
    saved = (out,) if kernel.saves == "output" else tuple(operands)
    expected = kernel.backward(grad, saved[0] if kernel.saves == "output" else saved, value)
    steps = kernel.backward_kernels(value)
    if steps is None:  # no plan for this parameter: the Python backward runs
        assert fusedkit.autograd._plan(kernel, value) == ()
        return
    assert len(steps) == kernel.arity == len(expected)
    for step, want in zip(steps, expected):
        if step is None:
            assert want is None
            continue
        step_kernel, step_param, result = fusedkit.autograd._step(*step)
        if step_kernel.outputs == 2:
            got = ew.run_pair(step_kernel, (grad, *saved), None)[result]
        else:
            got = fusedkit.elementwise(
                step_kernel, grad, *saved, **({step_kernel.param: step_param} if step_kernel.param else {})
            )
        assert torch.equal(got, want)
    assert fusedkit.autograd._plan(kernel, value)  # and the C++ node takes the plan


def test_spec_is_frozen_and_names_are_guarded():
    spec = get("add")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    with pytest.raises(ValueError, match="built-in kernel and cannot be replaced"):
        register(dataclasses.replace(spec))
    with pytest.raises(ValueError, match="built in"):
        unregister("add")
    with pytest.raises(TypeError):
        register("add")


def test_user_unary_kernel(user_kernels):
    unary, _ = user_kernels
    assert "neg_relu" in fusedkit.registry.names()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = rand((13, 7), dtype, DEVICE)
        for view in (x, x.t()):
            assert_matches_reference(fusedkit.elementwise("neg_relu", view), reference_result(unary, (view,)))
    with pytest.raises(TypeError, match="takes no keyword"):
        fusedkit.elementwise("neg_relu", x, alpha=2)
    with pytest.raises(NotImplementedError, match="declares no backward"):
        fusedkit.elementwise("neg_relu", rand((3,), torch.float32, DEVICE).requires_grad_())


def test_user_ternary_kernel_with_broadcast_and_scalars(user_kernels):
    _, ternary = user_kernels
    a = rand((6, 1, 5), torch.float32, DEVICE)
    b = rand((4, 5), torch.float16, DEVICE).t()[:1].t()  # (5, 1) -> broadcast, strided
    c = rand((5,), torch.float32, DEVICE)
    for ops in ((a, b, c), (a, 2.0, c), (1.5, b, c), (a, b, -1.0)):
        for alpha in (1, -2.5):
            result = fusedkit.elementwise(ternary, *ops, alpha=alpha)
            assert_matches_reference(result, reference_result(ternary, ops, alpha), result.dtype)


FP32 = 4


def test_byte_model_contiguous():
    x = torch.empty(1000)
    spec = get("add_relu")
    assert spec.bytes_fused(x, x) == Traffic(2000 * FP32, 1000 * FP32)
    assert spec.bytes_unfused(x, x) == Traffic(3000 * FP32, 2000 * FP32)
    assert spec.bytes_unfused(x, x).total / spec.bytes_fused(x, x).total == pytest.approx(5 / 3)
    assert get("add").bytes_unfused(x, x) == get("add").bytes_fused(x, x)


def test_byte_model_broadcast_views_and_scalars():
    spec = get("add_relu")
    x, bias = torch.empty(64, 32), torch.empty(32)
    assert spec.bytes_fused(x, bias) == Traffic((64 * 32 + 32) * FP32, 64 * 32 * FP32)
    assert spec.bytes_fused(x.t(), x.t()) == spec.bytes_fused(x, x)  # a transpose moves the same bytes
    assert spec.bytes_fused(x, 2.0) == Traffic(64 * 32 * FP32, 64 * 32 * FP32)
    assert spec.bytes_fused(bias.expand(64, 32), x).read == (32 + 64 * 32) * FP32
    # Reading every other fp32 element moves whole sectors: 8 bytes per element used.
    wide = torch.empty(64, 64)
    assert spec.bytes_fused(wide[:, ::2], x).read == 64 * 32 * 8 + 64 * 32 * FP32
    # A stride of 64 bf16 elements (128 bytes) costs one 32-byte sector per element.
    assert fusedkit.registry.tensor_read_bytes(torch.empty(640, dtype=torch.bfloat16)[::64]) == 10 * 32
    # Mixed dtypes write the promoted dtype.
    assert spec.bytes_fused(torch.empty(10, dtype=torch.float16), torch.empty(10)).written == 10 * FP32
    assert spec.bytes_fused(torch.empty(0), torch.empty(0)) == Traffic(0, 0)


def test_user_kernel_saving_inputs_is_differentiable():
    def backward(grad, saved, _param):
        x, y = saved
        return (
            fusedkit.elementwise("mul_test", grad, y) if isinstance(y, torch.Tensor) else grad * y,
            fusedkit.elementwise("mul_test", grad, x) if isinstance(x, torch.Tensor) else grad * x,
        )

    register(
        ElementwiseKernel(
            name="mul_test",
            math=_mul_math,
            reference=lambda x, y: torch.mul(x, y),
            param=None,
            formula="x * y",
            unfused=("torch.mul",),
            saves="inputs",
            backward=backward,
        )
    )
    try:
        a = rand((4, 5), torch.float64, DEVICE).requires_grad_()
        b = rand((5,), torch.float64, DEVICE).requires_grad_()
        assert torch.autograd.gradcheck(lambda p, q: fusedkit.elementwise("mul_test", p, q), (a, b))
        assert torch.autograd.gradcheck(lambda p: fusedkit.elementwise("mul_test", p, 2.5), (a,))
    finally:
        unregister("mul_test")


def test_unregistered_kernel_objects_are_refused_where_the_op_needs_the_registry():
    spec = _spec(name="never_registered", backward=lambda grad, saved, param: (grad,))
    x = rand((3,), torch.float32, DEVICE)
    assert fusedkit.elementwise(spec, x).shape == (3,)  # eager: fine
    with pytest.raises(KeyError, match="never_registered"):
        fusedkit.elementwise(spec, x.requires_grad_())


def test_the_traced_result_dtype_is_torchs():
    # Under Dynamo the result dtype is worked out from the operands' dtypes and ranks alone
    # (torch 2.11's Dynamo refused elementwise_dtypes): the same as torch's for every mix of
    # ranks, dtypes and numbers of up to three operands.
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    from fusedkit.registry import _traced_result_dtype

    dtypes = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float64]
    values = [torch.ones(shape, dtype=d) for d in [*dtypes, torch.complex64] for shape in ((2,), ())]
    values += [True, 3, 2.5, 1j]
    for k in (1, 2, 3):
        for combo in itertools.product(values, repeat=k):
            if any(isinstance(v, torch.Tensor) for v in combo):
                want = elementwise_dtypes(*combo, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
                assert _traced_result_dtype(combo) == want, combo
    # a float and a complex number take the default dtype's kinds (float16's complex is complex32)
    for default in (torch.float16, torch.bfloat16, torch.float64):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            for combo in itertools.product(values, repeat=2):
                if any(isinstance(v, torch.Tensor) for v in combo):
                    assert _traced_result_dtype(combo) == torch.result_type(*combo), (default, combo)
        finally:
            torch.set_default_dtype(previous)
