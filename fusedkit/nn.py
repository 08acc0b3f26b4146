"""``torch.nn`` modules built on fusedkit's fused ops."""

from __future__ import annotations

import torch
from torch import nn

from ._matmul import linear_relu

__all__ = ["LinearReLU"]


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
        """A LinearReLU sharing ``linear``'s parameters."""
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.load_state_dict(linear.state_dict())
        return m
