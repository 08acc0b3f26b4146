"""Eager launches in C++ (``csrc/eager.cpp``): on by default where they apply,
``fusedkit.settings.set(native_launch=False)`` (or ``FUSEDKIT_NATIVE_LAUNCH=0``) turns them off.

From Python a small call's floor is one allocation plus Triton's C launch function,
already more than ``torch.add``'s whole call on the H200 host (``docs/why-fusion.md``).
The C++ table holds kept launches: a repeated call matches its signature, allocates its
result and launches the kernel in C++, and, when an operand requires a gradient, gives
the result its autograd node there too. When the gradient is taken, that node launches
the kernel's ``backward_kernels`` from the table where they are kept (a two-output
kernel's launch too: the gates' backward), else runs its ``backward`` in Python.
Whatever the table does not match (other types, misaligned pointers, a launch hook, a
different device, forward-mode AD) returns None and takes the Python path, which is
unchanged.

The extension is built once per machine, Python and torch version (a C++ compiler and
ninja are needed; ``python -m fusedkit build`` builds it ahead, as ``scripts/run.sh``
does) into ``$FUSEDKIT_CACHE_DIR`` (default ``~/.cache/fusedkit``); the first kept launch
of a process loads it, or builds it when it is missing (about 30 s, logged once). A
failed build warns once and leaves the Python path in charge.

The table holds only launches whose kernel Triton compiled for 16-byte-aligned
pointers, with every operand a tensor on the launch's device, on a Triton release with an
adapter in ``triton_api`` (3.5 - 3.9: the table repeats their launchers' parameter packing,
the kernel's non-constant arguments, then two scratch pointers), one CTA per program and no
cooperative or PDL launch. On any other Triton the Python path runs every call.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import struct
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import triton

from .. import registry, settings
from ..kernels.elementwise import POINTER_ARGS
from . import launch, matmul_tma, triton_api

__all__ = [
    "TABLE",
    "applies",
    "build",
    "clear",
    "enabled",
    "library_path",
    "norm_backward",
    "norm_recipe",
    "register",
    "set_backward_factory",
]

_SOURCE = Path(__file__).with_name("csrc") / "eager.cpp"
#: The process's launch table once built (None: off, not needed yet, or unavailable).
TABLE = None
_BUILD_FAILED = False
#: Argument roles of the elementwise kernel's pointer parameters, by name.
_OPERAND_POINTERS = ("a_ptr", "b_ptr", "c_ptr")
#: The pointer parameter of a two-output kernel's second result.
_SECOND_RESULT = "out2_ptr"


_log = logging.getLogger("fusedkit")
#: Compiler flags of the build (part of its cache key).
_CFLAGS = ("-O2",)
#: How long a process waits for another's build of the extension (one takes about 30 s on
#: 2 cores) before it gives up and runs the Python path.
BUILD_WAIT_S = 300
#: ``factory(kernel, param, operand_signature, device, shape, dtype) -> (backward, saves,
#: plan) | None`` for a kept launch's autograd node (:func:`fusedkit.autograd.native_backward`,
#: set by that module, which sits above this one).
_backward_factory = None
#: What the C++ node saves for the kernel's backward, by ``ElementwiseKernel.saves``.
SAVES = {"none": 0, "output": 1, "inputs": 2}


def enabled() -> bool:
    """Whether kept launches go into the C++ table too (``fusedkit.settings``' ``native_launch``;
    read when a launch is kept)."""
    return settings.current().native_launch


def applies() -> bool:
    """Whether this Triton's launches can be repeated from C++ (a release with an adapter in
    ``triton_api``: the table packs the parameters as its launcher does) and compiled kernels
    run here."""
    return launch.RAW_LAUNCH and not launch.INTERPRETED


def launch_path() -> str:
    """Which launch path a repeated eager call takes on this machine, and why: what
    ``python -m fusedkit build`` prints and, once a process, the INFO log where the C++ table
    does not apply."""
    releases = ", ".join(".".join(map(str, r)) for r in triton_api.ADAPTERS)
    if launch.INTERPRETED:
        return "Triton's interpreter (TRITON_INTERPRET=1): the kernels run on the CPU, every call through Triton"
    if not torch.cuda.is_available():
        return "no GPU: PyTorch's composition of each op (TRITON_INTERPRET=1 runs the kernels in Triton's interpreter)"
    if not launch.RAW_LAUNCH:
        return (
            f"Python direct launches through Triton {triton.__version__}'s launcher object; the C++ launch "
            f"table is off (fusedkit reads the launchers of Triton {releases} only)"
        )
    return (
        f"the C++ launch table (Triton {triton.__version__}: {triton_api.ADAPTER.name}) where it is built, "
        "else Python direct launches"
    )


_PATH_LOGGED = False


def _log_path_once() -> None:
    global _PATH_LOGGED
    if not _PATH_LOGGED:
        _PATH_LOGGED = True
        _log.info("fusedkit: repeated calls take %s", launch_path())


def set_backward_factory(factory) -> None:
    """Give kept launches their gradient (see ``_backward_factory``)."""
    global _backward_factory
    _backward_factory = factory


def _cache_root() -> Path:
    root = os.environ.get("FUSEDKIT_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusedkit"


def _build_key() -> str:
    """What a build depends on: the source, Python, torch, the C++ ABI, the machine, the flags."""
    key = hashlib.sha256()
    for part in (
        _SOURCE.read_bytes(),
        sys.version,
        torch.__version__,
        str(torch.compiled_with_cxx11_abi()),
        platform.machine(),
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        " ".join(_CFLAGS),
    ):
        key.update(part if isinstance(part, bytes) else part.encode())
    return key.hexdigest()[:16]


def library_path(root: Path | None = None) -> Path:
    """Where this machine's build of the extension lives (it may not exist yet)."""
    key = _build_key()
    return (root or _cache_root()) / f"eager-{key}" / f"fusedkit_eager_{key}.so"


def _built(path: Path) -> Path | None:
    """The library in ``path``'s folder (PyTorch's loader may have versioned its name)."""
    return next(iter(sorted(path.parent.glob(f"{path.stem}*.so"))), None) if path.parent.is_dir() else None


def _import(library: Path):
    name = library.name.split(".")[0]  # the module name the library was built under
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(lock: Path):
    """An exclusive lock between processes (one builds, the others wait and load its
    build), released by the kernel when its holder dies; ``BUILD_WAIT_S`` at most."""
    with open(lock, "a") as handle:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {BUILD_WAIT_S} s for another process's build ({lock})") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(path: Path):
    """Build the extension into ``path``'s folder: under a lock, into a scratch folder that
    is renamed into place, so processes that start together (one per GPU) build it once and
    never load a half-written library."""
    from torch.utils.cpp_extension import load

    folder = path.parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(Path(f"{folder}.lock")):
        library = _built(path)
        if library is None:
            shutil.rmtree(folder, ignore_errors=True)  # a folder without a library: a build that died
            scratch = Path(f"{folder}.build-{os.getpid()}")
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            try:
                module = load(
                    path.stem,
                    sources=[str(_SOURCE)],
                    extra_cflags=list(_CFLAGS),
                    build_directory=str(scratch),
                    verbose=False,
                )
                built = Path(module.__file__)
                for leftover in scratch.iterdir():  # objects and ninja files: only the library is loaded
                    if leftover != built:
                        leftover.unlink()
                os.replace(scratch, folder)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)  # (gone already after a build)
            return module
    return _import(library)


def build(dry_run: bool = False, log: bool = False):
    """Load the extension (building it first when this machine has no build of it); return
    a new table (a dry-run table records the parameters it would launch with instead of
    launching: for tests)."""
    path = library_path()
    library = _built(path)
    if library is not None:
        module = _import(library)
    else:
        if log:
            _log.warning(
                "fusedkit: building its C++ launch table (once per machine and torch version; "
                "`python -m fusedkit build` does it ahead)"
            )
        module = _compile(path)
    table = module.Table(dry_run)
    table.watch_launch_hooks(*launch.hook_source())
    return table


def _table():
    global TABLE, _BUILD_FAILED
    if TABLE is None and not _BUILD_FAILED:
        try:
            TABLE = build(log=True)
        except Exception as exc:  # no compiler, no ninja, headers missing: stay in Python
            _BUILD_FAILED = True
            warnings.warn(f"fusedkit: native launches are off, the extension did not build: {exc}", stacklevel=3)
    return TABLE


def clear() -> None:
    """Forget every kept native launch (with the kept launches they came from)."""
    if TABLE is not None:
        TABLE.clear()


# A kernel replaced or unregistered: its launches (and their gradients, which a call checks
# against the registry in Python) leave the table, so such calls take the Python path.
registry.on_change(clear)


def _param_encoding(param) -> tuple[int, int] | None:
    """(kind, bits) of the Python number the kernel's parameter was encoded from."""
    if param is None:
        return 0, 0
    if type(param) is int:
        return (1, param) if launch.INT64_MIN <= param <= launch.INT64_MAX else None
    if type(param) is float:
        return 2, struct.unpack("<q", struct.pack("<d", param))[0]
    return None  # other number types: the Python path


def launch_layout(kept, entry) -> tuple[str, list[int]] | None:
    """The table's ``kinds`` and ``values`` for the kernel parameters of a kept launch of
    ``kept``, in the order Triton passes them (compile-time constants dropped)."""
    bits, _ = kept.last_param[1]
    values = (0,) * POINTER_ARGS + (*bits, *kept.launch_tail)  # the kernel's signature order
    signature = triton_api.signature(entry.compiled)
    if len(signature) != len(values):
        return None
    slots = dict(zip(_OPERAND_POINTERS, kept.tensor_slots))
    # (a one-output launch passes its result's address as out2 too, as the Python path does)
    second = "p" if kept.pair else "o"
    kinds, packed = [], []
    for (name, ty), value in zip(signature.items(), values):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            slot = slots.get(name)
            kinds.append(second if name == _SECOND_RESULT else "o" if slot is None else str(slot))
            packed.append(0)
        elif ty in ("i32", "i64"):
            kinds.append("i" if ty == "i32" else "l")
            packed.append(int(value))
        else:
            return None  # a parameter type this table does not pack
    return "".join(kinds), packed


def register(kept, entry, table=None) -> bool:
    """Add ``entry`` (a kept launch of ``kept``, compiled for aligned pointers) to the
    table; False when it does not qualify or the table is unavailable."""
    if not enabled() or kept.operand_signature is None or not entry.flags:
        return False
    if table is None and not applies():
        _log_path_once()
        return False
    cooperative, pdl = entry.flags
    num_warps, num_ctas, shared = triton_api.geometry(entry.compiled)
    param = _param_encoding(kept.last_param[0])
    layout = launch_layout(kept, entry) if kept.last_param[1] is not None else None
    if cooperative or pdl or num_ctas != 1 or param is None or layout is None:
        return False
    table = table if table is not None else _table()
    if table is None:
        return False
    operands = [(dtype, list(shape), list(strides)) for dtype, shape, strides in kept.operand_signature]
    kinds, values = layout
    backward = (
        None
        if _backward_factory is None
        else _backward_factory(
            kept.kernel, kept.last_param[0], kept.operand_signature, kept.device, tuple(kept.shape), kept.dtype
        )
    )
    fn, saves, plan = backward if backward is not None else (None, 0, ())
    steps = []
    for step in plan:  # the C++ backward's launches: (kernel, parameter encoding, result) per operand
        encoded = None if step is None else _param_encoding(step[1])
        if step is not None and encoded is None:
            steps = []  # a parameter the table cannot match: the Python backward runs
            break
        steps.append((None, 0, 0, 0) if step is None else (step[0], *encoded, step[2]))
    table.add(
        id(kept.kernel),
        kept.device,
        operands,
        *param,
        list(kept.shape),
        list(kept.out_strides),
        kept.dtype,
        entry.function,
        entry.grid[0],
        32 * num_warps,
        shared,
        kinds,
        values,
        fn,
        saves,
        f"Fusedkit{''.join(w.capitalize() for w in kept.kernel.name.split('_'))}Backward",
        steps,
    )
    return True


# --- Norms: a repeated call with a gradient, forward and backward in C++ --------------------
# (runtime.norm.GradRecipe's launches on slots: the call's tensors and the buffers it allocates)

# Slots, by digit: forward 0-6 x, residual, weight, bias, y, h, stats (an absent operand reads
# y's address); backward 0-6 dy, the saved rows, weight, stats, dh_out, dh (the input's
# gradient), the parameters' partial sums (an absent one reads dh's).


def _slot_layout(entry, pointers: dict, scalars: tuple, views: dict | None = None):
    """The table's ``kinds``, ``values`` and descriptor ``maps`` for a kept launch of ``entry``
    whose pointer parameters are ``pointers`` (name -> (slot digit, byte offset)), whose TMA
    descriptor parameters are ``views`` (name -> (slot, (rows, cols), (row stride, column
    stride), the compiled layout)), and whose other arguments are ``scalars`` then the entry's
    constants, in the order Triton passes them (the descriptors and pointers first); None where
    a parameter is of a type the table does not pack."""
    views = views or {}
    signature = triton_api.signature(entry.compiled)
    values = (None,) * (len(views) + len(pointers)) + (*scalars, *entry.tail)
    if len(signature) != len(values):
        return None
    kinds, packed, maps = [], [], []
    for (name, ty), value in zip(signature.items(), values):
        if ty == "constexpr":
            continue
        if name in views:
            if not ty.startswith("tensordesc"):
                return None
            slot, (rows, cols), (s0, s1), (swizzle, elem_size, elem_type, block) = views[name]
            kinds.append("T")
            packed.append(len(maps))
            maps.append((slot, swizzle, elem_size, elem_type, (block[1], block[0]), (cols, rows), s0 * elem_size))
            kinds += ["i", "i", "l", "l"]  # (the launcher passes the view's sizes and strides after it)
            packed += [rows, cols, s0, s1]
        elif ty.startswith("*"):
            if name not in pointers:
                return None
            slot, offset = pointers[name]
            kinds.append(slot)
            packed.append(offset)
        elif ty in ("i32", "i64") and type(value) is int:
            kinds.append("i" if ty == "i32" else "l")
            packed.append(value)
        elif ty == "fp32" and isinstance(value, float):
            try:
                bits = struct.unpack("<I", struct.pack("<f", value))[0]
            except OverflowError:  # (past float32's range: Triton's launcher rounds it; Python's runs)
                return None
            kinds.append("f")
            packed.append(bits)
        else:
            return None
    return "".join(kinds), packed, maps


def _plain_launch(entry) -> tuple[int, int, int] | None:
    """(grid, block, shared) of a kept launch the table can repeat: past Triton's wrapper, one
    CTA a program, a 1-D grid, neither cooperative nor PDL; else None."""
    if not entry.flags or any(entry.flags) or entry.grid[1:] != (1, 1):
        return None
    num_warps, num_ctas, shared = triton_api.geometry(entry.compiled)
    if num_ctas != 1:
        return None
    return entry.grid[0], 32 * num_warps, shared


def norm_recipe(recipe, fallback, table=None):
    """The C++ table's copy of ``recipe`` (a ``runtime.norm.GradRecipe`` whose pointers are all
    aligned) as ``(table, handle)``, its node's Python backward ``fallback(handle, dy, dh_out,
    rows, weight, bias, stats, needs)`` (given the handle, not holding it: a cycle through the
    C++ object would be one the collector cannot see); None where the table is off, not built,
    or cannot repeat it."""
    if not enabled() or (table is None and not applies()) or recipe.aligned != (1 << 8) - 1:
        return None
    geometry = _plain_launch(recipe.entry)
    if geometry is None:
        return None
    residual = recipe.h_dtype is not None
    weight, bias = recipe.params
    pointers = {
        "x_ptr": ("0", 0),
        "r_ptr": ("1" if residual else "4", 0),
        "w_ptr": ("2" if weight else "4", 0),
        "b_ptr": ("3" if bias else "4", 0),
        "y_ptr": ("4", 0),
        "h_ptr": ("5" if residual else "4", 0),
        "mean_ptr": ("4" if recipe.rms else "6", 0),
        "rstd_ptr": ("6", 4 * recipe.rstd_at),
    }
    layout = _slot_layout(recipe.entry, pointers, recipe.scalars)
    table = table if table is not None else _table()
    if layout is None or table is None:
        return None
    x_dtype, r_dtype = recipe.dtypes
    handle = table.norm_recipe(
        recipe.entry.function,
        *geometry,
        *layout[:2],  # (kinds and values: a norm's launch has no descriptors)
        recipe.device,
        list(recipe.shape),
        recipe.y_dtype,
        x_dtype,
        residual,
        recipe.h_dtype or x_dtype,
        r_dtype or x_dtype,
        recipe.stats,
        float(recipe.alpha),
        "FusedkitNormBackward",
        fallback,
    )
    return table, handle


def norm_backward(handle, given: bool, recipe, backward) -> bool:
    """Give the C++ copy ``handle`` of ``recipe`` its backward launch ``backward`` (a
    ``runtime.norm.BackwardRecipe``) for calls where a gradient reached ``h`` (``given``) or
    not; False where the table cannot repeat it (the Python backward runs those)."""
    geometry = _plain_launch(backward.entry)
    if geometry is None or backward.aligned != (1 << 9) - 1:
        return False
    k, programs, n = backward.parts
    need_weight, has_bias = backward.need_weight, backward.has_bias
    weight = recipe.params[0]
    pointers = {
        "dy_ptr": ("0", 0),
        "h_ptr": ("1", 0),
        "w_ptr": ("2" if weight else "5", 0),
        "mean_ptr": ("5" if recipe.rms else "3", 0),
        "rstd_ptr": ("3", 4 * recipe.rstd_at),
        "dh_out_ptr": ("4" if given else "5", 0),
        "dx_ptr": ("5", 0),
        "dw_ptr": ("6" if need_weight else "5", 0),
        "db_ptr": ("6" if has_bias else "5", 4 * programs * n * (k - 1) if has_bias else 0),
    }
    layout = _slot_layout(backward.entry, pointers, backward.scalars)
    if layout is None:
        return False
    rows_dtype, rows_strides, weight_strides, weight_dtype = backward.saved
    handle.set_backward(
        given,
        backward.entry.function,
        *geometry,
        *layout[:2],
        rows_dtype,
        weight_dtype or rows_dtype,
        list(rows_strides),
        list(weight_strides or ()),
        list(backward.parts) if k else [],
        backward.zeroed,
        need_weight,
        has_bias,
        backward.dh_dtype,
    )
    return True


# --- Matmuls: a repeated call, forward and (with a gradient) its node in C++ ----------------
# Slots, by digit: 0-4 a, b, bias, out, pre (an absent bias or pre reads out's address, as the
# Python launch passes out for them). The TMA kernel's descriptors are encoded per call in C++
# from the slot's address and the view the kept launch read (``matmul_tma.encoded_args``).

_MATMUL_POINTERS = {
    "a_ptr": "0",
    "b_ptr": "1",
    "c_ptr": "3",
    "bias_ptr": "2",
    "pre_ptr": "4",
    "ws_ptr": "3",
    "arrivals_ptr": "3",
    "colsum_ptr": "3",
    "b2_ptr": "1",
    "bias2_ptr": "3",
    "pre2_ptr": "3",  # (read only by the gated epilogue: the Python launch passes out)
}
#: The TMA kernel's descriptor parameters, in order.
_MATMUL_DESCRIPTORS = ("a_desc", "b_desc", "c_desc", "pre_desc", "b2_desc", "pre2_desc")


def _matmul_layout(entry, a2, b, out, scalars: tuple, tma: bool):
    """:func:`_slot_layout` of a kept matmul launch (``entry``) on slots: the TMA kernel's
    descriptors of the views the kept launch read (``matmul_tma.encoded_args``), the pointers
    the kernel has; ``scalars``: its integer arguments after its pointers, in order."""
    views = {}
    if tma:
        if entry.layouts is None or len(entry.layouts) != len(_MATMUL_DESCRIPTORS):
            return None
        flips = (matmul_tma.a_mmajor(a2), matmul_tma.b_kmajor(b), False, False, matmul_tma.b_kmajor(b), False)
        tensors = (a2, b, out, out, b, out)
        for name, t, flip, slot, layout in zip(_MATMUL_DESCRIPTORS, tensors, flips, (0, 1, 3, 4, 1, 4), entry.layouts):
            _, shape, strides = matmul_tma.row_major(t, flip)
            views[name] = (slot, shape, strides, layout)
    signature = triton_api.signature(entry.compiled)
    pointers = {name: (slot, 0) for name, slot in _MATMUL_POINTERS.items() if name in signature}
    return _slot_layout(entry, pointers, scalars, views)


def matmul_recipe(kept, a, a2, b, bias, out, launched, store_pre: bool, grad_step, name: str, fallback, table=None):
    """The C++ table's copy of ``kept`` (a ``runtime.matmul.KeptMatmul`` whose call ``a``
    (``a2`` its 2-D view), ``b``, ``bias`` launched into ``out``) as ``(table, handle)``;
    ``launched``: ``(entry, tma, scalars)``, the kept launch it repeats (``runtime.matmul.
    table_launch``: the TMA kernel's or the pointer kernel's, and the kernel's integer arguments
    after its pointers). ``store_pre``: the call keeps its pre-activation for the backward
    (a recorded GELU or SiLU). Its node's backward launches ``grad_step`` (``(kernel, param)`` of the
    activation's gradient on (grad, saved), None without an activation), else runs
    ``fallback(grad, a, b, saved, needs)``. None where the table is off, not built, or cannot
    repeat the launch (a parameter it does not pack, a 2-D ``a2`` that is not a view of ``a``).
    ``a``'s layout is the signature's, so the launch reads it as ``a2``."""
    if not enabled() or (table is None and not applies()) or launched is None:
        return None
    if a2 is not a and a2.data_ptr() != a.data_ptr():
        return None
    entry, tma, scalars = launched
    geometry = None if entry is None else _plain_launch(entry)
    layout = None if geometry is None else _matmul_layout(entry, a2, b, out, scalars, tma)
    step = (None, 0, 0) if grad_step is None else (grad_step[0], *(_param_encoding(grad_step[1]) or (None, None)))
    if layout is None or step[1] is None:
        return None
    table = table if table is not None else _table()
    if table is None:
        return None
    saves = 2 if store_pre else 1 if kept.activation == "relu" else 0
    handle = table.matmul_recipe(
        entry.function,
        *geometry,
        *layout,
        kept.device,
        kept.m,
        kept.k,
        kept.n,
        [*kept.lead, kept.n],
        kept.dtype,
        store_pre,
        saves,
        bias is not None,
        *step,
        name,
        fallback,
    )
    return table, handle
