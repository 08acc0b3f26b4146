"""Direct launches of compiled Triton kernels: the eager fast path.

``kernel[grid](*args)`` re-binds every argument, recomputes Triton's
specialisation key and checks global values on each call: host time that grows with
the argument count, several times what a direct launch takes (docs/design.md, "The eager
fast path"; ``python -m fusedkit bench --latency`` times calls). It also returns the
``CompiledKernel`` it launched, and ``CompiledKernel.run`` launches that same binary
with little more than its argument packing. :class:`CompiledCache` keeps those kernels
under a key that the caller builds from everything Triton specialises on (dtypes, 16-byte pointer
alignment, integer values or their classes, compile-time constants, options,
device), so a later call with the same key launches directly and any other call
takes the ordinary path, which compiles or finds the right kernel.

Under the interpreter there is no ``CompiledKernel``; every call takes the
ordinary path. ``fusedkit.settings``' ``fast_launch=False`` turns the direct path off.

Every process-wide cache of fusedkit's registers here, so :func:`clear_caches` empties
them all; :class:`CallCache` is the one type of cache of kept eager calls, for both op
families.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import NamedTuple

import torch
import triton.language as tl

from .. import settings
from ..kernels import helpers
from . import triton_api
from .configs import CALL_CACHE_SIZE, COMPILED_CACHE_SIZE, TENSOR_MAP_CACHE_SIZE
from .triton_api import CompiledKernel

try:  # what Triton's own driver calls for the current stream and device
    from torch._C import _cuda_getCurrentRawStream as current_stream
    from torch._C import _cuda_getDevice as current_device
except ImportError:  # a PyTorch without CUDA support

    def current_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    def current_device() -> int:
        return torch.cuda.current_device()


__all__ = [
    "ALIGNMENT",
    "CallCache",
    "CompiledCache",
    "Entry",
    "GridRecorder",
    "clear_caches",
    "constexpr_names",
    "current_device",
    "enabled",
    "hook_source",
    "hooks_idle",
    "int_class",
    "pointer_count",
    "register_cache",
    "stream_of",
    "tensor_map_args",
]


#: Whether this process runs Triton's interpreter: decided once, when Triton decorated
#: fusedkit's kernels (``kernels.helpers.INTERPRETED``); every runtime module reads it here.
INTERPRETED = helpers.INTERPRETED.value


def stream_of(index: int) -> int:
    """The current stream's handle on CUDA device ``index``."""
    return current_stream(index)


#: Triton proves 16-byte accesses from pointers and integers divisible by 16.
ALIGNMENT = 16
#: Whether this Triton release's launcher can be called past its Python wrapper
#: (``triton_api.ADAPTER``; the C++ launch table needs it too).
RAW_LAUNCH = triton_api.ADAPTER is not None
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
#: The range of a 64-bit integer argument or parameter encoding.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


#: Triton's interpreter keeps the running kernel's state in module globals (the grid
#: index, the patched ``tl`` functions), so two threads inside it corrupt each other's
#: launches; interpreted launches hold this lock. Compiled launches need none.
_INTERPRETER_LOCK = threading.RLock()
_NOT_SERIALISED = contextlib.nullcontext()


def serialised():
    """The context an interpreted launch runs in (one at a time); a no-op for compiled kernels."""
    return _INTERPRETER_LOCK if INTERPRETED else _NOT_SERIALISED


def enabled() -> bool:
    """Whether launches are kept (``fusedkit.settings``' ``fast_launch``)."""
    return settings.current().fast_launch


def int_class(value: int) -> bool:
    """What Triton keys an unspecialised integer argument on: whether it fits in int32."""
    return _I32_MIN <= value <= _I32_MAX


def constexpr_names(kernel) -> tuple[str, ...]:
    """A ``@triton.jit`` function's compile-time parameters, in signature order
    (compiled or interpreted: read off the Python signature)."""
    fn = kernel
    while not inspect.isfunction(fn):  # JITFunction / InterpretedFunction / Heuristics / Autotuner
        fn = fn.fn
    params = list(inspect.signature(fn).parameters.items())
    flags = [
        p.annotation is tl.constexpr or (isinstance(p.annotation, str) and p.annotation.split(".")[-1] == "constexpr")
        for _, p in params
    ]
    first = flags.index(True) if True in flags else len(flags)
    # Direct launches pass (runtime args) + (constexprs): that is signature order only
    # when the constexprs come last.
    assert all(flags[first:]), f"{fn.__name__}: compile-time parameters must come last"
    return tuple(name for (name, _), flag in zip(params, flags) if flag)


def pointer_count(kernel) -> int:
    """How many leading parameters of a ``@triton.jit`` function are pointers (named ``*_ptr``:
    fusedkit's kernels take their pointers first, then scalars)."""
    fn = kernel
    while not inspect.isfunction(fn):  # JITFunction / InterpretedFunction / Heuristics / Autotuner
        fn = fn.fn
    return sum(1 for name in inspect.signature(fn).parameters if name.endswith("_ptr"))


class GridRecorder:
    """A grid callable that remembers the meta-parameters of the last launch it sized.

    Triton calls a callable grid with the launch's bound arguments, the autotuner's
    config included, and the final launch of a tuning call is the last one; reading
    the config here rather than ``Autotuner.best_config`` (one attribute shared by
    every thread) ties the cached grid to the kernel that was actually launched.
    """

    def __init__(self, grid_fn):
        self._grid_fn = grid_fn
        self.meta: dict | None = None

    def __call__(self, meta):
        self.meta = dict(meta)
        return self._grid_fn(meta)


_hooks = triton_api.hooks
hook_source = triton_api.hook_source


def hooks_idle() -> bool:
    """No launch hook (a profiler's) would see a launch: launches outside Triton may go ahead."""
    return _hooks() == (None, None)


class Entry(NamedTuple):
    """A kept launch: the ``CompiledKernel`` and what its launcher takes besides the
    per-call arguments: the 3-d grid, the values appended to the per-call runtime
    arguments (the compile-time constants, in signature order: the compiled launcher
    skips them, but expects every parameter), and the caller's ``extra`` (e.g. a tile).
    ``head`` goes between the function handle and the packed metadata: empty for
    Triton's launcher object (or a release's adapter that binds its own), the flags and
    scratch buffers (None) for a per-kernel C ``launch`` (``triton_api.raw_launcher``).
    ``layouts``: when the launcher takes TMA descriptors already encoded (see
    :func:`tensor_map_args`), the hardware layout of each descriptor parameter, in order;
    None when it takes ``TensorDescriptor`` objects (or the kernel has none). ``flags``:
    (cooperative, pdl) of a launch past Triton's wrapper, empty for one through it."""

    compiled: CompiledKernel
    launcher: object
    function: int
    packed_metadata: object
    grid: tuple
    tail: tuple
    extra: object
    head: tuple = ()
    layouts: tuple | None = None
    flags: tuple = ()


def raw_launcher(launcher, metadata=None):
    """``(launch, head, layouts, flags)`` for calling Triton's C launch function directly, or
    None when this launcher needs its Python wrapper (``triton_api.raw_launcher``)."""
    return triton_api.raw_launcher(launcher, metadata)


#: How to empty each process-wide cache of fusedkit's (plans, kept launches, recipes, encoded
#: descriptors, workspaces), registered by the module that owns it.
_CACHE_CLEARERS: list = []


def register_cache(clear) -> None:
    """Have :func:`clear_caches` call ``clear()``."""
    _CACHE_CLEARERS.append(clear)


def clear_caches() -> None:
    """Forget everything fusedkit keeps between calls: launch plans, kept launches and the
    recipes of the eager fast path, the C++ launch table, encoded TMA descriptors and split-K
    workspaces. The next call of each signature validates and plans again. Triton's own
    caches (compiled kernels, autotuning results, each keyed on what it depends on) stay."""
    for clear in _CACHE_CLEARERS:
        clear()


#: Encoded TMA descriptors by (address, shape, strides, layout): a CUtensorMap is a pure
#: function of those, so a repeated operand (a weight; an activation the caching allocator
#: hands back at the same address) reuses its encoding.
TENSOR_MAPS: dict = {}


encode_tensor_map = triton_api.encode_tensor_map


def tensor_map_args(address: int, shape: tuple, strides: tuple, layout: tuple) -> list:
    """What Triton's C launcher takes for one TMA descriptor parameter: the encoded
    CUtensorMap, then the sizes and strides (as its own wrapper expands a ``TensorDescriptor``
    with zero padding). ``layout``: one of :attr:`Entry.layouts`."""
    key = (address, shape, strides, layout)
    args = TENSOR_MAPS.get(key)
    if args is None:
        swizzle, elem_size, elem_type, block = layout
        tensor_map = encode_tensor_map(address, swizzle, elem_size, elem_type, block, shape, strides, 0)
        if len(TENSOR_MAPS) >= TENSOR_MAP_CACHE_SIZE:
            TENSOR_MAPS.clear()
        args = TENSOR_MAPS[key] = [tensor_map, *shape, *strides]
    return args


register_cache(TENSOR_MAPS.clear)


class CallCache(dict):
    """Kept eager calls by signature, for either op family: ``get`` (dict's own) is the fast
    path's one lookup; :meth:`keep` adds, clearing a full cache first (rare: a process
    cycling through more than ``CALL_CACHE_SIZE`` signatures); :func:`clear_caches` empties it.
    ``on_clear``: what else to forget with it (the C++ table that holds its entries)."""

    def __init__(self, on_clear=None):
        super().__init__()
        self._on_clear = on_clear
        register_cache(self.clear)

    def clear(self) -> None:
        super().clear()
        if self._on_clear is not None:
            self._on_clear()

    def keep(self, key, value) -> None:
        if len(self) >= CALL_CACHE_SIZE:
            self.clear()
        self[key] = value


class CompiledCache:
    """Compiled kernels by a caller-built specialisation key, launched directly.

    The caller launches under the right device; the stream is that device's current
    one, so CUDA-graph capture records the launch. :func:`enabled` is read when an
    entry is stored. Pointer arguments may be passed as addresses (ints):
    Triton's launcher then skips its own ``data_ptr()`` call and pointer query
    (validation has placed every tensor on the launch's device).
    """

    def __init__(self, maxsize: int = COMPILED_CACHE_SIZE):
        self._entries: dict = {}
        self._maxsize = maxsize

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def get(self, key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> tuple[Entry, ...]:
        """Every kept launch, in the order kept."""
        return tuple(self._entries.values())

    def put(self, key, compiled, grid: tuple[int, int, int], tail: tuple, extra=None) -> None:
        """Keep what Triton's ordinary launch returned, when it is a compiled kernel."""
        if not isinstance(compiled, CompiledKernel) or not enabled():
            return
        compiled._init_handles()
        if len(self._entries) >= self._maxsize:
            self._entries.clear()  # rare: a process cycling through many signatures
        launcher, head, layouts, flags = raw_launcher(compiled.run, compiled.metadata) or (compiled.run, (), None, ())
        self._entries[key] = Entry(
            compiled, launcher, compiled.function, compiled.packed_metadata, grid, tail, extra, head, layouts, flags
        )

    @staticmethod
    def run(entry: Entry, args: tuple, device_index: int) -> None:
        compiled, launcher, function, packed, grid, tail, _, head, _, _ = entry
        stream = current_stream(device_index)
        enter, exit_ = _hooks()
        # Launch metadata only feeds hooks; Triton builds it on every launch (a lazy dict).
        metadata = None if enter is None and exit_ is None else compiled.launch_metadata(grid, stream, *args, *tail)
        launcher(grid[0], grid[1], grid[2], stream, function, *head, packed, metadata, enter, exit_, *args, *tail)
