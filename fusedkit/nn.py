"""``torch.nn`` modules built on fusedkit's fused ops."""

from __future__ import annotations

import torch
from torch import nn

from ._layout import broadcast_shape
from ._matmul import linear_relu
from .ops import add_relu

__all__ = ["LinearReLU", "AddReLU"]


class LinearReLU(nn.Linear):
    """Drop-in for ``nn.Sequential(nn.Linear(in, out), nn.ReLU())`` with one fused kernel.

    Same parameters (``weight`` (out, in), ``bias`` (out,)) and initialisation as
    ``nn.Linear``, so it loads an ``nn.Linear`` state_dict; works with ``.to()``
    and autograd. Input (..., in_features) -> output (..., out_features).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_relu(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "LinearReLU":
        """A new LinearReLU holding a copy of ``linear``'s weight and bias."""
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.load_state_dict(linear.state_dict())
        return m


class AddReLU(nn.Module):
    """A residual join: ``relu(x + alpha * residual)`` in one kernel (``fusedkit.add_relu``).

    ``inplace=True`` writes into ``x`` (as ``out=x``) when no gradient is needed and
    the result has ``x``'s shape and dtype, saving an allocation; otherwise it
    returns a new tensor.
    """

    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha = alpha
        self.inplace = inplace

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.inplace and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad)) \
                and torch.result_type(x, residual) == x.dtype \
                and tuple(x.shape) == broadcast_shape([x.shape, residual.shape]):
            return add_relu(x, residual, alpha=self.alpha, out=x)
        return add_relu(x, residual, alpha=self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, inplace={self.inplace}"
