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
from .registry import FLOAT_DTYPES, ElementwiseKernel, register_builtin, result_dtype
from .runtime import elementwise as ew

__all__ = [
    "ADD",
    "ADD_GELU",
    "ADD_GELU_GRAD",
    "ADD_GELU_TANH",
    "ADD_GELU_TANH_GRAD",
    "ADD_RELU",
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
SILU_GRAD = _activation_grad_entry(
    "silu_grad", activations.silu_grad_math, torch.ops.aten.silu_backward, "grad * silu'(pre)"
)
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
# Each saves its inputs, never an intermediate (the activation is recomputed in the backward:
# one more read, none of the forward's extra memory), and takes its gradients in one kernel.

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


_GELU_BACKWARD = {
    "none": torch.ops.aten.gelu_backward,
    "tanh": lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate="tanh"),
}


def _gate_grad_reference(approximate: str | None):
    """The two gradients of ``act(a) * b`` with torch's ops (``None``: SiLU; else GELU's ``approximate``)."""

    def reference(grad, a, b):
        (grad, a, b), dtype = _opmath(grad, a, b)
        a = _float64_if_number(a)
        if approximate is None:  # (aten's silu_backward has no derivative of its own: a second one needs this)
            s = torch.sigmoid(a)
            da, db = grad * b * (s * (1 + a * (1 - s))), grad * (a * s)
        else:
            da = _GELU_BACKWARD[approximate](*_aten_operands(grad * b, a))
            db = grad * F.gelu(a, approximate=approximate)
        return da.to(dtype), db.to(dtype)

    return reference


def _gate_grad_kernel(name: str, grad_math, approximate: str | None, act: str) -> ElementwiseKernel:
    """Both gradients of ``act(a) * b`` from one read of grad, a and b: a two-output kernel,
    unregistered (the registry's ops return one tensor); its reference is torch's ops."""
    return ElementwiseKernel(
        name=name,
        math=grad_math,
        reference=_gate_grad_reference(approximate),
        arg_names=("grad", "a", "b"),
        dtypes=FLOAT_DTYPES,
        param=None,
        outputs=2,
        formula=f"(grad * b * {act}'(a), grad * {act}(a))",
        unfused=("torch.mul", f"torch.ops.aten.{act.split('_')[0]}_backward"),
    )


SILU_MUL_GRAD = _gate_grad_kernel("silu_mul_grad", activations.silu_mul_grad_math, None, "silu")
GELU_MUL_GRAD = _gate_grad_kernel("gelu_mul_grad", activations.gelu_mul_grad_math, "none", "gelu")
GELU_TANH_MUL_GRAD = _gate_grad_kernel("gelu_tanh_mul_grad", activations.gelu_tanh_mul_grad_math, "tanh", "gelu_tanh")
for _kernel in (SILU_MUL_GRAD, GELU_MUL_GRAD, GELU_TANH_MUL_GRAD):
    autograd.register_pair(_kernel)


def _gate_entry(
    name: str, math, grad_kernel: ElementwiseKernel, approximate: str | None, act: str
) -> ElementwiseKernel:
    """``act(a) * b`` as a registry entry; its backward runs ``grad_kernel``."""

    def backward(grad, saved, param):
        a, b = saved
        if _needs_composition(grad, a, b):
            return grad_kernel.reference(grad, a, b)
        return _pair(grad_kernel, (grad, a, b))

    def reference(a, b):
        a = _float64_if_number(a)
        return (F.silu(a) if approximate is None else F.gelu(a, approximate=approximate)) * b

    def backward_kernels(param):
        # backward's two gradients as one kept launch of grad_kernel on (grad, a, b)
        return (grad_kernel, None, 0), (grad_kernel, None, 1)

    return register_builtin(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=reference,
            arg_names=("a", "b"),
            dtypes=FLOAT_DTYPES,
            param=None,
            formula=f"{act}(a) * b",
            unfused=(f"torch.nn.functional.{act.split('_')[0]}", "torch.mul"),
            saves="inputs",
            backward=backward,
            backward_kernels=backward_kernels,
        )
    )


SILU_MUL = _gate_entry("silu_mul", activations.silu_mul_math, SILU_MUL_GRAD, None, "silu")
GELU_MUL = _gate_entry("gelu_mul", activations.gelu_mul_math, GELU_MUL_GRAD, "none", "gelu")
GELU_TANH_MUL = _gate_entry("gelu_tanh_mul", activations.gelu_tanh_mul_math, GELU_TANH_MUL_GRAD, "tanh", "gelu_tanh")


def _add_gelu_grad_entry(name: str, math, approximate: str) -> ElementwiseKernel:
    """The gradient through ``gelu(x + alpha * y)`` with respect to the sum, recomputed from x
    and y. Its reference is PyTorch's backward op; it declares no backward of its own."""

    def reference(grad, x, y, alpha=1):
        (grad, x, y), dtype = _opmath(grad, x, y)
        pre = torch.add(_float64_if_number(x), y, alpha=alpha)
        return _GELU_BACKWARD[approximate](*_aten_operands(grad, pre)).to(dtype)

    return register_builtin(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=reference,
            arg_names=("grad", "x", "y"),
            dtypes=FLOAT_DTYPES,
            formula=f"grad * {'gelu' if approximate == 'none' else 'gelu_tanh'}'(x + alpha * y)",
            unfused=("torch.add", "torch.ops.aten.gelu_backward"),
        )
    )


ADD_GELU_GRAD = _add_gelu_grad_entry("add_gelu_grad", activations.add_gelu_grad_math, "none")
ADD_GELU_TANH_GRAD = _add_gelu_grad_entry("add_gelu_tanh_grad", activations.add_gelu_tanh_grad_math, "tanh")


def _add_gelu_entry(name: str, math, grad_kernel: ElementwiseKernel, approximate: str) -> ElementwiseKernel:
    def backward(grad, saved, alpha):
        x, y = saved
        if _needs_composition(grad, x, y):
            g = grad_kernel.reference(grad, x, y, alpha)
            return g, g * alpha
        g = dispatch.elementwise(grad_kernel, (grad, x, y), alpha, None)
        return g, _scaled(g, alpha)  # d/dy = alpha * d/dx (the same tensor where alpha == 1)

    def backward_kernels(alpha):
        # backward's gradient as one kept launch of grad_kernel on (grad, x, y), given to both
        # operands where alpha == 1 (else the scaling takes a number operand: Python runs it)
        return ((grad_kernel, alpha), (grad_kernel, alpha)) if alpha == 1 else None

    return register_builtin(
        ElementwiseKernel(
            name=name,
            math=math,
            reference=lambda x, y, alpha=1: F.gelu(
                torch.add(_float64_if_number(x), y, alpha=alpha), approximate=approximate
            ),
            dtypes=FLOAT_DTYPES,
            formula=f"{'gelu' if approximate == 'none' else 'gelu_tanh'}(x + alpha * y)",
            unfused=("torch.add", "torch.nn.functional.gelu"),
            saves="inputs",
            backward=backward,
            backward_kernels=backward_kernels,
        )
    )


ADD_GELU = _add_gelu_entry("add_gelu", activations.add_gelu_math, ADD_GELU_GRAD, "none")
ADD_GELU_TANH = _add_gelu_entry("add_gelu_tanh", activations.add_gelu_tanh_math, ADD_GELU_TANH_GRAD, "tanh")


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


autograd.register_matmul_backward(matmul_backward)
