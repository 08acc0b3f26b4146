"""Version checks and run-mode detection, shared by the whole package."""

from __future__ import annotations

import os

import torch
import triton
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])
TRITON_VERSION = Version(triton.__version__.split("+")[0])


def interpreter_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the host."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) was built for the interpreter.

    Triton decides this once, when the decorator runs, so the answer comes from the
    kernel object and not from the environment now.
    """
    return type(kernel).__name__ == "InterpretedFunction"
