"""The normalisation family on the host: checks, the rows view, launches.

A normalisation over ``normalized_shape`` (the trailing dims) sees its input as ``rows``
rows of ``n = prod(normalized_shape)`` columns with unit stride, each row at one stride
(a row slice, a padded or batched buffer: read in place). An input whose rows no single
stride reaches (a transposed last dim) is copied once; float64 runs PyTorch's composition
(the reference path), as the kernels compute in float32.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import ArgumentError, DeviceError, DTypeError, ShapeError
from ..kernels.helpers import INTERPRETED
from ..kernels.norm import CHUNK, MAX_ONE_PASS, norm_backward_kernel, norm_forward_kernel
from ..registry import FLOAT_DTYPES
from . import launch
from .configs import COMPILER_OPTIONS, cdiv, pow2_at_least

#: The input dtypes the kernels take (float64 runs the reference composition).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NORM_DTYPES = FLOAT_DTYPES


def normalized_size(x: torch.Tensor, normalized_shape, name: str) -> tuple[tuple, int]:
    """``normalized_shape`` as a tuple and its element count, checked against ``x``'s
    trailing dims (``ShapeError``) as torch checks them."""
    try:  # (ints, and what converts to one exactly as an index does: numpy's)
        shape = (
            (operator.index(normalized_shape),)
            if not hasattr(normalized_shape, "__iter__")
            else tuple(operator.index(d) for d in normalized_shape)
        )
    except TypeError:
        raise ShapeError(f"{name}(): normalized_shape must be ints, got {normalized_shape!r}") from None
    if any(isinstance(d, bool) for d in (normalized_shape if hasattr(normalized_shape, "__iter__") else ())):
        raise ShapeError(f"{name}(): normalized_shape must be ints, got {normalized_shape!r}")
    if not shape or tuple(x.shape[x.dim() - len(shape) :]) != shape or len(shape) > x.dim():
        raise ShapeError(
            f"{name}(): normalized_shape {list(shape)} is not the trailing dims of the input's shape {list(x.shape)}"
        )
    return shape, math.prod(shape)


def validate(name: str, x, residual, weight, bias, shape: tuple, eps) -> None:
    """Every check before a launch: tensors, float dtypes, one device, shapes (``residual``
    as ``x``, ``weight`` and ``bias`` as ``normalized_shape``), a finite non-negative ``eps``."""
    for arg, value in (("input", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise DTypeError(f"{name}(): {arg} must be a tensor, got {type(value).__name__}")
        if value.dtype not in NORM_DTYPES:
            raise DTypeError(f"{name}(): {arg} has dtype {value.dtype}; takes {', '.join(map(str, NORM_DTYPES))}")
        if value.device != x.device:
            raise DeviceError(f"{name}(): {arg} is on {value.device}, the input on {x.device}")
    if residual is not None and residual.shape != x.shape:
        raise ShapeError(f"{name}(): residual has shape {list(residual.shape)}, the input {list(x.shape)}")
    for arg, value in (("weight", weight), ("bias", bias)):
        if value is not None and tuple(value.shape) != shape:
            raise ShapeError(f"{name}(): {arg} has shape {list(value.shape)}, normalized_shape is {list(shape)}")
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < math.inf):
        raise ArgumentError(f"{name}(): eps must be a finite number >= 0, got {eps!r}")


def rows_of(t: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """``t`` as ``(rows, n)`` with unit column stride: a view where one row stride reaches
    every row, else a copy (made once, the launch reads it)."""
    if n > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    try:
        view = t.view(rows, n)
    except RuntimeError:
        view = t.reshape(rows, n)  # (a copy: no one row stride reaches every row)
    if n > 1 and view.stride(1) != 1:
        view = view.contiguous()
    return view


@functools.cache
def _programs_per_device(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _config(n: int) -> dict:
    """Block sizes and warps: a row in one block up to ``MAX_ONE_PASS`` columns, several
    narrow rows a program (about 4096 elements a block), wider rows in chunks (shared: read only)."""
    if n <= MAX_ONE_PASS:
        block_n = pow2_at_least(max(n, 1))
        block_m = max(1, min(16, 4096 // block_n))
        return {
            "ONE_PASS": True,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "warps": min(16, max(1, block_m * block_n // 512)),
        }
    return {"ONE_PASS": False, "BLOCK_M": 1, "BLOCK_N": CHUNK, "warps": 8}


def forward_launch(x2, residual2, weight, bias, y, h, mean, rstd, eps: float, alpha: float, rms: bool):
    """``(grid, args, meta)`` of the forward kernel's launch (meta with ``num_warps``)."""
    rows, n = x2.shape
    cfg = _config(n)
    any_ = y  # (a placeholder pointer for an absent operand: never read)
    args = (
        *(t if t is not None else any_ for t in (x2, residual2, weight, bias, y, h, mean, rstd)),
        float(eps),
        float(alpha),
        rows,
        n,
        *(t.stride(0) if t is not None else 0 for t in (x2, residual2, y, h, weight, bias)),
    )
    meta = {
        "RMS": rms,
        "RESIDUAL": residual2 is not None,
        "WEIGHT": weight is not None,
        "BIAS": bias is not None,
        "STATS": rstd is not None,
        "ONE_PASS": cfg["ONE_PASS"],
        "BLOCK_M": cfg["BLOCK_M"],
        "BLOCK_N": cfg["BLOCK_N"],
        "num_warps": cfg["warps"],
    }
    return (cdiv(rows, cfg["BLOCK_M"]),), args, meta


#: Kept launches of both kernels, by everything Triton specialises on (:func:`_launch`).
LAUNCHES = launch.CompiledCache()
launch.register_cache(LAUNCHES.clear)
_CONSTEXPRS = {k: launch.constexpr_names(k) for k in (norm_forward_kernel, norm_backward_kernel)}
#: Each kernel's pointer parameters: its leading ones (``*_ptr``), then scalars.
_POINTERS = {k: launch.pointer_count(k) for k in (norm_forward_kernel, norm_backward_kernel)}


def _launch_key(kernel, args: tuple, meta: dict, index: int) -> tuple[tuple, list, tuple]:
    """``(key, pointers, scalars)`` of a launch: its kept-launch key (see :func:`_launch`), the
    pointer arguments' addresses and the scalar arguments."""
    count = _POINTERS[kernel]
    tensors, scalars = args[:count], args[count:]
    pointers = [t.data_ptr() for t in tensors]
    key = (kernel, index, tuple([t.dtype for t in tensors]), _alignment(pointers), scalars, tuple(meta.values()))
    return key, pointers, scalars


def _or(pointers) -> int:
    out = 0
    for p in pointers:
        out |= p
    return out


#: :func:`_alignment` of ``k`` aligned pointers, by ``k``.
_ALL_ALIGNED = {k: (1 << k) - 1 for k in (8, 9)}


def _alignment(pointers) -> int:
    """One bit a pointer, first pointer highest: whether it is 16-byte aligned (Triton specialises on it)."""
    aligned = 0
    for p in pointers:
        aligned = (aligned << 1) | (p % launch.ALIGNMENT == 0)
    return aligned


def _launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``: directly (``launch.CompiledCache``) when a launch of
    the same key ran before, the key being everything Triton specialises on: the pointers'
    dtypes and 16-byte alignment, the scalars exactly (each slot always one type; the integers
    fix the grid too), the switches, the device. Triton's own launch re-binds some 25
    arguments a call (docs/design.md, "The eager fast path"); a norm in a decode step is all
    host time, and this key takes a third of the time the per-argument one did."""
    if launch.INTERPRETED:
        with launch.serialised():
            kernel[grid](*args, **meta, **COMPILER_OPTIONS)
        return
    index = args[0].device.index
    if index != launch.current_device():
        with torch.cuda.device(index):
            return _launch(kernel, grid, args, meta)
    key, pointers, scalars = _launch_key(kernel, args, meta, index)
    entry = LAUNCHES.get(key)
    if entry is not None:
        launch.CompiledCache.run(entry, (*pointers, *scalars), index)
        return
    compiled = kernel[grid](*args, **meta, **COMPILER_OPTIONS)
    LAUNCHES.put(key, compiled, (*grid, 1, 1)[:3], tuple(meta[name] for name in _CONSTEXPRS[kernel]))


def forward(x2, residual2, weight, bias, eps: float, alpha: float, rms: bool, y_dtype, h_dtype, stats: bool):
    """``(y, h, mean, rstd)`` over rows of ``x2`` (and ``residual2``): ``h`` None without a
    residual; ``mean`` None for RMS; the statistics (float32, one a row) only with ``stats``."""
    rows, n = x2.shape
    y = torch.empty((rows, n), dtype=y_dtype, device=x2.device)
    h = torch.empty((rows, n), dtype=h_dtype, device=x2.device) if residual2 is not None else None
    mean = torch.empty(rows, dtype=torch.float32, device=x2.device) if stats and not rms else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device) if stats else None
    if rows == 0 or n == 0:
        if rstd is not None:  # (rows of no columns: statistics of nothing, never read)
            rstd.fill_(math.inf)
            if mean is not None:
                mean.zero_()
        return y, h, mean, rstd
    _launch(norm_forward_kernel, *forward_launch(x2, residual2, weight, bias, y, h, mean, rstd, eps, alpha, rms))
    return y, h, mean, rstd


class Recipe(NamedTuple):
    """A kept eager call's forward without a gradient, settled by its first run (:func:`recipe`):
    what :func:`run_recipe` needs to allocate the results and launch the kept kernel, with no
    rows views, argument tuple or launch key built again (in a decode step a norm is all host
    time, and these were half of it)."""

    entry: launch.Entry
    index: int
    device: torch.device
    shape: tuple  # the results' (the input's)
    y_dtype: torch.dtype
    h_dtype: torch.dtype | None  # None: no residual
    aligned: int  # the pointers' 16-byte alignment the kernel was compiled for (:func:`_alignment`)
    scalars: tuple


def recipe(x, residual, weight, bias, x2, residual2, weight1, bias1, y, h, eps, alpha, rms) -> Recipe | None:
    """The :class:`Recipe` of a forward that just ran on rows ``x2`` (``residual2``) with results
    ``y`` and ``h``, when every rows view reads its tensor in place (the same address: the
    kernel's pointers are the call's tensors') and the launch was kept; else None."""
    if launch.INTERPRETED or y.numel() == 0:
        return None
    for t, view in ((x, x2), (residual, residual2), (weight, weight1), (bias, bias1)):
        if t is not None and t.data_ptr() != view.data_ptr():
            return None
    grid, args, meta = forward_launch(x2, residual2, weight1, bias1, y, h, None, None, eps, alpha, rms)
    index = x2.device.index
    key, pointers, scalars = _launch_key(norm_forward_kernel, args, meta, index)
    entry = LAUNCHES.get(key)
    if entry is None:
        return None
    h_dtype = None if h is None else h.dtype
    return Recipe(entry, index, x.device, tuple(x.shape), y.dtype, h_dtype, _alignment(pointers), scalars)


def run_recipe(r: Recipe, x, residual, weight, bias):
    """``y`` (or ``(y, h)``) of a call whose signature kept ``r``, launched directly; None where
    this call's pointers are aligned otherwise or another device is current (the caller then
    takes the ordinary path)."""
    if r.index != launch.current_device():
        return None
    y = torch.empty(r.shape, dtype=r.y_dtype, device=r.device)
    h = None if r.h_dtype is None else torch.empty(r.shape, dtype=r.h_dtype, device=r.device)
    any_ = y.data_ptr()
    # (forward_launch's order: x, residual, weight, bias, y, h, mean, rstd; an absent one y's)
    pointers = (
        x.data_ptr(),
        any_ if residual is None else residual.data_ptr(),
        any_ if weight is None else weight.data_ptr(),
        any_ if bias is None else bias.data_ptr(),
        any_,
        any_ if h is None else h.data_ptr(),
        any_,
        any_,
    )
    if _alignment(pointers) != r.aligned:
        return None
    launch.CompiledCache.run(r.entry, (*pointers, *r.scalars), r.index)
    return y if h is None else (y, h)


#: Recipes of kept calls without a gradient, by call signature (:func:`call_key`); None where a
#: signature has none (its rows views copy, or it was not kept), so that it is not tried again.
RECIPES: dict = {}
launch.register_cache(RECIPES.clear)


class GradRecipe(NamedTuple):
    """A kept eager call with a gradient, settled by its first run (:func:`grad_recipe`): the
    forward's kept launch, what its backward needs, and the backward's kept launches, learnt by
    its first run (:func:`learn_backward`), by whether a gradient reached ``h`` too. The
    statistics live in one buffer (LayerNorm's mean, then its rstd at a 16-byte-aligned
    offset): one allocation, as torch's norm makes (through the ordinary path a norm's forward
    and backward issue in 3x eager's host time: ``benchmarks/host_profile.py``)."""

    entry: launch.Entry
    index: int
    device: torch.device
    shape: tuple  # the input's, the results' and the input gradients'
    rows: int
    n: int
    eps: float
    alpha: float
    rms: bool
    y_dtype: torch.dtype
    h_dtype: torch.dtype | None  # None: no residual
    dtypes: tuple  # x's and the residual's (None without one): their gradients'
    aligned: int  # the forward's pointers' alignment (:func:`_alignment`)
    scalars: tuple
    stats: int  # the statistics buffer's elements (float32)
    rstd_at: int  # rstd's offset in it, in elements (0 for RMS: there is no mean)
    backward: dict  # dh_out given (bool) -> BackwardRecipe, or None where it has none
    params: tuple  # (weight given, bias given)


class BackwardRecipe(NamedTuple):
    """A :class:`GradRecipe`'s backward launch, kept: the partial sums of the parameters'
    gradients in one buffer, ``parts`` rows each (weight first)."""

    entry: launch.Entry
    aligned: int
    scalars: tuple
    # the saved rows' dtype and strides and the weight's strides and dtype, as the launch read
    # them (saved-tensor hooks may give them back laid out otherwise: offloaded and restored, say)
    saved: tuple
    parts: tuple  # (k, programs, n) of the partial sums; k = 0: no parameter gradient
    zeroed: bool  # chunked rows add into their partial row: it starts at zero
    need_weight: bool
    has_bias: bool
    dh_dtype: torch.dtype


def _stats_layout(rows: int, rms: bool) -> tuple[int, int]:
    """(elements, rstd's offset) of a :class:`GradRecipe`'s statistics buffer."""
    if rms:
        return rows, 0
    padded = -(-rows // 4) * 4  # (rstd 16-byte aligned, as a buffer of its own is)
    return 2 * padded, padded


#: Whether repeated calls with a gradient keep grad recipes (and the C++ table's copies of
#: them): an ``add_rms_norm`` forward + backward issues in 1.1-1.2x eager's host time with
#: them, 2.9x without (``benchmarks/host_profile.py``); ``FUSEDKIT_NORM_GRAD_RECIPES=0`` turns them
#: off (they run on a GPU only; the CPU tests check their launches' arguments against the
#: ordinary path's).
GRAD_RECIPES_ON = os.environ.get("FUSEDKIT_NORM_GRAD_RECIPES", "1") != "0"


def grad_recipe(x, residual, weight, bias, x2, residual2, weight1, bias1, y, h, plan) -> GradRecipe | None:
    """The :class:`GradRecipe` of a call with a gradient whose forward just ran on rows ``x2``
    (``residual2``), with results ``y`` and ``h``, by ``plan`` (a :class:`Kept`): where every
    rows view reads its tensor in place, the parameters are vectors and the launch was kept."""
    if not GRAD_RECIPES_ON or launch.INTERPRETED or y.numel() == 0 or len(plan.shape) != 1:
        return None
    for t, view in ((x, x2), (residual, residual2), (weight, weight1), (bias, bias1)):
        if t is not None and t.data_ptr() != view.data_ptr():
            return None
    stats = torch.empty(1, dtype=torch.float32, device=y.device)  # (the statistics' dtype and alignment)
    mean = None if plan.rms else stats
    grid, args, meta = forward_launch(x2, residual2, weight1, bias1, y, h, mean, stats, plan.eps, plan.alpha, plan.rms)
    index = x2.device.index
    key, pointers, scalars = _launch_key(norm_forward_kernel, args, meta, index)
    entry = LAUNCHES.get(key)
    if entry is None:
        return None
    size, rstd_at = _stats_layout(plan.rows, plan.rms)
    return GradRecipe(
        entry,
        index,
        x.device,
        tuple(x.shape),
        plan.rows,
        plan.n,
        plan.eps,
        plan.alpha,
        plan.rms,
        plan.y_dtype,
        None if h is None else h.dtype,
        (x.dtype, None if residual is None else residual.dtype),
        _alignment(pointers),
        scalars,
        size,
        rstd_at,
        {},
        (weight is not None, bias is not None),
    )


def grad_pointers(r: GradRecipe, x, residual, weight, bias) -> tuple | None:
    """The inputs' addresses (x, residual, weight, bias; 0 for an absent one) where ``r``'s
    kept launch takes this call: aligned as it was compiled for, on the current device."""
    if r.index != launch.current_device():
        return None
    ptrs = (
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        0 if weight is None else weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
    )
    if r.aligned == _ALL_ALIGNED[8] and not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) % launch.ALIGNMENT:
        return ptrs  # (the usual case, in one test)
    # (forward_launch's order, an absent operand and every result at y's aligned address)
    check = (*(launch.ALIGNMENT if p == 0 else p for p in ptrs), *(launch.ALIGNMENT,) * 4)
    return ptrs if _alignment(check) == r.aligned else None


def run_grad_forward(r: GradRecipe, ptrs: tuple):
    """``(y, h, stats)`` of a call ``r`` takes (:func:`grad_pointers` gave ``ptrs``): ``h``
    None without a residual."""
    y = torch.empty(r.shape, dtype=r.y_dtype, device=r.device)
    h = None if r.h_dtype is None else torch.empty(r.shape, dtype=r.h_dtype, device=r.device)
    stats = torch.empty(r.stats, dtype=torch.float32, device=r.device)
    any_, at = y.data_ptr(), stats.data_ptr()
    x, residual, weight, bias = (any_ if p == 0 else p for p in ptrs)
    mean = any_ if r.rms else at
    pointers = (x, residual, weight, bias, any_, any_ if h is None else h.data_ptr(), mean, at + 4 * r.rstd_at)
    launch.CompiledCache.run(r.entry, (*pointers, *r.scalars), r.index)
    return y, h, stats


def stats_views(r: GradRecipe, stats: torch.Tensor) -> tuple:
    """(mean, rstd) in a :class:`GradRecipe`'s statistics buffer (mean None for RMS)."""
    if r.rms:
        return None, stats
    return stats[: r.rows], stats[r.rstd_at : r.rstd_at + r.rows]


def learn_backward(r: GradRecipe, dy, rows, weight, bias, stats, dh_out, need_weight: bool) -> None:
    """Keep the backward launch the ordinary path just made for a call of ``r`` (the gradients
    rows of unit stride: the only ones :func:`run_grad_backward` takes)."""
    given = dh_out is not None
    if given in r.backward or launch.INTERPRETED:
        return
    if not dy.is_contiguous() or (given and not dh_out.is_contiguous()):
        return  # (another backward of the signature may learn it: a loss's sum gives an expanded dy)
    n, count = r.n, r.rows
    r.backward[given] = None
    rows2 = rows_of(rows, count, n)
    if rows2.data_ptr() != rows.data_ptr():
        return  # (a copy: the launch's rows are not the saved tensor's)
    per_program, programs = _backward_programs(count, n, rows.device)
    need_weight = weight is not None and need_weight
    k = need_weight + (bias is not None)
    parts = torch.empty((k, programs, n), dtype=torch.float32, device=rows.device) if k else None
    mean, rstd = stats_views(r, stats)
    dh_dtype = rows.dtype
    dx = torch.empty((count, n), dtype=dh_dtype, device=rows.device)
    grid, args, meta = backward_launch(
        dy.view(count, n),
        rows2,
        weight,
        mean,
        rstd,
        None if dh_out is None else dh_out.view(count, n),
        dx,
        parts[0] if need_weight else None,
        parts[k - 1] if bias is not None else None,
        r.rms,
        per_program,
    )
    key, pointers, scalars = _launch_key(norm_backward_kernel, args, meta, r.index)
    entry = LAUNCHES.get(key)
    if entry is None:
        return
    r.backward[given] = BackwardRecipe(
        entry,
        _alignment(pointers),
        scalars,
        (rows.dtype, rows.stride(), *_weight_layout(weight)),
        (k, programs, n),
        n > MAX_ONE_PASS,
        need_weight,
        bias is not None,
        dh_dtype,
    )


def _weight_layout(weight) -> tuple:
    return (None, None) if weight is None else (weight.stride(), weight.dtype)


def run_grad_backward(r: GradRecipe, dy, rows, weight, bias, stats, dh_out):
    """``(dh, dweight, dbias)`` of a call of ``r`` from its kept backward launch (``dh`` in the
    input's shape, the parameters' gradients in their dtypes, None where not needed); None
    where it has none for this call (the gradients' layout or alignment, the current device)."""
    b = r.backward.get(dh_out is not None)
    if b is None or not dy.is_contiguous() or (dh_out is not None and not dh_out.is_contiguous()):
        return None
    if b.saved != (rows.dtype, rows.stride(), *_weight_layout(weight)) or dy.dtype is not r.y_dtype:
        return None
    if dh_out is not None and dh_out.dtype is not r.h_dtype:
        return None
    if stats.dtype is not torch.float32 or stats.numel() != r.stats or not stats.is_contiguous():
        return None  # (as for the rows: what a saved-tensor hook gave back)
    if r.index != launch.current_device():
        return None
    device = r.device
    dh = torch.empty(r.shape, dtype=b.dh_dtype, device=device)
    k = b.parts[0]
    parts = (torch.zeros if b.zeroed else torch.empty)(b.parts, dtype=torch.float32, device=device) if k else None
    any_ = dh.data_ptr()
    at = stats.data_ptr()
    first = any_ if parts is None else parts.data_ptr()
    pointers = (
        dy.data_ptr(),
        rows.data_ptr(),
        any_ if weight is None else weight.data_ptr(),
        any_ if r.rms else at,
        at + 4 * r.rstd_at,
        any_ if dh_out is None else dh_out.data_ptr(),
        any_,
        first if b.need_weight else any_,
        first + 4 * b.parts[1] * b.parts[2] * (k - 1) if b.has_bias else any_,
    )
    if (
        not (b.aligned == _ALL_ALIGNED[9] and not _or(pointers) % launch.ALIGNMENT)
        and _alignment(pointers) != b.aligned
    ):
        return None
    launch.CompiledCache.run(b.entry, (*pointers, *b.scalars), r.index)
    if not k:
        return dh, None, None
    # (a sum over the programs' rows in a fixed order: the same bits every run; a sum a
    # parameter: their gradients in storages of their own, as torch's norms give them)
    dw = parts[0].sum(0) if b.need_weight else None
    db = parts[k - 1].sum(0) if b.has_bias else None
    if dw is not None and weight.dtype is not torch.float32:
        dw = dw.to(weight.dtype)
    if db is not None and bias.dtype is not torch.float32:
        db = db.to(bias.dtype)
    return dh, dw, db


#: Grad recipes of kept calls, by call signature (:func:`call_key`); None where a signature has
#: none, so that it is not tried again.
GRAD_RECIPES: dict = {}
launch.register_cache(GRAD_RECIPES.clear)
#: The C++ launch table's copies of grad recipes (``runtime.native.norm_recipe``: ``(table,
#: handle)``, None where it takes none), by call signature.
NATIVE: dict = {}
launch.register_cache(NATIVE.clear)


def _backward_programs(rows: int, n: int, device) -> tuple[int, int]:
    """(rows a program, programs) of the backward's launch: runs of whole row blocks, four
    programs a multiprocessor."""
    block_m = _config(n)["BLOCK_M"]
    per_program = block_m * cdiv(rows, block_m * _programs_per_device(device))
    return per_program, cdiv(rows, per_program)


def backward_launch(dy2, h2, weight, mean, rstd, dh_out2, dx, dw_part, db_part, rms: bool, per_program: int):
    """``(grid, args, meta)`` of the backward kernel's launch (meta with ``num_warps``)."""
    rows, n = h2.shape
    cfg = _config(n)
    any_ = dx
    args = (
        *(t if t is not None else any_ for t in (dy2, h2, weight, mean, rstd, dh_out2, dx, dw_part, db_part)),
        rows,
        n,
        per_program,
        *(t.stride(0) if t is not None else 0 for t in (dy2, h2, dh_out2, dx, weight)),
    )
    meta = {
        "RMS": rms,
        "WEIGHT": weight is not None,
        "BIAS": db_part is not None,
        "RESIDUAL_GRAD": dh_out2 is not None,
        "ONE_PASS": cfg["ONE_PASS"],
        "BLOCK_M": cfg["BLOCK_M"],
        "BLOCK_N": cfg["BLOCK_N"],
        "WEIGHT_GRAD": dw_part is not None,
        "num_warps": min(cfg["warps"], 8),
    }
    return (cdiv(rows, per_program),), args, meta


def backward(dy2, h2, weight, mean, rstd, dh_out2, rms: bool, has_bias: bool, dx_dtype, need_weight: bool):
    """``(dx, dweight, dbias)`` (float32 sums cast to the parameters' dtypes) from the output's
    gradient ``dy2``, the normalised rows ``h2`` and their statistics; ``dh_out2``: the
    gradient that reached ``h`` itself (add + norm), added to ``dx``. The weight (when given)
    scales the gradient; its own gradient is computed with ``need_weight``."""
    rows, n = h2.shape
    device = h2.device
    dx = torch.empty((rows, n), dtype=dx_dtype, device=device)
    if rows == 0 or n == 0:
        if dh_out2 is not None:
            dx.copy_(dh_out2)
        dw = torch.zeros(n, dtype=torch.float32, device=device) if weight is not None and need_weight else None
        db = torch.zeros(n, dtype=torch.float32, device=device) if has_bias else None
        return dx, dw, db
    per_program, programs = _backward_programs(rows, n, device)
    # The parameters' partial sums in one buffer, weight's first (as a
    # kept call's are: :func:`run_grad_backward`); chunked rows add into their program's
    # partial row: it starts at zero.
    need_weight = weight is not None and need_weight
    k = need_weight + has_bias
    alloc = torch.empty if n <= MAX_ONE_PASS else torch.zeros
    parts = alloc((k, programs, n), dtype=torch.float32, device=device) if k else None
    dw_part = parts[0] if need_weight else None
    db_part = parts[k - 1] if has_bias else None
    _launch(
        norm_backward_kernel,
        *backward_launch(dy2, h2, weight, mean, rstd, dh_out2, dx, dw_part, db_part, rms, per_program),
    )
    # (a sum over the programs' rows in a fixed order: the same bits every run; float32 until
    # the caller rounds it, after a sharded call's reduction; a sum a parameter: storages of
    # their own)
    return dx, (dw_part.sum(0) if need_weight else None), (db_part.sum(0) if has_bias else None)


class Kept(NamedTuple):
    """A repeated eager call's plan (its signature checked once): the rows view and dtypes."""

    rows: int
    n: int
    lead: tuple
    shape: tuple
    eps: float
    alpha: float
    rms: bool
    y_dtype: torch.dtype
    h_dtype: torch.dtype
    grad: bool


#: Kept plans by call signature (:func:`call_key`), for eager calls on plain tensors.
KEPT: dict = {}
_KEPT_SIZE = 1024


def _meta(t):
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_neg())


def call_key(name: str, x, residual, normalized_shape, weight, bias, eps, alpha, state) -> tuple | None:
    """Everything a norm call's checks and path depend on: the tensors' classes, shapes,
    strides, dtypes, devices, whether they require grad and carry a negation bit, the arguments
    (with their types: ``True`` is no alpha), and ``state`` (grad mode, autocast); None where it
    cannot be a key."""
    # (ints only: 6.0 and True equal 6 and 1 as keys, and the checks refuse them)
    if type(normalized_shape) in (tuple, list, torch.Size):
        if not all(type(d) is int for d in normalized_shape):
            return None
        normalized_shape = tuple(normalized_shape)
    elif type(normalized_shape) is not int:
        return None
    try:
        key = (
            name,
            _meta(x),
            _meta(residual),
            _meta(weight),
            _meta(bias),
            normalized_shape,
            eps,
            type(eps),
            alpha,
            type(alpha),
            state,
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def keep(key, plan: Kept) -> None:
    if len(KEPT) >= _KEPT_SIZE:
        KEPT.clear()  # rare: a process cycling through many signatures
        RECIPES.clear()
        GRAD_RECIPES.clear()
        NATIVE.clear()
    KEPT[key] = plan


launch.register_cache(KEPT.clear)


def reference(x, residual, weight, bias, eps, alpha, rms: bool, normalized_shape):
    """PyTorch's composition: ``(y, h)`` (``h`` None without a residual); float64 runs it."""
    h = x if residual is None else torch.add(x, residual, alpha=alpha)
    if rms:
        y = F.rms_norm(h, normalized_shape, weight, eps)
    else:
        y = F.layer_norm(h, normalized_shape, weight, bias, eps)
    return y, (None if residual is None else h)


__all__ = [
    "BackwardRecipe",
    "GRAD_RECIPES",
    "GRAD_RECIPES_ON",
    "GradRecipe",
    "INTERPRETED",
    "KEPT",
    "KERNEL_DTYPES",
    "Kept",
    "NATIVE",
    "RECIPES",
    "Recipe",
    "NORM_DTYPES",
    "backward",
    "call_key",
    "forward",
    "grad_pointers",
    "grad_recipe",
    "keep",
    "learn_backward",
    "normalized_size",
    "recipe",
    "reference",
    "rows_of",
    "run_grad_backward",
    "run_grad_forward",
    "run_recipe",
    "stats_views",
]
