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
import triton
import triton.language as tl
from packaging.version import Version
from triton.compiler.compiler import CompiledKernel

try:  # the hooks a profiler (e.g. Triton's proton) installs around launches
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None
try:  # Triton 3.5+ keeps launch hooks in a chain that is never None
    from triton.knobs import HookChain as _HookChain
except ImportError:  # pragma: no cover - older Triton
    _HookChain = ()

from .. import settings
from ..kernels import helpers
from .configs import CALL_CACHE_SIZE, COMPILED_CACHE_SIZE, TENSOR_MAP_CACHE_SIZE

try:  # Triton 3.6's CUDA launcher: the TMA element-type codes its descriptor encoder takes
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as TMA_HOST_TYPE
except ImportError:  # pragma: no cover - another Triton or no CUDA backend
    TMA_HOST_TYPE = None

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
#: Triton releases whose CUDA launcher object we call past (its C ``launch`` takes
#: cooperative / PDL flags and two scratch buffers after the function handle). The
#: object's own ``__call__`` only adds those, in Python, on every launch.
RAW_LAUNCH_RELEASES = ((3, 6),)
RAW_LAUNCH = Version(triton.__version__).release[:2] in RAW_LAUNCH_RELEASES
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


_RUNTIME = _knobs.runtime if _knobs is not None else None


def _live(hook):
    """``hook``, or None when it would do nothing (an empty chain)."""
    return None if hook is None or (type(hook) is _HookChain and not hook.calls) else hook


def _hooks():
    if _RUNTIME is None:
        return None, None
    return _live(_RUNTIME.launch_enter_hook), _live(_RUNTIME.launch_exit_hook)


def hook_source():
    """(``triton.knobs.runtime``, the ``HookChain`` type), where the C++ launch table reads
    the launch hooks as :func:`hooks_idle` does; Nones on a Triton without them."""
    return _RUNTIME, _HookChain if isinstance(_HookChain, type) else None


def hooks_idle() -> bool:
    """No launch hook (a profiler's) would see a launch: launches outside Triton may go ahead."""
    return _hooks() == (None, None)


class Entry(NamedTuple):
    """A kept launch: the ``CompiledKernel`` and what its launcher takes besides the
    per-call arguments: the 3-d grid, the values appended to the per-call runtime
    arguments (the compile-time constants, in signature order: the compiled launcher
    skips them, but expects every parameter), and the caller's ``extra`` (e.g. a tile).
    ``head`` goes between the function handle and the packed metadata: empty for
    Triton's launcher object, its flags and scratch buffers (None) for its C ``launch``.
    ``layouts``: when the launcher takes TMA descriptors already encoded (see
    :func:`tensor_map_args`), the hardware layout of each descriptor parameter, in order;
    None when it takes ``TensorDescriptor`` objects (or the kernel has none)."""

    compiled: CompiledKernel
    launcher: object
    function: int
    packed_metadata: object
    grid: tuple
    tail: tuple
    extra: object
    head: tuple = ()
    layouts: tuple | None = None


def _descriptor_launch(launch, metadata):
    """``(C launch, layouts)`` when ``launch`` is the wrapper Triton 3.6 puts around its C
    launch for a kernel with TMA descriptor parameters (it encodes every ``TensorDescriptor``
    on every call, after the caller has built them: encoding them once per operand instead
    halves a repeated TMA matmul's host time, docs/design.md, "Matmul calls"), else None (no
    descriptors, or a layout this module does not encode: the wrapper stays)."""
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    cells = dict(zip(names, getattr(launch, "__closure__", None) or ()))
    metas = getattr(metadata, "tensordesc_meta", None)
    if "launcher" not in cells or "tensordesc_meta" not in cells or not metas or TMA_HOST_TYPE is None:
        return None
    if any(m is None or m.get("fp4_padded") for m in metas):
        return None
    layouts = tuple(
        (m["swizzle"], m["elem_size"], TMA_HOST_TYPE[m["elem_type"]], tuple(m["block_size"])) for m in metas
    )
    return cells["launcher"].cell_contents, layouts


def raw_launcher(launcher, metadata=None):
    """``(launch, head, layouts)`` for calling Triton's C launch function directly, or None
    when this launcher needs its Python wrapper (scratch buffers to allocate, an unknown
    release). ``layouts``: see :class:`Entry`."""
    if not RAW_LAUNCH:
        return None
    try:
        needs_scratch = launcher.global_scratch_size or launcher.profile_scratch_size
        head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)
        launch = launcher.launch
    except AttributeError:
        return None
    if needs_scratch:
        return None
    unwrapped = _descriptor_launch(launch, metadata)
    return (launch, head, None) if unwrapped is None else (unwrapped[0], head, unwrapped[1])


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


def encode_tensor_map(*args):
    """Triton's CUtensorMap encoder (``cuTensorMapEncodeTiled``), as its launcher calls it."""
    return triton.runtime.driver.active.utils.fill_tma_descriptor(*args)


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
        launcher, head, layouts = raw_launcher(compiled.run, compiled.metadata) or (compiled.run, (), None)
        self._entries[key] = Entry(
            compiled, launcher, compiled.function, compiled.packed_metadata, grid, tail, extra, head, layouts
        )

    @staticmethod
    def run(entry: Entry, args: tuple, device_index: int) -> None:
        compiled, launcher, function, packed, grid, tail, _, head, _ = entry
        stream = current_stream(device_index)
        enter, exit_ = _hooks()
        # Launch metadata only feeds hooks; Triton builds it on every launch (a lazy dict).
        metadata = None if enter is None and exit_ is None else compiled.launch_metadata(grid, stream, *args, *tail)
        launcher(grid[0], grid[1], grid[2], stream, function, *head, packed, metadata, enter, exit_, *args, *tail)
