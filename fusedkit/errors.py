"""Exceptions raised by fusedkit before any kernel is launched.

Each class also derives from ``RuntimeError``, the class PyTorch raises for the
same mistakes, so code written against ``torch.add`` keeps catching them.
"""

from __future__ import annotations

__all__ = ["FusedkitError", "ShapeError", "DTypeError", "DeviceError", "OverlapError"]


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
