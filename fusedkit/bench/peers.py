"""A benchmark peer: the plain, tutorial-style Triton kernel.

What most hand-written Triton elementwise code looks like: one flat 1-D block
per program over contiguous operands, a mask on every access. It needs its
inputs contiguous and of the output's shape, so a broadcast or transposed
operand is first copied with ``.contiguous()``: the hidden copy that fusedkit's
strided kernel avoids, and that the report's ``bias`` and ``transposed``
layouts put a price on. The op's math is the registry's own, so only the
memory access differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedkit.registry import ElementwiseKernel
from fusedkit.runtime.configs import COMPILER_OPTIONS

__all__ = ["tutorial", "supports_tutorial", "TUTORIAL_BLOCK"]

#: The tutorial's block size.
TUTORIAL_BLOCK = 1024


@triton.jit
def _tutorial_kernel(x_ptr, y_ptr, out_ptr, n, alpha, FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, FN(x, y, alpha).to(out_ptr.dtype.element_ty), mask=mask)


def supports_tutorial(spec: ElementwiseKernel, dtype: torch.dtype) -> bool:
    """Binary kernels with a scalar parameter, on floating dtypes up to fp32."""
    return spec.arity == 2 and spec.param is not None and dtype in (torch.float16, torch.bfloat16, torch.float32)


def tutorial(spec: ElementwiseKernel, x: torch.Tensor, y: torch.Tensor, alpha=1.0) -> torch.Tensor:
    """``spec``'s math through the tutorial kernel; copies non-contiguous or broadcast inputs first."""
    shape = torch.broadcast_shapes(x.shape, y.shape)
    x = x.expand(shape).contiguous()
    y = y.expand(shape).contiguous()
    out = torch.empty_like(x)
    n = out.numel()
    # (fusedkit's compiler options: the same math compiles to the same instructions in both)
    _tutorial_kernel[(triton.cdiv(n, TUTORIAL_BLOCK),)](
        x, y, out, n, float(alpha), FN=spec.math, BLOCK=TUTORIAL_BLOCK, **COMPILER_OPTIONS
    )
    return out
