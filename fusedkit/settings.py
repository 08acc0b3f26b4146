"""fusedkit's settings: how matmuls run and whether eager launches are kept.

Each setting starts from an environment variable, read once when fusedkit is imported
(so a shell or a job script can choose a default), and changes only through this API,
process-wide, as ``torch.backends`` flags do; fusedkit never writes ``os.environ``::

    fusedkit.set_fp32_precision("ieee")            # from now on
    with fusedkit.settings.override(autotune=False):
        fusedkit.matmul(a, b)                       # in this block only

| setting | values (default first) | environment variable |
|---|---|---|
| ``fp32_precision`` | ``"tf32x3"``, ``"ieee"``: fp32 matmuls where PyTorch rules TF32 out | ``FUSEDKIT_FP32_MATMUL`` |
| ``autotune`` | ``True``, ``False`` (one fixed tile: deterministic, no tuning time) | ``FUSEDKIT_AUTOTUNE`` (``0``) |
| ``matmul_kernel`` | ``"auto"``, ``"pointer"``, ``"tma"`` | ``FUSEDKIT_MATMUL_KERNEL`` |
| ``fast_launch`` | ``True``, ``False``: keep the launches of repeated eager calls | ``FUSEDKIT_FAST_LAUNCH`` (``0``) |
| ``native_launch`` | ``True``, ``False``: keep them in C++, autograd nodes too | ``FUSEDKIT_NATIVE_LAUNCH`` (``0``) |
| ``compiled_elementwise`` | ``"inductor"``, ``"kernel"``: under ``torch.compile`` | ``FUSEDKIT_COMPILED_ELEMENTWISE`` |

``fp32_precision``: "tf32x3" computes each float32 product as three TF32 tensor-core
products (fp32-sized errors, measured below torch's own fp32 matmul: see docs/matmul.md);
"ieee" runs fp32 multiply-adds on the CUDA cores. When PyTorch allows TF32
(``torch.backends.cuda.matmul``), TF32 itself is used. ``compiled_elementwise``: under
``torch.compile`` an elementwise op is traced as its PyTorch composition ("inductor": Inductor
fuses it, forward and backward, with the ops around it, as it fuses the unfused ops; a
compiled model never runs slower for holding fusedkit's ops) or as fusedkit's kernel, an op
Inductor calls as it is ("kernel"). The matmul keeps its kernel either way: Inductor does not
fuse an epilogue into its GEMMs by default. ``fast_launch`` and
``native_launch`` are read when a launch is kept (the C++ table is built once and needs a C++
compiler and ninja): ``fusedkit.clear_caches()`` drops the
ones kept before a change. The C++ table's build lives in ``$FUSEDKIT_CACHE_DIR`` (default
``~/.cache/fusedkit``; ``python -m fusedkit build`` makes it ahead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

from .errors import ArgumentError

__all__ = [
    "Settings",
    "current",
    "set",
    "restore",
    "override",
    "from_environment",
    "ENVIRONMENT",
    "FP32_PRECISIONS",
    "MATMUL_KERNELS",
    "COMPILED_ELEMENTWISE",
]

FP32_PRECISIONS = ("tf32x3", "ieee")
MATMUL_KERNELS = ("auto", "pointer", "tma")
COMPILED_ELEMENTWISE = ("inductor", "kernel")
#: The environment variable that gives each setting its default.
ENVIRONMENT = {
    "fp32_precision": "FUSEDKIT_FP32_MATMUL",
    "autotune": "FUSEDKIT_AUTOTUNE",
    "matmul_kernel": "FUSEDKIT_MATMUL_KERNEL",
    "fast_launch": "FUSEDKIT_FAST_LAUNCH",
    "native_launch": "FUSEDKIT_NATIVE_LAUNCH",
    "compiled_elementwise": "FUSEDKIT_COMPILED_ELEMENTWISE",
}
_CHOICES = {
    "fp32_precision": FP32_PRECISIONS,
    "matmul_kernel": MATMUL_KERNELS,
    "compiled_elementwise": COMPILED_ELEMENTWISE,
}


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """One set of values, each checked when the object is made (``ArgumentError`` names the
    choices). Equal values compare and hash equal; :func:`current` gives one interned object
    per set of values, so a kept launch plan's key (compared and hashed once per call) meets
    the same object and its hash is kept with it."""

    fp32_precision: str = "tf32x3"
    autotune: bool = True
    matmul_kernel: str = "auto"
    fast_launch: bool = True
    native_launch: bool = True
    compiled_elementwise: str = "inductor"

    def __post_init__(self) -> None:
        for name, value in self._values().items():
            if name in _CHOICES:
                if not isinstance(value, str) or value not in _CHOICES[name]:
                    raise ArgumentError(f"{name}={value!r}; choose from {', '.join(_CHOICES[name])}")
            elif not isinstance(value, bool):
                raise ArgumentError(f"{name} must be True or False, got {value!r}")
        object.__setattr__(self, "_hash", hash(tuple(self._values().values())))

    def _values(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __eq__(self, other) -> bool:
        if self is other:  # the interned objects: what a kept plan's key meets
            return True
        if not isinstance(other, Settings):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Made again from its values: a str's hash differs from process to process.
        return Settings, tuple(self._values().values())

    def replace(self, **values) -> Settings:
        """A copy with ``values`` changed, each checked (``ArgumentError`` names the choices)."""
        fields = {f.name for f in dataclasses.fields(self)}
        for name in values:
            if name not in fields:
                raise ArgumentError(f"fusedkit has no setting {name!r}; settings: {', '.join(sorted(fields))}")
        return _intern(dataclasses.replace(self, **values))


_INTERNED: dict[Settings, Settings] = {}


def _intern(settings: Settings) -> Settings:
    return _INTERNED.setdefault(settings, settings)


def from_environment(environ: Mapping[str, str] = os.environ) -> Settings:
    """The defaults as ``environ`` sets them (the switches are off for "0", on for "1")."""
    values = {}
    for name, variable in ENVIRONMENT.items():
        text = environ.get(variable)
        if text is None:
            continue
        if name in _CHOICES:
            values[name] = text
        elif text in ("0", "1"):
            values[name] = text == "1"
        else:
            raise ArgumentError(f"{variable}={text!r}; set it to 0 or 1")
    try:
        return _intern(Settings()).replace(**values)
    except ArgumentError as exc:
        raise ArgumentError(f"{exc} (from the environment: {', '.join(ENVIRONMENT[n] for n in values)})") from None


_current = from_environment()


def current() -> Settings:
    """The settings every call reads now."""
    return _current


def set(**values) -> Settings:
    """Change settings from now on, process-wide; returns the previous ones (pass them to
    :func:`restore` to go back)."""
    global _current
    previous, _current = _current, _current.replace(**values)
    return previous


def restore(previous: Settings) -> None:
    """Put back settings :func:`set` returned."""
    global _current
    if not isinstance(previous, Settings):
        raise ArgumentError(f"restore() takes the Settings set() returned, got {type(previous).__name__}")
    _current = _intern(previous)


@contextlib.contextmanager
def override(**values) -> Iterator[Settings]:
    """Run a block with these settings, then put back the ones before (process-wide, not
    per thread: as ``torch.backends`` flags)."""
    previous = set(**values)
    try:
        yield _current
    finally:
        restore(previous)
