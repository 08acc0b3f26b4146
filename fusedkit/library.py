"""fusedkit's own ops, with their derivatives beside them: the registry entries ``add``,
``add_relu`` and ``relu_grad``; the gates ``silu_mul``, ``gelu_mul`` and ``gelu_tanh_mul``
and bias + GELU ``add_gelu`` and ``add_gelu_tanh`` with their gradients; the matmul
activations' gradients and the matmul's own.

Derivatives call the public dispatch (:mod:`fusedkit.dispatch`), so a gradient of a
gradient is recorded, transformed or traced like any call; that is why they live here,
above the autograd layer, which receives them as data (a registry entry's ``backward``,
:func:`fusedkit.autograd.register_matmul_backward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import autograd, dispatch
from .kernels import activations
from .registry import FLOAT_DTYPES, ElementwiseKernel, RowKernel, register, register_builtin, register_row, result_dtype
from .runtime import elementwise as ew
from .runtime import norm as row_norm
from .runtime.matmul import NEEDS_PRE

__all__ = [
    "ADD",
    "ADD_GELU",
    "ADD_GELU_TANH",
    "ADD_LAYER_NORM",
    "ADD_RELU",
    "ADD_RMS_NORM",
    "LAYER_NORM",
    "RMS_NORM",
    "GELU_GRAD",
    "GELU_MUL",
    "GELU_MUL_GRAD",
    "GELU_TANH_GRAD",
    "GELU_TANH_MUL",
    "GELU_TANH_MUL_GRAD",
    "RELU_GRAD",
    "SILU_GRAD",
    "SILU_MUL",
    "SILU_MUL_GRAD",
    "activation_grad",
    "matmul_backward",
]


def _scaled(grad, alpha):
    """``alpha * grad`` as torch's AddBackward gives it: ``-0.0 + alpha * grad`` in one kernel
    (-0.0, the sum's identity, keeps a -0.0 product's sign, which +0 would flip)."""
    return grad if alpha == 1 else dispatch.elementwise(ADD, (-0.0, grad), alpha, None)


def _add_backward(grad, saved, alpha):
    # d/dx = grad itself (no copy); d/dy = alpha * grad.
    return grad, _scaled(grad, alpha)


def _add_relu_backward(grad, out, alpha):
    # Only the output is saved: relu's mask is out > 0, so x and y need not be kept.
    gx = dispatch.elementwise(RELU_GRAD, (grad, out), 1, None)
    return gx, gx if alpha == 1 else dispatch.elementwise(RELU_GRAD, (grad, out), alpha, None)


def _add_relu_backward_kernels(alpha):
    # _add_relu_backward's two gradients as kept launches of relu_grad on (grad, out): one
    # launch, and the same parameter, where alpha == 1.
    return ("relu_grad", 1), ("relu_grad", 1 if alpha == 1 else alpha)


def _relu_grad_reference(grad, out, alpha=1):
    dtype = torch.result_type(grad, out)
    device = (grad if isinstance(grad, torch.Tensor) else out).device
    g = torch.as_tensor(grad, dtype=dtype, device=device) * alpha
    o = torch.as_tensor(out, device=device)
    # NaN in ``out`` passes the gradient, as PyTorch's threshold_backward does.
    return torch.where(o <= 0, torch.zeros((), dtype=dtype, device=device), g)


def _relu_grad_backward(grad, saved, alpha):
    # Linear in its gradient input with the same mask; no gradient flows to ``out``.
    return dispatch.elementwise(RELU_GRAD, (grad, saved[1]), alpha, None), None


ADD = register_builtin(
    ElementwiseKernel(
        name="add",
        math=activations.add_math,
        reference=lambda x, y, alpha=1: torch.add(x, y, alpha=alpha),
        formula="x + alpha * y",
        unfused=("torch.add",),
        backward=_add_backward,
    )
)

ADD_RELU = register_builtin(
    ElementwiseKernel(
        name="add_relu",
        math=activations.add_relu_math,
        reference=lambda x, y, alpha=1: torch.relu(torch.add(x, y, alpha=alpha)),
        formula="relu(x + alpha * y)",
        unfused=("torch.add", "torch.relu"),
        saves="output",
        backward=_add_relu_backward,
        backward_kernels=_add_relu_backward_kernels,
    )
)

RELU_GRAD = register_builtin(
    ElementwiseKernel(
        name="relu_grad",
        math=activations.relu_grad_math,
        reference=_relu_grad_reference,
        arg_names=("grad", "out"),
        dtypes=FLOAT_DTYPES,
        formula="where(out <= 0, 0, alpha * grad)",
        unfused=("torch.mul", "torch.where"),
        saves="inputs",
        backward=_relu_grad_backward,
    )
)


def _aten_operands(grad, pre):
    """Both operands as tensors of their promoted dtype and shape (the aten backward ops take
    no numbers and no broadcasting)."""
    dtype = torch.result_type(grad, pre)
    device = (grad if isinstance(grad, torch.Tensor) else pre).device
    # (a number straight to ``dtype``: through the default dtype it would round to float32 first)
    return torch.broadcast_tensors(*(torch.as_tensor(v, dtype=dtype, device=device) for v in (grad, pre)))


def _activation_grad_entry(name: str, math, aten_backward, formula: str) -> ElementwiseKernel:
    """The gradient through a matmul epilogue's activation from its input (the kept
    pre-activation), in one kernel with fp32 math for half types. Its reference is PyTorch's
    own backward op; it declares no backward of its own (a gradient of it takes the reference)."""
    return register_builtin(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=lambda grad, pre: aten_backward(*_aten_operands(grad, pre)),
            arg_names=("grad", "pre"),
            dtypes=FLOAT_DTYPES,
            param=None,
            formula=formula,
            unfused=(f"torch.ops.aten.{name.removesuffix('_grad').split('_')[0]}_backward",),
        )
    )


GELU_GRAD = _activation_grad_entry(
    "gelu_grad", activations.gelu_grad_math, torch.ops.aten.gelu_backward, "grad * gelu'(pre)"
)
GELU_TANH_GRAD = _activation_grad_entry(
    "gelu_tanh_grad",
    activations.gelu_tanh_grad_math,
    lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate="tanh"),
    "grad * gelu_tanh'(pre)",
)


def _silu_backward(g, v):
    # (aten's silu_backward has no derivative of its own, backward or forward: a second
    # derivative, forward-mode AD and hessians need this composition)
    s = torch.sigmoid(v)
    return g * (s * (1 + v * (1 - s)))


def _silu_grad_reference(grad, pre):
    """``grad * silu'(pre)`` with torch's differentiable ops, in float32 for half types as
    aten's ``silu_backward`` computes it."""
    dtype = torch.result_type(grad, pre)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return _silu_backward(*(v.to(wide) for v in _aten_operands(grad, pre))).to(dtype)


SILU_GRAD = _activation_grad_entry("silu_grad", activations.silu_grad_math, _silu_grad_reference, "grad * silu'(pre)")
#: The kernel that takes a gradient through each activation that keeps its pre-activation.
_ACTIVATION_GRAD = {"gelu": GELU_GRAD, "gelu_tanh": GELU_TANH_GRAD, "silu": SILU_GRAD}


def activation_grad(grad: torch.Tensor, saved: torch.Tensor, activation: str | None) -> torch.Tensor:
    """dL/d(pre-activation) from dL/d(output), in one kernel; ``saved`` is the output for ReLU,
    else the pre-activation. A gradient of this gradient (``create_graph``, ``torch.func``) runs
    PyTorch's backward op instead, which is differentiable."""
    if activation is None:
        return grad
    if activation == "relu":
        return dispatch.elementwise(RELU_GRAD, (grad, saved), 1, None)  # torch's threshold_backward: NaN passes
    kernel = _ACTIVATION_GRAD[activation]
    if autograd.functorch_active() or (torch.is_grad_enabled() and (grad.requires_grad or saved.requires_grad)):
        return kernel.reference(grad, saved)
    return dispatch.elementwise(kernel, (grad, saved), None, None)


# --- Gates (SwiGLU, GeGLU) and bias + GELU -----------------------------------------------
# A gate keeps its inputs, never an intermediate (the activation is recomputed in the backward:
# one more read, none of the forward's extra memory), and takes its gradients in one kernel.
# Bias + GELU keeps the sum, as torch does, written beside the result in the forward's launch.

#: Whether a profiler is recording (a C call).
_profiling = torch._C._autograd._profiler_enabled


def _float64_if_number(v) -> torch.Tensor:
    """A number as a float64 0-d tensor (it promotes as the number would), a tensor as it is."""
    return v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)


def _opmath(*values) -> tuple[list, torch.dtype]:
    """The values with tensors of a half result dtype in float32, and that dtype: a
    composition computing as the kernels do (float32, rounded once at the end), so a traced
    backward gives what the eager one gives."""
    dtype = result_dtype(values)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return [
        v.to(wide) if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v for v in values
    ], dtype


def _needs_composition(*values) -> bool:
    """Whether a gradient must be computed with differentiable torch ops: a gradient of it is
    recorded (``create_graph``), a ``torch.func`` transform runs, or a trace sees it (Dynamo,
    fake tensors); else fusedkit's kernels run it (through registered ops a watching dispatch
    mode sees: ``dispatch.observed``)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return (
        autograd.functorch_active()
        or (dispatch.tracing(tensors) and not dispatch.observed(tensors))
        or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )


def _pair(kernel: ElementwiseKernel, operands: tuple):
    """Both results of a two-output kernel: launched, or through ``fusedkit::elementwise_pair``
    where a dispatch mode watches; in a profiler range as dispatch gives every other kernel."""
    run = autograd.call_pair if dispatch.observed(operands) else (lambda k, ops: ew.run_pair(k, ops, None))
    if _profiling():
        with torch.profiler.record_function(f"fusedkit::{kernel.name}"):
            return run(kernel, operands)
    return run(kernel, operands)


def _gelu_backward(approximate: str):
    """``g * gelu'(v)`` as torch's (differentiable) backward op computes it."""
    return lambda g, v: torch.ops.aten.gelu_backward(*_aten_operands(g, v), approximate=approximate)


def register_gate(
    name: str, math, grad_math, activation, activation_backward, formula: str = "act", *, builtin: bool = False
) -> ElementwiseKernel:
    """Register ``activation(a) * b``, a gate (SwiGLU's, GeGLU's), with its fused backward,
    from two small ``@triton.jit`` functions: ``math(a, b) -> act(a) * b`` and
    ``grad_math(grad, a, b) -> (grad * b * act'(a), grad * act(a))``. ``activation(v)`` and
    ``activation_backward(g, v) -> g * act'(v)`` are their PyTorch references (differentiable
    torch ops: a gradient of a gradient, ``torch.func`` and traces compute with them).

    The entry keeps a and b for its backward, only a where only b's gradient is asked for
    (which is then the gate itself on ``(a, grad)``), and takes both gradients in one launch of
    ``grad_math``'s two-output kernel (``<name>_grad``), from C++ where the launch is kept.
    ``formula`` names the activation in the docs' op table; ``builtin``: one of fusedkit's own
    (fixed from then on), else registered as :func:`fusedkit.registry.register` registers."""

    def grad_reference(grad, a, b):
        (grad, a, b), dtype = _opmath(grad, a, b)
        a = _float64_if_number(a)
        return activation_backward(grad * b, a).to(dtype), (grad * activation(a)).to(dtype)

    grad_kernel = ElementwiseKernel(
        name=f"{name}_grad",
        math=grad_math,
        reference=grad_reference,
        arg_names=("grad", "a", "b"),
        dtypes=FLOAT_DTYPES,
        param=None,
        outputs=2,
        formula=f"(grad * b * {formula}'(a), grad * {formula}(a))",
        unfused=("torch.mul", f"torch.ops.aten.{formula.split('_')[0]}_backward"),
    )
    autograd.register_pair(grad_kernel)
    entry = None  # (the registered entry, below: the backward of b alone is the gate itself)

    def backward(grad, saved, param):
        a, b = saved
        if _needs_composition(grad, a, b):
            da, db = grad_reference(grad, a, 0 if b is None else b)
            return (None if b is None else da), db
        if b is None:  # only b's gradient is asked for: grad * act(a)
            return None, dispatch.elementwise(entry, (a, grad), None, None)
        return _pair(grad_kernel, (grad, a, b))

    def backward_kernels(param):
        # backward's two gradients as one kept launch of grad_kernel on (grad, a, b)
        return (grad_kernel, None, 0), (grad_kernel, None, 1)

    entry = (register_builtin if builtin else register)(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=lambda a, b: activation(_float64_if_number(a)) * b,
            arg_names=("a", "b"),
            dtypes=FLOAT_DTYPES,
            param=None,
            formula=f"{formula}(a) * b",
            unfused=(f"torch.nn.functional.{formula.split('_')[0]}", "torch.mul"),
            saves="inputs",
            needs=((0, 1), (0,)),  # d/da reads a and b; d/db only a
            backward=backward,
            backward_kernels=backward_kernels,
        )
    )
    return entry


SILU_MUL = register_gate(
    "silu_mul", activations.silu_mul_math, activations.silu_mul_grad_math, F.silu, _silu_backward, "silu", builtin=True
)
GELU_MUL = register_gate(
    "gelu_mul",
    activations.gelu_mul_math,
    activations.gelu_mul_grad_math,
    F.gelu,
    _gelu_backward("none"),
    "gelu",
    builtin=True,
)
GELU_TANH_MUL = register_gate(
    "gelu_tanh_mul",
    activations.gelu_tanh_mul_math,
    activations.gelu_tanh_mul_grad_math,
    lambda v: F.gelu(v, approximate="tanh"),
    _gelu_backward("tanh"),
    "gelu_tanh",
    builtin=True,
)
SILU_MUL_GRAD, GELU_MUL_GRAD, GELU_TANH_MUL_GRAD = (
    autograd.PAIRS[f"{g.name}_grad"] for g in (SILU_MUL, GELU_MUL, GELU_TANH_MUL)
)


def _add_gelu_entry(name: str, math, pre_math, approximate: str) -> ElementwiseKernel:
    """``gelu(x + alpha * y)``: keeps the sum under autograd (``saves="pre"``), written by a
    two-output launch beside the result; its backward is one ``gelu_grad`` launch on
    (grad, sum), given to both operands (times alpha for y) by ``add``'s backward."""
    act = "gelu" if approximate == "none" else "gelu_tanh"

    def reference(x, y, alpha=1):
        return F.gelu(torch.add(_float64_if_number(x), y, alpha=alpha), approximate=approximate)

    def pair_reference(x, y, alpha=1):
        pre = torch.add(_float64_if_number(x), y, alpha=alpha)
        return F.gelu(pre, approximate=approximate), pre

    forward_pair = ElementwiseKernel(
        name=f"{name}_pre",
        math=pre_math,
        reference=pair_reference,
        dtypes=FLOAT_DTYPES,
        outputs=2,
        formula=f"({act}(x + alpha * y), x + alpha * y)",
        unfused=("torch.add", "torch.nn.functional.gelu"),
    )
    autograd.register_pair(forward_pair)
    return register_builtin(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=reference,
            dtypes=FLOAT_DTYPES,
            formula=f"{act}(x + alpha * y)",
            unfused=("torch.add", "torch.nn.functional.gelu"),
            saves="pre",
            pre=ADD,
            forward_pair=forward_pair,
            backward=lambda grad, pre, alpha: activation_grad(grad, pre, act),
        )
    )


ADD_GELU = _add_gelu_entry("add_gelu", activations.add_gelu_math, activations.add_gelu_pre_math, "none")
ADD_GELU_TANH = _add_gelu_entry(
    "add_gelu_tanh", activations.add_gelu_tanh_math, activations.add_gelu_tanh_pre_math, "tanh"
)


def matmul_backward(ctx, grad_out):
    """``(grad_a, grad_b, grad_bias)`` of ``act(a @ b + bias)`` from what
    :func:`fusedkit.autograd.matmul_setup_context` kept (None where none is needed)."""
    a2, b, saved = ctx.saved_tensors
    g = activation_grad(grad_out, saved, ctx.activation).contiguous()
    grad_a = grad_b = grad_bias = None
    # The gradient products have no epilogue to fuse, so ``torch.mm`` runs them as
    # ``F.linear``'s backward does: cuBLAS under PyTorch's TF32 flag (at least as exact as
    # fusedkit's fp32 modes), with no Python host time per product.
    if ctx.needs_input_grad[0]:
        grad_a = torch.mm(g, b.t())
    if ctx.needs_input_grad[1]:
        grad_b = torch.mm(a2.t(), g)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        # PyTorch sums half types with an fp32 accumulator and rounds once, as nn.Linear's own
        # bias gradient does (an fp32 sum and a cast were a second kernel and launch).
        grad_bias = g.sum(0)
    return grad_a, grad_b, grad_bias


def matmul_jvp(ctx, tangent_a, tangent_b, tangent_bias):
    """``(tangent_out, tangent_pre)`` of ``act(a @ b + bias)`` from the operands' tangents
    (forward-mode AD): the product rule for the pre-activation, then the activation's
    derivative, as its backward takes it. ``tangent_pre`` is the kept pre-activation's (an
    empty tensor where the call keeps none, as its output is)."""
    a2, b, saved = ctx.saved_tensors
    pre = a2.new_zeros(a2.shape[0], b.shape[1])
    for t in (
        None if tangent_a is None else tangent_a @ b,
        None if tangent_b is None else a2 @ tangent_b,
        tangent_bias,
    ):
        if t is not None:
            pre = pre + t
    return activation_grad(pre, saved, ctx.activation), pre if ctx.activation in NEEDS_PRE else pre.new_zeros(0)


autograd.register_matmul_backward(
    matmul_backward,
    matmul_jvp,
    {"relu": (RELU_GRAD, 1), **{name: (kernel, None) for name, kernel in _ACTIVATION_GRAD.items()}},
)


# --- Norms over rows: RMSNorm and LayerNorm, with a residual add first ------------------


def _norm_reference(rms: bool):
    def reference(x, residual, weight, bias, eps, alpha, normalized_shape):
        return row_norm.reference(x, residual, weight, bias, eps, alpha, rms, normalized_shape)

    return reference


RMS_NORM, LAYER_NORM, ADD_RMS_NORM, ADD_LAYER_NORM = (
    register_row(RowKernel(name, rms, residual, formula, _norm_reference(rms), unfused))
    for name, rms, residual, formula, unfused in (
        ("rms_norm", True, False, "x / sqrt(mean(x^2) + eps) * w", ("torch.nn.functional.rms_norm",)),
        ("layer_norm", False, False, "(x - mean(x)) / sqrt(var(x) + eps) * w + b", ("torch.nn.functional.layer_norm",)),
        (
            "add_rms_norm",
            True,
            True,
            "h = x + alpha * r; (h / sqrt(mean(h^2) + eps) * w, h)",
            ("torch.add", "torch.nn.functional.rms_norm"),
        ),
        (
            "add_layer_norm",
            False,
            True,
            "h = x + alpha * r; ((h - mean(h)) / sqrt(var(h) + eps) * w + b, h)",
            ("torch.add", "torch.nn.functional.layer_norm"),
        ),
    )
)
