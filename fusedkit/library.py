"""fusedkit's own ops, with their derivatives beside them: the registry entries ``add``,
``add_relu`` and ``relu_grad``, and the matmul's gradient.

Derivatives call the public dispatch (:mod:`fusedkit.dispatch`), so a gradient of a
gradient is recorded, transformed or traced like any call; that is why they live here,
above the autograd layer, which receives them as data (a registry entry's ``backward``,
:func:`fusedkit.autograd.register_matmul_backward`).
"""

from __future__ import annotations

import torch

from . import autograd, dispatch
from .kernels import activations
from .registry import FLOAT_DTYPES, ElementwiseKernel, register_builtin

__all__ = ["ADD", "ADD_RELU", "GELU_GRAD", "GELU_TANH_GRAD", "RELU_GRAD", "SILU_GRAD", "activation_grad",
           "matmul_backward"]


def _add_backward(grad, saved, alpha):
    # d/dx = grad itself (no copy); d/dy = alpha * grad, computed as 0 + alpha * grad.
    return grad, grad if alpha == 1 else dispatch.elementwise(ADD, (0, grad), alpha, None)


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


ADD = register_builtin(ElementwiseKernel(
    name="add",
    math=activations.add_math,
    reference=lambda x, y, alpha=1: torch.add(x, y, alpha=alpha),
    formula="x + alpha * y",
    unfused=("torch.add",),
    backward=_add_backward,
))

ADD_RELU = register_builtin(ElementwiseKernel(
    name="add_relu",
    math=activations.add_relu_math,
    reference=lambda x, y, alpha=1: torch.relu(torch.add(x, y, alpha=alpha)),
    formula="relu(x + alpha * y)",
    unfused=("torch.add", "torch.relu"),
    saves="output",
    backward=_add_relu_backward,
    backward_kernels=_add_relu_backward_kernels,
))

RELU_GRAD = register_builtin(ElementwiseKernel(
    name="relu_grad",
    math=activations.relu_grad_math,
    reference=_relu_grad_reference,
    arg_names=("grad", "out"),
    dtypes=FLOAT_DTYPES,
    formula="where(out <= 0, 0, alpha * grad)",
    unfused=("torch.mul", "torch.where"),
    saves="inputs",
    backward=_relu_grad_backward,
))


def _aten_operands(grad, pre):
    """Both operands as tensors of their promoted dtype and shape (the aten backward ops take
    no numbers and no broadcasting)."""
    dtype = torch.result_type(grad, pre)
    device = (grad if isinstance(grad, torch.Tensor) else pre).device
    return torch.broadcast_tensors(*(torch.as_tensor(v, device=device).to(dtype) for v in (grad, pre)))


def _activation_grad_entry(name: str, math, aten_backward, formula: str) -> ElementwiseKernel:
    """The gradient through a matmul epilogue's activation from its input (the kept
    pre-activation), in one kernel with fp32 math for half types. Its reference is PyTorch's
    own backward op; it declares no backward of its own (a gradient of it takes the reference)."""
    return register_builtin(ElementwiseKernel(
        name=name, math=math, reference=lambda grad, pre: aten_backward(*_aten_operands(grad, pre)),
        arg_names=("grad", "pre"), dtypes=FLOAT_DTYPES, param=None, formula=formula,
        unfused=(f"torch.ops.aten.{name.removesuffix('_grad').split('_')[0]}_backward",)))


GELU_GRAD = _activation_grad_entry("gelu_grad", activations.gelu_grad_math, torch.ops.aten.gelu_backward,
                                   "grad * gelu'(pre)")
GELU_TANH_GRAD = _activation_grad_entry(
    "gelu_tanh_grad", activations.gelu_tanh_grad_math,
    lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre, approximate="tanh"), "grad * gelu_tanh'(pre)")
SILU_GRAD = _activation_grad_entry("silu_grad", activations.silu_grad_math, torch.ops.aten.silu_backward,
                                   "grad * silu'(pre)")
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
