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

__all__ = ["ADD", "ADD_RELU", "RELU_GRAD", "activation_grad", "matmul_backward"]


def _add_backward(grad, saved, alpha):
    # d/dx = grad itself (no copy); d/dy = alpha * grad, computed as 0 + alpha * grad.
    return grad, grad if alpha == 1 else dispatch.elementwise(ADD, (0, grad), alpha, None)


def _add_relu_backward(grad, out, alpha):
    # Only the output is saved: relu's mask is out > 0, so x and y need not be kept.
    gx = dispatch.elementwise(RELU_GRAD, (grad, out), 1, None)
    return gx, gx if alpha == 1 else dispatch.elementwise(RELU_GRAD, (grad, out), alpha, None)


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


def activation_grad(grad: torch.Tensor, saved: torch.Tensor, activation: str | None) -> torch.Tensor:
    """dL/d(pre-activation) from dL/d(output); ``saved`` is the output for ReLU, else the pre-activation."""
    if activation is None:
        return grad
    if activation == "relu":
        return dispatch.elementwise(RELU_GRAD, (grad, saved), 1, None)  # torch's threshold_backward: NaN passes
    wide = torch.promote_types(saved.dtype, torch.float32)  # fp32 math for half types, fp64 kept
    x = saved.to(wide)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * activations.SQRT_1_2.value))
        pdf = torch.exp(-0.5 * x * x) * (0.5 * activations.SQRT_2_OVER_PI.value)  # 1/sqrt(2 pi)
        d = cdf + x * pdf
    elif activation == "gelu_tanh":
        z = activations.SQRT_2_OVER_PI.value * (x + activations.GELU_TANH_CUBIC.value * x ** 3)
        t = torch.tanh(z)
        dz = activations.SQRT_2_OVER_PI.value * (1 + 3 * activations.GELU_TANH_CUBIC.value * x * x)
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dz
    else:  # silu
        s = torch.sigmoid(x)
        d = s * (1 + x * (1 - s))
    return (grad.to(wide) * d).to(grad.dtype)


def matmul_backward(ctx, grad_out):
    """``(grad_a, grad_b, grad_bias)`` of ``act(a @ b + bias)`` from what
    :func:`fusedkit.autograd.matmul_setup_context` kept (None where none is needed)."""
    a2, b, saved = ctx.saved_tensors
    g = activation_grad(grad_out, saved, ctx.activation).contiguous()
    grad_a = grad_b = grad_bias = None
    # Through the dispatcher: a repeated backward launches its kept plans.
    if ctx.needs_input_grad[0]:
        grad_a = dispatch.matmul(g, b.t())
    if ctx.needs_input_grad[1]:
        grad_b = dispatch.matmul(a2.t(), g)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        # PyTorch sums half types with an fp32 accumulator and rounds once, as nn.Linear's own
        # bias gradient does (an fp32 sum and a cast were a second kernel and launch).
        grad_bias = g.sum(0)
    return grad_a, grad_b, grad_bias


autograd.register_matmul_backward(matmul_backward)
