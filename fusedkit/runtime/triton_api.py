"""Every touch of Triton's private API, with one adapter per supported release.

fusedkit's eager fast path launches a kernel Triton already compiled without going through
``kernel[grid](...)`` (docs/design.md, "The eager fast path"), and its C++ table repeats the
launch itself. Both read things Triton does not promise to keep: the launcher object its
``CompiledKernel`` holds, the C function behind it and the arguments that function takes,
the packed launch metadata, the kernel's signature, the TMA descriptor encoder and the
launch hooks (and, for ``codegen``, the compiler's entry points). They change between
releases, so this module is the one place that reads them, and :data:`ADAPTER` says how
for the running release:

=============  ==========================================================================
releases       the CUDA launcher's C function
=============  ==========================================================================
3.5, 3.6       one per kernel, compiled from a generated source: ``launch(gx, gy, gz,
               stream, function, cooperative, pdl, global_scratch, profile_scratch,
               packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``; 3.5
               packs three cluster sizes after (warps, CTAs, shared memory)
3.7 - 3.9      the driver's one ``utils.launch``: ``launch(gx, gy, gz, stream, function,
               cooperative, pdl, packed_metadata, launch_metadata, enter_hook, exit_hook,
               global_scratch, profile_scratch, arg_annotations, signature, args)``, the
               kernel's arguments as one tuple; the TMA encoder is
               ``fill_tma_descriptor_tiled``
=============  ==========================================================================

Every release passes the kernel its non-constant arguments, then two scratch pointers (what
the C++ table packs). On any other release (3.2 - 3.4 and releases newer than this module)
:data:`ADAPTER` is None: every call goes through Triton's own launch, and fusedkit logs once,
at INFO, why (``native.launch_path``). ``tests/test_triton_api.py`` calls the installed
release's own launcher object beside the adapter's direct call and fails when the two differ,
so a release that changes what is read here fails a test, not a user's launch.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
from packaging.version import Version
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler.compiler import CompiledKernel

try:  # the hooks a profiler (e.g. Triton's proton) installs around launches
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None
try:  # Triton 3.5+ keeps launch hooks in a chain that is never None
    from triton.knobs import HookChain as _HookChain
except ImportError:  # pragma: no cover - older Triton
    _HookChain = ()
try:  # the CUDA launcher's TMA element-type codes (its descriptor encoder takes host codes)
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST as TMA_HOST_TYPE
except ImportError:  # pragma: no cover - another Triton or no CUDA backend
    TMA_HOST_TYPE = None

__all__ = [
    "ADAPTER",
    "ADAPTERS",
    "RELEASE",
    "ASTSource",
    "Adapter",
    "CompiledKernel",
    "GPUTarget",
    "make_backend",
    "encode_tensor_map",
    "geometry",
    "hook_source",
    "hooks",
    "raw_launcher",
    "signature",
]

#: The running Triton's (major, minor).
RELEASE = Version(triton.__version__).release[:2]


class Adapter(NamedTuple):
    """How one family of Triton releases launches a compiled kernel (the module's table)."""

    name: str
    #: The launcher's C function is the driver's shared one, taking the arguments as one tuple
    #: after their annotations and signature; else one per kernel, taking them spread out.
    shared: bool
    #: The name of the driver utility that encodes a tiled TMA descriptor.
    encoder: str


PER_KERNEL = Adapter("per-kernel C launcher", shared=False, encoder="fill_tma_descriptor")
SHARED = Adapter("the driver's shared C launcher", shared=True, encoder="fill_tma_descriptor_tiled")
#: The releases whose launchers this module has been checked against, by (major, minor).
ADAPTERS = {(3, 5): PER_KERNEL, (3, 6): PER_KERNEL, (3, 7): SHARED, (3, 8): SHARED, (3, 9): SHARED}
#: The running release's adapter (None: not supported; Triton's own launch runs every call).
ADAPTER = ADAPTERS.get(RELEASE)


# --- Launch hooks -----------------------------------------------------------------------

_RUNTIME = _knobs.runtime if _knobs is not None else None


def _live(hook):
    """``hook``, or None when it would do nothing (an empty chain)."""
    return None if hook is None or (type(hook) is _HookChain and not hook.calls) else hook


def hooks():
    """The launch (enter, exit) hooks that would see a launch now, None where idle."""
    if _RUNTIME is None:
        return None, None
    return _live(_RUNTIME.launch_enter_hook), _live(_RUNTIME.launch_exit_hook)


def hook_source():
    """(``triton.knobs.runtime``, the ``HookChain`` type), where the C++ launch table reads the
    launch hooks as :func:`hooks` does; Nones on a Triton without them."""
    return _RUNTIME, _HookChain if isinstance(_HookChain, type) else None


# --- The compiled kernel ------------------------------------------------------------------


def geometry(compiled: CompiledKernel) -> tuple[int, int, int]:
    """(warps, CTAs per program, dynamic shared memory) of a compiled kernel's launches, from
    its packed launch metadata (3.5 appends cluster sizes, which apply only past one CTA)."""
    num_warps, num_ctas, shared = compiled.packed_metadata[:3]
    return num_warps, num_ctas, shared


def signature(compiled: CompiledKernel) -> dict:
    """The kernel's parameter types by name, in order (``"constexpr"`` for compile-time ones)."""
    return compiled.src.signature


# --- The launcher's C function -------------------------------------------------------------


def _descriptor_launch(launch, metadata):
    """``(C launch, layouts)`` when ``launch`` is the wrapper Triton puts around its C launch
    for a kernel with TMA descriptor parameters (it encodes every ``TensorDescriptor`` on every
    call, after the caller has built them: encoding them once per operand instead halves a
    repeated TMA matmul's host time, docs/design.md, "Matmul calls"), else None (no
    descriptors, or a layout this module does not encode: the wrapper stays). ``layouts``: per
    descriptor parameter, in order, (swizzle, element size, host element type, block shape)."""
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    cells = dict(zip(names, getattr(launch, "__closure__", None) or ()))
    metas = getattr(metadata, "tensordesc_meta", None)
    if "launcher" not in cells or "tensordesc_meta" not in cells or not metas or TMA_HOST_TYPE is None:
        return None
    if any(m is None or m.get("fp4_padded") or m.get("is_im2col") for m in metas):
        return None
    layouts = tuple(
        (m["swizzle"], m["elem_size"], TMA_HOST_TYPE[m["elem_type"]], tuple(m["block_size"])) for m in metas
    )
    return cells["launcher"].cell_contents, layouts


def _shared(c_launch, cooperative, pdl, annotations, kernel_signature):
    """The shared C launch called as a per-kernel one is (what ``CompiledCache.run`` calls):
    the flags, annotations and signature bound, the arguments gathered into the tuple it takes."""

    def launch(gx, gy, gz, stream, function, packed, metadata, enter, exit_, *args):
        c_launch(
            gx, gy, gz, stream, function, cooperative, pdl, packed, metadata, enter, exit_, None, None,
            annotations, kernel_signature, args,
        )  # fmt: skip

    return launch


def raw_launcher(launcher, metadata=None):
    """``(launch, head, layouts, flags)`` for calling the C launch function of Triton's
    launcher object ``launcher`` past its Python ``__call__`` (which only adds scratch buffers
    and flags, in Python, on every launch), or None where that wrapper is needed (scratch
    buffers to allocate, a release without an adapter, an attribute missing). The call is
    ``launch(gx, gy, gz, stream, function, *head, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)``, as the per-kernel C launcher takes it; ``layouts`` (see
    :func:`_descriptor_launch`) when it takes TMA descriptors already encoded, else None;
    ``flags``: (cooperative, pdl)."""
    if ADAPTER is None:
        return None
    try:
        needs_scratch = launcher.global_scratch_size or launcher.profile_scratch_size
        flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        launch = launcher.launch
        if ADAPTER.shared:
            annotations, kernel_signature = launcher.arg_annotations, launcher.kernel_signature
    except AttributeError:
        return None
    if needs_scratch or getattr(launcher, "gsan_enabled", False):
        return None
    unwrapped = _descriptor_launch(launch, metadata)
    c_launch, layouts = (launch, None) if unwrapped is None else unwrapped
    if ADAPTER.shared:
        return _shared(c_launch, *flags, annotations, kernel_signature), (), layouts, flags
    return c_launch, (*flags, None, None), layouts, flags


def encode_tensor_map(*args):
    """Triton's CUtensorMap encoder (``cuTensorMapEncodeTiled``), as its launcher calls it:
    ``(address, swizzle, element size, host element type, block, shape, strides, padding)``."""
    return getattr(triton.runtime.driver.active.utils, ADAPTER.encoder)(*args)
