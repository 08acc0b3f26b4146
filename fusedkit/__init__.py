"""fusedkit: fused GPU kernels in Triton for PyTorch.

``fusedkit.add`` and ``fusedkit.add_relu`` replace ``torch.add`` and
``torch.relu(torch.add(...))`` with one kernel each; ``fusedkit.matmul`` runs
``act(a @ b + bias)`` in one; :mod:`fusedkit.registry` lists every fused elementwise op
and lets you register your own; :mod:`fusedkit.settings` chooses how matmuls run.

The package reads top to bottom, each layer importing only the ones before it:
``errors`` and ``settings``; ``kernels`` (``@triton.jit`` code only); ``registry``;
``runtime`` (validation, planning, launches, caches); ``autograd`` (custom ops and
autograd Functions); ``dispatch`` (where a call runs); ``library`` (the built-in ops and
their derivatives); ``ops`` and ``nn``. ``fusedkit.bench`` (the reports) is not imported here.
"""

from __future__ import annotations

from . import nn, registry, settings
from .errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    FusedkitError,
    NotDifferentiableError,
    OverlapError,
    ScalarOverflowError,
    ShapeError,
    SignatureError,
    TracingError,
    UnknownKernelError,
)
from .fusion import FusionSite, advise, fuse, unfuse
from .library import register_gate
from .memory import MemoryCounterMode
from .ops import (
    add,
    add_gelu,
    add_layer_norm,
    add_relu,
    add_rms_norm,
    elementwise,
    gated_mlp,
    gelu_mul,
    layer_norm,
    linear_relu,
    matmul,
    matmul_relu,
    mlp,
    rms_norm,
    silu_mul,
)
from .runtime.elementwise import BACKENDS, backend_for
from .runtime.launch import clear_caches


def set_fp32_precision(precision: str) -> None:
    """How float32 matmuls run when PyTorch rules TF32 out, from now on: "tf32x3" (the
    default: three TF32 products each, fp32-sized errors) or "ieee" (fp32 multiply-adds).
    The same as ``fusedkit.settings.set(fp32_precision=...)``; see :mod:`fusedkit.settings`."""
    settings.set(fp32_precision=precision)


def get_fp32_precision() -> str:
    """The float32 matmul precision :func:`set_fp32_precision` chose ("tf32x3" or "ieee")."""
    return settings.current().fp32_precision


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

from . import sharding as _sharding  # noqa: E402

_sharding.install()  # DTensor's rules: now if torch.distributed.tensor is imported, else with its import

__all__ = [
    "add",
    "add_relu",
    "silu_mul",
    "gelu_mul",
    "add_gelu",
    "elementwise",
    "register_gate",
    "clear_caches",
    "matmul",
    "matmul_relu",
    "linear_relu",
    "gated_mlp",
    "mlp",
    "rms_norm",
    "layer_norm",
    "add_rms_norm",
    "add_layer_norm",
    "nn",
    "registry",
    "MemoryCounterMode",
    "advise",
    "fuse",
    "unfuse",
    "FusionSite",
    "settings",
    "set_fp32_precision",
    "get_fp32_precision",
    "backend_for",
    "BACKENDS",
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
