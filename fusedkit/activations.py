"""Pure ``@triton.jit`` math shared by the elementwise registry and (later) the
matmul epilogue. Each function maps compute-dtype values to values; loads,
stores and casts live elsewhere.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def relu(v):
    """``max(v, 0)`` with PyTorch's special values: NaN stays NaN, -0.0 stays -0.0.

    Written as ``v < 0 ? 0 : v`` because ``v > 0 ? v : 0`` would turn NaN into 0.
    """
    return tl.where(v < 0, 0, v)


@triton.jit
def add_scaled(x, y, alpha):
    """``x + alpha * y``, the arithmetic of ``torch.add(x, y, alpha=alpha)``."""
    return x + y * alpha


@triton.jit
def add_math(x, y, alpha):
    """Registry math of ``add``."""
    return add_scaled(x, y, alpha)


@triton.jit
def add_relu_math(x, y, alpha):
    """Registry math of ``add_relu``."""
    return relu(add_scaled(x, y, alpha))
