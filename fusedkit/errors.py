"""Exceptions raised by fusedkit before any kernel is launched or any output written.

Every class derives from :class:`FusedkitError` (a ``RuntimeError``, the class PyTorch
raises for the same mistakes) and also from the built-in class Python code expects for
that mistake (``ValueError``, ``TypeError``, ``KeyError``, ``NotImplementedError``), so
``except`` clauses written against ``torch.add`` or plain Python keep catching them.
"""

from __future__ import annotations

__all__ = [
    "FusedkitError",
    "ShapeError",
    "DTypeError",
    "DeviceError",
    "OverlapError",
    "ArgumentError",
    "SignatureError",
    "UnknownKernelError",
    "NotDifferentiableError",
    "ScalarOverflowError",
    "TracingError",
]


class FusedkitError(RuntimeError):
    """Base class of every error fusedkit raises on bad input."""


class ShapeError(FusedkitError, ValueError):
    """Shapes that do not broadcast, or an ``out`` of the wrong shape."""


class DTypeError(FusedkitError, TypeError):
    """An unsupported, complex or mismatched dtype, or an argument of the wrong type."""


class DeviceError(FusedkitError, ValueError):
    """Tensors on different devices, or on a device the call cannot run on."""


class OverlapError(FusedkitError, ValueError):
    """``out`` shares memory with an input in a way that would corrupt the result."""


class ArgumentError(FusedkitError, ValueError):
    """An argument of the right type with a value the call cannot take: an unknown
    activation, a scalar out of the result dtype's range, a bad setting or registry entry."""


class ScalarOverflowError(ArgumentError, OverflowError):
    """A Python int operand or ``alpha`` that torch cannot hold (beyond int64, or uint64 for
    ``alpha``): an ``OverflowError`` too, as torch raises for it."""


class SignatureError(FusedkitError, TypeError):
    """A call with the wrong number of operands or an unknown keyword."""


class UnknownKernelError(FusedkitError, KeyError):
    """A kernel name the registry does not hold."""

    __str__ = FusedkitError.__str__  # KeyError's would quote the whole message


class NotDifferentiableError(FusedkitError, NotImplementedError):
    """A gradient was asked of a kernel (or an order of derivative) that has none."""


class TracingError(FusedkitError, NotImplementedError):
    """A way of capturing a program that fusedkit's ops do not support (``torch.jit.trace``:
    use ``torch.compile`` or ``torch.export``, which trace the registered ops)."""
