"""Run-mode detection, shared by the whole package."""

from __future__ import annotations


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) was built for the interpreter.

    Triton decides this once, when the decorator runs, so the answer comes from the
    kernel object and not from the environment now.
    """
    return type(kernel).__name__ == "InterpretedFunction"
