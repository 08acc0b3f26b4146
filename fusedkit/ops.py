"""Public fused elementwise ops. Each is a thin, documented front for one
registry entry; the work happens in :func:`fusedkit.elementwise`."""

from __future__ import annotations

import typing

import torch

from ._elementwise import dispatch
from .registry import ADD, ADD_RELU

__all__ = ["add", "add_relu"]

#: What an operand may be: a tensor, or a host number standing for a scalar.
Operand = typing.Union[torch.Tensor, float, int]


def add(x: Operand, y: Operand, *, alpha: float | int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + alpha * y`` in one kernel; the same result as ``torch.add(x, y, alpha=alpha)``.

    Args:
        x: a tensor, or a Python number / 0-d tensor when ``y`` is a tensor. Any shape
            that broadcasts with ``y``; strided, transposed, sliced and broadcast views
            are read through their strides, never copied.
        y: the same, for the second operand.
        alpha: real number multiplying ``y``, in the compute dtype (float32 for half
            types); an integer when the result is integral.
        out: optional tensor of the result's shape and device, of any dtype the result
            casts to (``torch.can_cast``); it may be ``x`` or ``y`` itself (in place) but
            must not partially overlap a dense input. Its version counter is bumped.

    Returns:
        A tensor of the broadcast shape and ``torch.result_type(x, y)``: float16,
        bfloat16, float32, float64, int32 or int64. Half types compute in float32,
        ``x + alpha * y`` as one fused multiply-add. A new result has the strides
        torch's TensorIterator would give it.

    Raises:
        ShapeError: shapes that do not broadcast, or an ``out`` of the wrong shape.
        DTypeError: an unsupported or complex dtype, a non-tensor operand, a float
            ``alpha`` for an integral result, or an ``out`` dtype the result does not cast to.
        ArgumentError: an ``alpha`` torch refuses (out of the compute dtype's range).
        DeviceError: operands (or ``out``) on different devices.
        OverlapError: an ``out`` that partially overlaps a dense input, or itself.
        FusedkitError: an inference tensor as ``out`` outside inference mode.

    All are ``FusedkitError`` subclasses (a ``RuntimeError``), raised before anything is
    launched or written.
    """
    return dispatch(ADD, (x, y), alpha, out)


def add_relu(x: Operand, y: Operand, *, alpha: float | int = 1,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x + alpha * y)`` in one kernel: reads x and y once and writes once,
    where ``torch.relu(torch.add(x, y, alpha=alpha))`` also writes and re-reads the sum.

    Same arguments, shapes, dtypes and errors as :func:`add`. ``relu(NaN)`` is NaN
    and ``relu(-0.0)`` is ``-0.0``, as in PyTorch. ``out=x`` computes in place, as a
    residual join does.
    """
    return dispatch(ADD_RELU, (x, y), alpha, out)
