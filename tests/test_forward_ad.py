"""Forward-mode AD: ``torch.func.jvp``, ``jacfwd``, ``hessian`` and eager dual tensors
(``torch.autograd.forward_ad``) through every public op, against torch's own ops in float64.

An elementwise op's Jacobian is diagonal per operand, so its tangent is its stated backward
applied to each operand's tangent; the matmul's is the product rule, then the activation's
derivative. Both run under the transform as differentiable torch ops or fusedkit's ops.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand
from torch.func import hessian, jacfwd, jvp

import fusedkit

F64 = torch.float64

ELEMENTWISE = {
    "add": (lambda a, b: fusedkit.add(a, b, alpha=0.5), lambda a, b: torch.add(a, b, alpha=0.5)),
    "add_relu": (fusedkit.add_relu, lambda a, b: torch.relu(a + b)),
    "silu_mul": (fusedkit.silu_mul, lambda a, b: F.silu(a) * b),
    "gelu_mul": (fusedkit.gelu_mul, lambda a, b: F.gelu(a) * b),
    "gelu_tanh_mul": (
        lambda a, b: fusedkit.gelu_mul(a, b, approximate="tanh"),
        lambda a, b: F.gelu(a, approximate="tanh") * b,
    ),
    "add_gelu": (lambda a, b: fusedkit.add_gelu(a, b, alpha=-2), lambda a, b: F.gelu(a - 2 * b)),
    "add_gelu_tanh": (
        lambda a, b: fusedkit.add_gelu(a, b, approximate="tanh"),
        lambda a, b: F.gelu(a + b, approximate="tanh"),
    ),
}
ACTIVATIONS = {
    None: lambda v: v,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "silu": F.silu,
}


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_ops_have_forward_mode_derivatives(name):
    fused, plain = ELEMENTWISE[name]
    a, b = rand((5, 4), F64, DEVICE), rand((4,), F64, DEVICE)  # b broadcast
    ta, tb = rand((5, 4), F64, DEVICE), rand((4,), F64, DEVICE)
    out, tangent = jvp(fused, (a, b), (ta, tb))
    want_out, want = jvp(plain, (a, b), (ta, tb))
    _close(out, want_out)
    _close(tangent, want)
    for got, expected in zip(jacfwd(fused, argnums=(0, 1))(a, b), jacfwd(plain, argnums=(0, 1))(a, b)):
        _close(got, expected)
    _close(hessian(lambda a: fused(a, b).sum())(a), hessian(lambda a: plain(a, b).sum())(a))
    with fwAD.dual_level():  # eager dual tensors, one of them requiring grad as well
        dual = fused(fwAD.make_dual(a, ta), fwAD.make_dual(b.clone().requires_grad_(), tb))
        _close(fwAD.unpack_dual(dual).tangent, want)


@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
def test_matmul_has_forward_mode_derivatives(activation):
    act = ACTIVATIONS[activation]
    a, w, bias = rand((6, 3), F64, DEVICE), rand((3, 5), F64, DEVICE), rand((5,), F64, DEVICE)
    ta, tw, tbias = rand((6, 3), F64, DEVICE), rand((3, 5), F64, DEVICE), rand((5,), F64, DEVICE)

    def fused(a, w, bias):
        return fusedkit.matmul(a, w, bias, activation)

    def plain(a, w, bias):
        return act(a @ w + bias)

    _, tangent = jvp(fused, (a, w, bias), (ta, tw, tbias))
    _, want = jvp(plain, (a, w, bias), (ta, tw, tbias))
    _close(tangent, want)
    _close(hessian(lambda a: fused(a, w, bias).sum())(a), hessian(lambda a: plain(a, w, bias).sum())(a))
    if activation == "relu":  # linear_relu, eager dual tensors
        (_, want_a) = jvp(lambda a: plain(a, w, bias), (a,), (ta,))
        with fwAD.dual_level():
            dual = fusedkit.linear_relu(fwAD.make_dual(a, ta), w.t(), bias)
            _close(fwAD.unpack_dual(dual).tangent, want_a)
