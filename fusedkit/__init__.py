"""fusedkit: fused GPU kernels in Triton for PyTorch.

``fusedkit.add`` and ``fusedkit.add_relu`` replace ``torch.add`` and
``torch.relu(torch.add(...))`` with one kernel each; :mod:`fusedkit.registry`
lists every fused elementwise op and lets you register your own.
"""

from __future__ import annotations

from . import nn, registry
from ._elementwise import BACKENDS, backend_for, elementwise
from ._launch import clear_caches
from .errors import (
    ArgumentError, DeviceError, DTypeError, FusedkitError, NotDifferentiableError, OverlapError, ScalarOverflowError,
    ShapeError, SignatureError, UnknownKernelError,
)
from ._matmul import linear_relu, matmul, matmul_relu
from .ops import add, add_relu



def _version() -> str:
    """The version in the package metadata; from a source checkout, its ``pyproject.toml``."""
    import pathlib
    import re
    from importlib import metadata

    pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    try:
        return metadata.version("fusedkit")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "add", "add_relu", "elementwise", "clear_caches", "matmul", "matmul_relu", "linear_relu", "nn", "registry", "backend_for", "BACKENDS",
    "FusedkitError", "ShapeError", "DTypeError", "DeviceError", "OverlapError", "ArgumentError", "SignatureError",
    "UnknownKernelError", "NotDifferentiableError", "ScalarOverflowError",
]
