"""The host side of the elementwise kernel: validation, the PyTorch path, launches and
the kept launches of repeated eager calls, for every entry of :mod:`fusedkit.registry`.

Read top to bottom:
- :func:`validate`: a call's operands, parameter and ``out`` checked as PyTorch checks
  them, into a :class:`Call` (shape, result dtype, device); nothing launched yet.
- :func:`launch_config` and :func:`launch_elementwise`: plan the layout
  (:mod:`fusedkit.runtime.layout`), encode host scalars, launch on the tensors'
  device and current stream.
- :func:`run_validated`: a validated call on its backend (compiled Triton, Triton's
  interpreter, or the registry's PyTorch reference), ``out=`` included.
- Kept launches: :func:`call_key` names an eager call's signature, :data:`KEPT` holds a
  :class:`KeptLaunch` per signature seen, which allocates and launches without
  validating again; :func:`run` is an eager call without autograd, kept or not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import struct
from dataclasses import dataclass

import torch
import triton.language as tl

from ..errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    FusedkitError,
    NotDifferentiableError,
    OverlapError,
    ScalarOverflowError,
    ShapeError,
    SignatureError,
)
from ..kernels.elementwise import POINTER_ARGS, elementwise_kernel
from ..registry import OPERAND_DTYPES, ElementwiseKernel, result_dtype
from . import launch, native
from .configs import COMPILER_OPTIONS
from .layout import (
    TooManyDims,
    broadcast_shape,
    broadcast_strides,
    is_dense_permutation,
    may_self_overlap,
    output_strides,
    plan_elementwise,
    span_bytes,
)

__all__ = [
    "BACKENDS",
    "Call",
    "KEPT",
    "KeptLaunch",
    "NEEDS_GRAD",
    "allocate_out",
    "backend_for",
    "call_key",
    "check_arity",
    "kept_launch",
    "launch_config",
    "launch_elementwise",
    "remember",
    "run",
    "run_kept",
    "run_pair",
    "run_validated",
    "validate",
]

#: Where a call can run: compiled Triton on a GPU, Triton's interpreter on the
#: host (``TRITON_INTERPRET=1``), or the registry's PyTorch reference.
BACKENDS = ("triton", "interpreter", "torch")

#: ``logging.getLogger("fusedkit")`` at DEBUG says which tile each new launch plan chose.
_log = logging.getLogger("fusedkit")

#: Triton's dtype per supported torch dtype.
_TL_DTYPE = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}
#: Arithmetic dtype per result dtype: half types compute in fp32 ("opmath").
_COMPUTE_DTYPE = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}
_INT64_MIN, _INT64_MAX = launch.INT64_MIN, launch.INT64_MAX
#: Python ints torch takes as a Scalar: int64, or uint64 above it.
_SCALAR_INT_END = 2**64
#: The dtype torch converts a float result's ``alpha`` to, with an overflow check (inf and NaN
#: pass), by device type: its CUDA kernels take it in the compute dtype (float32 for half
#: types), its CPU kernels in the result dtype itself (so fp16's alpha must fit float16).
_PARAM_DTYPE = {
    "cuda": {torch.float16: torch.float32, torch.bfloat16: torch.float32},
    "cpu": {},
}


#: Whether this process interprets the kernels (decided when Triton decorated them).
INTERPRETED = launch.INTERPRETED


def backend_for(tensor: torch.Tensor | torch.device | str) -> str:
    """Where a call on ``tensor`` (or a device) runs: one of :data:`BACKENDS`.

    CUDA tensors run the compiled Triton kernels; with ``TRITON_INTERPRET=1`` set
    before fusedkit was imported, CPU (and CUDA) tensors run the same kernels in
    Triton's interpreter; any other CPU tensor runs the registry's PyTorch
    reference, with the same semantics.
    """
    device = tensor.device if isinstance(tensor, torch.Tensor) else torch.device(tensor)
    if INTERPRETED and device.type in ("cpu", "cuda"):
        return "interpreter"
    if device.type == "cuda":
        return "triton"
    return "torch"


def scalar_bits(value, dtype: torch.dtype, what: str) -> int:
    """Encode a host scalar of a ``dtype`` result for ``kernels.helpers.scalar_value``: the float64 bits
    of its value, or an int64. An int beyond float64's exact range going into a float32
    computation is rounded to float32 here, once, as torch converts an int64 (through
    float64 it would round twice)."""
    if dtype.is_floating_point:
        if (
            type(value) is not float
            and isinstance(value, numbers.Integral)
            and abs(int(value)) >= _F64_EXACT
            and dtype != torch.float64
        ):
            value = _int_to_float32(int(value))  # (numpy ints too)
        return struct.unpack("<q", struct.pack("<d", float(value)))[0]
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise DTypeError(f"{what}={value} does not fit in int64")
    return value


#: Ints of at least this magnitude are not all exact in float64.
_F64_EXACT = 2**53
_F32_MANTISSA_BITS = 24


def _int_to_float32(value: int) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as a Python float."""
    magnitude = abs(value)
    shift = magnitude.bit_length() - _F32_MANTISSA_BITS
    if shift <= 0:
        return float(value)
    kept, rest = divmod(magnitude, 1 << shift)
    half = 1 << (shift - 1)
    if rest > half or (rest == half and kept & 1):
        kept += 1
    return math.copysign(float(kept << shift), value)


@dataclass
class Call:
    """A validated call: what the launcher and the PyTorch path both need."""

    kernel: ElementwiseKernel
    operands: tuple  # tensors on ``device`` and host numbers
    param: float | int | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    out: torch.Tensor | None
    needs_grad: bool = False
    #: False when ``out`` is written through a temporary (see ``_check_out``).
    direct: bool = True


#: Numbers as torch.compile traces them when they vary between calls.
_SYMBOLIC = (torch.SymInt, torch.SymFloat)


def _check_scalar_int(kernel: ElementwiseKernel, what: str, value) -> None:
    """An int operand or parameter must fit a torch Scalar: an int64, or a uint64 above it."""
    if isinstance(value, numbers.Integral) and not _INT64_MIN <= value < _SCALAR_INT_END:
        raise ScalarOverflowError(
            f"{kernel.name}(): {what}={value} is too big for a torch Scalar (an int64 or a uint64)"
        )


def _check_operand(kernel: ElementwiseKernel, name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise DTypeError(
                f"{kernel.name}(): argument '{name}' is complex ({value.dtype}); fusedkit takes real dtypes"
            )
        if value.dtype not in OPERAND_DTYPES:
            raise DTypeError(
                f"{kernel.name}(): argument '{name}' has dtype {value.dtype}; an operand may be "
                f"{', '.join(str(d) for d in OPERAND_DTYPES)}"
            )
        return
    if isinstance(value, _SYMBOLIC):
        return  # a traced number (torch.compile with dynamic shapes): its value is checked when it runs
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise DTypeError(
            f"{kernel.name}(): argument '{name}' must be a Tensor or a real number, got {type(value).__name__}"
        )
    if not isinstance(value, numbers.Real):
        raise DTypeError(f"{kernel.name}(): argument '{name}' is complex ({value!r}); fusedkit takes real numbers")
    _check_scalar_int(kernel, f"argument '{name}'", value)


def check_arity(kernel: ElementwiseKernel, operands: tuple) -> None:
    if len(operands) != kernel.arity:
        raise SignatureError(
            f"{kernel.name}() takes {kernel.arity} operands ({', '.join(kernel.arg_names)}), got {len(operands)}"
        )


def validate(kernel: ElementwiseKernel, operands: tuple, param, out, outputs: int = 1) -> Call:
    """``outputs``: the results the caller takes (2: :func:`run_pair`)."""
    if kernel.outputs != outputs:
        raise ArgumentError(
            f"{kernel.name} gives {kernel.outputs} result(s): "
            + (
                "run it with fusedkit.runtime.elementwise.run_pair"
                if kernel.outputs == 2
                else "run_pair takes a two-output kernel"
            )
        )
    check_arity(kernel, operands)
    for name, value in zip(kernel.arg_names, operands):
        _check_operand(kernel, name, value)
    tensors = [(n, t) for n, t in zip(kernel.arg_names, operands) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise DTypeError(f"{kernel.name}(): at least one of {', '.join(kernel.arg_names)} must be a Tensor")

    # The device: that of the first tensor with dims; 0-d CPU tensors act as scalars, as in torch.
    ranked = [(n, t) for n, t in tensors if not (t.dim() == 0 and t.device.type == "cpu")]
    device = (ranked or tensors)[0][1].device
    for n, t in ranked:
        if t.device != device:
            raise DeviceError(
                f"{kernel.name}(): argument '{n}' is on {t.device}, but "
                f"'{ranked[0][0]}' is on {device}; move them to one device"
            )

    shape = broadcast_shape([t.shape for _, t in tensors])
    if shape is None:
        shapes = ", ".join(f"{n}{tuple(t.shape)}" for n, t in tensors)
        raise ShapeError(f"{kernel.name}(): shapes do not broadcast: {shapes}")
    shape = torch.Size(shape)

    dtype = result_dtype(operands)
    if not dtype.is_floating_point and any(isinstance(v, numbers.Integral) and v > _INT64_MAX for v in operands):
        # torch would wrap a uint64 operand of an integer result around; a float result takes it.
        raise ScalarOverflowError(
            f"{kernel.name}(): an int operand beyond int64 cannot join an integral "
            f"({dtype}) result without wrapping around"
        )
    if dtype not in kernel.dtypes:
        raise DTypeError(
            f"{kernel.name}(): result dtype {dtype} is not supported; "
            f"supported: {', '.join(str(d) for d in kernel.dtypes)}"
        )

    if kernel.param is not None:
        _check_param(kernel, param, dtype, device)

    grad_inputs = torch.is_grad_enabled() and any(t.requires_grad for _, t in tensors)
    direct = True
    if out is not None:
        direct = _check_out(kernel, out, shape, dtype, device, tensors)
        if grad_inputs or (torch.is_grad_enabled() and out.requires_grad):
            raise FusedkitError(
                f"{kernel.name}(): out= does not support automatic differentiation, but an argument requires grad"
            )
    elif grad_inputs and kernel.backward is None:
        raise NotDifferentiableError(
            f"{kernel.name}(): this kernel declares no backward; call it under torch.no_grad(), or use "
            f"fusedkit.registry.get({kernel.name!r}).reference for a differentiable PyTorch version"
        )
    return Call(kernel, operands, param, shape, dtype, device, out, grad_inputs, direct)


def _check_param(kernel: ElementwiseKernel, param, dtype: torch.dtype, device: torch.device) -> None:
    """The parameter as torch checks ``alpha`` on ``device``: an int torch can take, an integer
    for an integral result (within its range), for a float result a value within the range of
    the dtype torch converts it to there (:data:`_PARAM_DTYPE`)."""
    if isinstance(param, _SYMBOLIC):
        return  # traced: checked when the op runs with the real value
    if isinstance(param, bool) or not isinstance(param, numbers.Real):
        raise DTypeError(f"{kernel.name}(): {kernel.param} must be a real number, got {type(param).__name__}")
    _check_scalar_int(kernel, kernel.param, param)
    if not dtype.is_floating_point:
        if not isinstance(param, numbers.Integral):
            raise DTypeError(f"{kernel.name}(): for integral results, {kernel.param} must be an integer, got {param!r}")
        if not torch.iinfo(dtype).min <= param <= torch.iinfo(dtype).max:
            raise ArgumentError(f"{kernel.name}(): {kernel.param}={param} does not fit in {dtype}")
    else:
        target = _PARAM_DTYPE.get(device.type, _PARAM_DTYPE["cuda"]).get(dtype, dtype)
        if math.isfinite(value := float(param)) and abs(value) > torch.finfo(target).max:
            raise ArgumentError(
                f"{kernel.name}(): {kernel.param}={param!r} cannot be converted to {target} without overflow "
                f"(torch converts a {dtype} result's {kernel.param} to {target} on {device.type})"
            )


def _check_out(kernel, out, shape, dtype, device, tensors) -> bool:
    """Check ``out`` as torch checks an ``out=`` argument; True when the kernel can write
    it directly, False when the result must go through a temporary: ``out`` is a lazily
    negated view, or may share elements with an input in a way torch does not check
    (neither is dense), so element order would decide the result."""
    if not isinstance(out, torch.Tensor):
        raise DTypeError(f"{kernel.name}(): out must be a Tensor, got {type(out).__name__}")
    if out.device != device:
        raise DeviceError(f"{kernel.name}(): out is on {out.device}, but the inputs are on {device}")
    if not torch.can_cast(dtype, out.dtype):
        raise DTypeError(f"{kernel.name}(): result type {dtype} can't be cast to the desired output type {out.dtype}")
    if out.shape != shape:
        raise ShapeError(f"{kernel.name}(): out has shape {tuple(out.shape)}, but the result has shape {tuple(shape)}")
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise FusedkitError(
            f"{kernel.name}(): out is an inference tensor; writing it outside InferenceMode "
            "is not allowed (as for torch's in-place ops)"
        )
    if out.numel() == 0:
        return True
    if may_self_overlap(out.shape, out.stride()):
        raise OverlapError(
            f"{kernel.name}(): out has elements that share memory (an expanded view?); writing it would be ambiguous"
        )
    direct = not out.is_neg() and out.dtype in _TL_DTYPE  # (e.g. int16 or complex: copy_ converts)
    lo, hi = span_bytes(out)
    out_strides = out.stride()
    out_dense = is_dense_permutation(out.shape, out.stride())
    for n, t in tensors:
        if t.numel() == 0 or t.device != out.device:
            continue
        t_lo, t_hi = span_bytes(t)
        if t_hi <= lo or hi <= t_lo:
            continue
        # Full aliasing (out=x, in place) is safe: each element is read, then written, by one thread.
        if (
            t.data_ptr() == out.data_ptr()
            and t.element_size() == out.element_size()
            and all(
                n_ == 1 or s_in == s_out
                for n_, s_in, s_out in zip(shape, broadcast_strides(t.shape, t.stride(), shape), out_strides)
            )
        ):
            continue
        if out_dense and is_dense_permutation(t.shape, t.stride()):
            # torch refuses exactly this case (its "partial overlap"); with a strided view it checks nothing.
            raise OverlapError(f"{kernel.name}(): out partially overlaps argument '{n}'; clone one of them first")
        if not _provably_disjoint(t, out):
            direct = False
    return direct


def _provably_disjoint(t: torch.Tensor, out: torch.Tensor) -> bool:
    """True when no element of ``t`` shares memory with one of ``out``: both of one element
    size, and the distance between their first elements is not a multiple of the gcd of
    their strides (``b[0::2]`` and ``b[1::2]``)."""
    size = t.element_size()
    if out.element_size() != size:
        return False
    delta = t.data_ptr() - out.data_ptr()
    if delta % size:
        return False
    step = math.gcd(
        *(s for n, s in zip(t.shape, t.stride()) if n > 1), *(s for n, s in zip(out.shape, out.stride()) if n > 1)
    )
    return step > 1 and (delta // size) % step != 0


def allocate_out(call: Call) -> torch.Tensor:
    """The result tensor, laid out as torch's TensorIterator lays out a new output."""
    strides = output_strides(
        call.shape,
        [(tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None for t in call.operands],
    )
    return torch.empty_strided(call.shape, strides, dtype=call.dtype, device=call.device)


def launch_config(
    kernel: ElementwiseKernel,
    operands: tuple,
    param,
    out: torch.Tensor,
    dtype: torch.dtype | None = None,
    out2: torch.Tensor | None = None,
):
    """``(grid, args, meta)`` of the launch that computes ``kernel`` into a non-empty ``out``;
    ``dtype`` is the result dtype when ``out`` has another one (it is rounded to ``dtype``,
    then converted to ``out.dtype``, as PyTorch does). ``out2``: a two-output kernel's
    second result, of ``out``'s shape, strides and dtype.

    Works on meta tensors too, so the code a call would compile can be inspected
    on a machine without a GPU (see ``fusedkit._codegen``).
    """
    shape = out.shape
    dtype = out.dtype if dtype is None else dtype
    is_float = dtype.is_floating_point
    strides = (tuple(out.stride()),) + tuple(
        broadcast_strides(t.shape, t.stride(), shape) if isinstance(t, torch.Tensor) else None for t in operands
    )
    plan = plan_elementwise(tuple(shape), strides, dtype.itemsize)

    ptrs, bits, flat_strides = [], [], []
    scalar_mask = 0
    for k in range(3):
        value = operands[k] if k < len(operands) else None
        if isinstance(value, torch.Tensor):
            ptrs.append(value)
            bits.append(0)
            flat_strides.extend(plan.strides[k + 1])
        else:
            ptrs.append(out)  # never read: the slot is a scalar or unused
            bits.append(0 if value is None else scalar_bits(value, dtype, kernel.arg_names[k]))
            flat_strides.extend((0,) * 6)
            if value is not None:
                scalar_mask |= 1 << (k + 1)
    param_bits = scalar_bits(param, dtype, kernel.param) if kernel.param is not None else 0

    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "%s: shape %s %s -> %s: %d programs of %d x %d (%d warps), %s offsets",
            kernel.name,
            tuple(shape),
            dtype,
            out.dtype,
            plan.grid,
            plan.tile.block_r,
            plan.tile.block_c,
            plan.tile.num_warps,
            "64-bit" if plan.int64 else "32-bit",
        )
    if (out2 is not None) != (kernel.outputs == 2) or (
        out2 is not None and (out2.shape != out.shape or out2.stride() != out.stride() or out2.dtype != out.dtype)
    ):
        raise ArgumentError(f"{kernel.name}: a two-output kernel takes out2 laid out as out; others none")
    args = (
        out,
        *ptrs,
        out if out2 is None else out2,
        *bits,
        param_bits,
        *plan.batch_sizes[1:],
        plan.size_r,
        plan.size_c,
        plan.tiles_c,
        plan.tiles_c_magic,
        plan.tiles_c_shift,
        plan.tiles_per_batch,
        *plan.strides[0],
        *flat_strides,
    )
    meta = dict(
        FN=kernel.math,
        NUM_INPUTS=kernel.arity,
        HAS_PARAM=kernel.param is not None,
        NUM_OUTPUTS=kernel.outputs,
        SCALAR_MASK=scalar_mask,
        UNIT_R_MASK=plan.unit_r_mask,
        UNIT_C_MASK=plan.unit_c_mask,
        RESULT_DTYPE=_TL_DTYPE[dtype],
        COMPUTE_DTYPE=_COMPUTE_DTYPE[dtype],
        COMPUTE_IS_FLOAT=is_float,
        BLOCK_R=plan.tile.block_r,
        BLOCK_C=plan.tile.block_c,
        INT64=plan.int64,
        BATCHED=plan.batched,
        num_warps=plan.tile.num_warps,
        **COMPILER_OPTIONS,
    )
    return (plan.grid,), args, meta


def launch_elementwise(
    kernel: ElementwiseKernel,
    operands: tuple,
    param,
    out: torch.Tensor,
    dtype: torch.dtype | None = None,
    out2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch ``kernel`` on validated operands (tensors on ``out``'s device, or numbers) into ``out``
    (and ``out2``, a two-output kernel's second result), under ``out``'s device and on its
    current stream; ``dtype`` is the result dtype when ``out`` has another one."""
    if out.numel() == 0:
        return out
    try:
        grid, args, meta = launch_config(kernel, operands, param, out, dtype, out2)
    except TooManyDims:
        # More non-mergeable dims than the kernel walks: one launch per index of the
        # output's outermost dim, on views (broadcast operands expanded, never copied).
        dim = max((d for d in range(out.dim()) if out.shape[d] > 1), key=lambda d: out.stride(d))
        for i in range(out.shape[dim]):
            part = tuple(t.expand(out.shape).select(dim, i) if isinstance(t, torch.Tensor) else t for t in operands)
            launch_elementwise(
                kernel, part, param, out.select(dim, i), dtype, None if out2 is None else out2.select(dim, i)
            )
        return out
    device = out.device
    with launch.serialised():
        if device.type == "cuda" and device.index != launch.current_device():
            with torch.cuda.device(device):
                elementwise_kernel[grid](*args, **meta)
        else:
            elementwise_kernel[grid](*args, **meta)
    return out


def _reference_result(call: Call):
    """The registry reference on a validated call (a pair for a two-output kernel)."""
    operands = call.operands
    if call.dtype in (torch.float16, torch.bfloat16):
        # Half types in float32, rounded once at the end: the arithmetic of torch's CUDA
        # kernels and of fusedkit's own (torch's CPU kernels would round alpha to the half type).
        operands = tuple(t.float() if isinstance(t, torch.Tensor) and t.dtype == call.dtype else t for t in operands)
    return call.kernel.reference(*operands, *((call.param,) if call.kernel.param is not None else ()))


def _run_reference(call: Call) -> torch.Tensor:
    result = _reference_result(call)
    # Same layout and dtype as the kernel path (and the op's fake implementation).
    out = call.out if call.out is not None else allocate_out(call)
    with torch.autograd.grad_mode.no_grad():
        out.copy_(result.to(call.dtype))  # rounded to the result dtype first when ``out`` has another
    return out


def _launch_operands(call: Call) -> tuple:
    """A validated call's operands as the kernel reads them."""
    # A lazily negated view (``z.conj().imag``) holds the un-negated values in memory.
    operands = tuple(t.resolve_neg() if isinstance(t, torch.Tensor) and t.is_neg() else t for t in call.operands)
    if call.device.type != "cpu":
        # Host 0-d tensors become host numbers (after promotion, which treats them as
        # tensors): a kernel cannot read host memory.
        operands = tuple(t.item() if isinstance(t, torch.Tensor) and t.device != call.device else t for t in operands)
    return operands


def run_validated(call: Call) -> torch.Tensor:
    """The eager path of a validated call: no dispatcher, straight to the launcher.

    ``out`` is written in place of the kernel's own output (its dtype may be any that
    the result casts to), its version counter bumped as torch's in-place ops bump it,
    so autograd refuses a backward through values it overwrote."""
    out = call.out
    if out is not None and not call.direct:
        # A lazily negated ``out``, or one that may share elements with an input:
        # compute into a new tensor and let ``copy_`` write it as torch would.
        result = run_validated(Call(call.kernel, call.operands, call.param, call.shape, call.dtype, call.device, None))
        with torch.autograd.grad_mode.no_grad():
            out.copy_(result)
        return out
    if backend_for(call.device) == "torch":
        result = _run_reference(call)
    else:
        result = out if out is not None else allocate_out(call)
        launch_elementwise(call.kernel, _launch_operands(call), call.param, result, call.dtype)
    if out is not None and not out.is_inference():
        torch.autograd.graph.increment_version(out)
    return result


# --- The eager fast path -------------------------------------------------------------
# A call whose signature (kernel, operand types, dtypes, devices, shapes, strides)
# was validated once reuses that validation, the layout plan, the grid and the
# compiled kernel: per call it only allocates the result, reads the pointers and
# scalars, and launches (see fusedkit.runtime.launch). Everything validation reads is in
# the key or re-checked per call (an integral alpha's range, scalars' range), so a
# call that differs in any of it takes the full path above.

CONSTEXPR_NAMES = launch.constexpr_names(elementwise_kernel)
#: Kernel arguments before the planned sizes and strides: the pointers (out, three operand
#: slots, out2), three scalar bit patterns and the parameter's.
_PER_CALL_ARGS = POINTER_ARGS + 4
#: Kept launches by call signature (a full cache is cleared, the C++ table's with it).
KEPT = launch.CallCache(native.clear)
launch.register_cache(plan_elementwise.cache_clear)


#: What :func:`call_key` returns for plain tensors of which one requires a gradient.
NEEDS_GRAD = object()


def call_key(kernel: ElementwiseKernel, operands: tuple, param):
    """The signature of an eager ``out=None`` call; None when it cannot take the fast path,
    :data:`NEEDS_GRAD` when it is an eager call that autograd must record."""
    # id(): the kept launch holds the kernel, so the id stays its own while the entry lives
    # (and a kernel spec need not be hashable).
    key = [id(kernel), type(param)]
    grad = None
    for v in operands:
        cls = type(v)
        if cls is torch.Tensor or cls is torch.nn.Parameter:  # subclasses (fake, functional) are traced
            if v.requires_grad and grad is None:
                grad = torch.is_grad_enabled()
            if v.is_neg():  # a lazily negated view: the full path resolves it
                return None
            key += (v.dtype, v.device, v.shape, v.stride())
        elif cls is float:
            key += (cls, torch.get_default_dtype())  # an integral tensor + a float promotes to it
        elif cls is int:
            key.append(cls)
        else:
            return None
    return NEEDS_GRAD if grad else tuple(key)


class KeptLaunch:
    """The prepared launch of one validated call signature."""

    __slots__ = (
        "kernel",
        "shape",
        "out_strides",
        "dtype",
        "device",
        "index",
        "slots",
        "tensor_slots",
        "host_numbers",
        "operand_signature",
        "like",
        "static_args",
        "constexprs",
        "launch_tail",
        "meta",
        "grid",
        "compiled",
        "last_param",
        "pair",
    )

    def __init__(
        self,
        kernel: ElementwiseKernel,
        result: torch.Tensor,
        operands: tuple,
        slots: tuple,
        static_args: tuple,
        constexprs: tuple,
        meta: dict,
        grid: tuple[int, int, int] | None,
    ):
        self.kernel = kernel
        self.pair = kernel.outputs == 2  # a two-output kernel's: both results laid out alike
        self.shape, self.out_strides = result.shape, tuple(result.stride())
        self.dtype, self.device, self.index = result.dtype, result.device, result.device.index
        #: Per kernel operand slot: the operand's index for a tensor, ``~index`` for a
        #: host number, None for an unused slot.
        self.slots = slots
        #: Per slot, the operand index whose address the kernel gets (None: ``out``'s, never read).
        self.tensor_slots = tuple(s if s is not None and s >= 0 else None for s in slots)
        self.host_numbers = any(s is not None and s < 0 for s in slots)
        #: Each operand's dtype, shape and strides when all are tensors (what a native launch matches).
        self.operand_signature = (
            None if self.host_numbers else tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in operands)
        )
        #: An operand of the result's dtype: ``new_empty_strided`` on it parses fewer
        #: arguments than ``torch.empty_strided`` (a quarter less host time on a CPU host).
        self.like = next((s for s in self.tensor_slots if s is not None and operands[s].dtype == result.dtype), None)
        self.static_args = static_args  # planned sizes and strides
        self.constexprs = constexprs  # in signature order
        #: What a kept launch appends to the per-call arguments: one tuple, built once.
        self.launch_tail = static_args + constexprs
        self.meta = meta
        self.grid = grid  # None: an empty result
        self.compiled = launch.CompiledCache()
        #: (param, its bit patterns and their int classes) of the last call: the default
        #: ``alpha`` is one object, so an identity check skips re-encoding it.
        self.last_param = (object(), None)

    def _bits(self, operands: tuple, param) -> tuple | None:
        """The scalar bit patterns (three slots, then the parameter) and what Triton keys
        them on; None sends the call down the full path (an int outside int64)."""
        last = self.last_param
        if last[0] is param and not self.host_numbers:
            return last[1]
        kernel = self.kernel
        if kernel.param is not None and last[0] is not param:  # (a repeated parameter was checked)
            _check_param(kernel, param, self.dtype, self.device)
        bits = []
        for slot in self.slots:
            if slot is None or slot >= 0:
                bits.append(0)
                continue
            value = operands[~slot]
            # Python ints outside int64 take the full path, which raises as torch does.
            if type(value) is int and not _INT64_MIN <= value <= _INT64_MAX:
                return None
            bits.append(scalar_bits(value, self.dtype, kernel.arg_names[~slot]))
        bits.append(scalar_bits(param, self.dtype, kernel.param) if kernel.param is not None else 0)
        # Triton specialises on whether an unspecialised int fits in 32 bits.
        encoded = (tuple(bits), tuple(map(launch.int_class, bits)))
        self.last_param = (param, encoded)  # with host numbers, only the check is reused
        return encoded

    def run(self, operands: tuple, param):
        """Launch on new operands of this signature: the result (a two-output kernel's pair),
        or None, which sends the call down the full path."""
        encoded = self._bits(operands, param)
        if encoded is None:
            return None
        out = self._empty(operands)
        out2 = self._empty(operands) if self.pair else out
        if self.grid is None:
            return (out, out2) if self.pair else out
        # Addresses, not tensors: Triton's launcher takes either, and skips a
        # data_ptr() call and a driver pointer query per argument for an int.
        o = out.data_ptr()
        ptrs = [o]
        misaligned = 0  # Triton specialises on 16-byte pointer alignment: one bit per pointer
        for s in self.tensor_slots:
            p = o if s is None else operands[s].data_ptr()
            ptrs.append(p)
            misaligned = (misaligned << 1) | (p % launch.ALIGNMENT != 0)
        o2 = out2.data_ptr()
        ptrs.append(o2)  # out2: ``out`` again for a one-output kernel, never written
        bits, classes = encoded
        misaligned |= (o % launch.ALIGNMENT != 0) << len(self.tensor_slots)
        if self.pair:
            misaligned |= (o2 % launch.ALIGNMENT != 0) << (len(self.tensor_slots) + 1)
        spec = (misaligned, classes)
        entry = self.compiled.get(spec)
        index = self.index
        result = (out, out2) if self.pair else out
        if entry is not None and index == launch.current_device():
            launch.CompiledCache.run(entry, (*ptrs, *bits), index)
            return result
        tensors = [out] + [out if s is None else operands[s] for s in self.tensor_slots] + [out2]
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._launch(spec, (*tensors, *bits), index)
        return result

    def _empty(self, operands: tuple) -> torch.Tensor:
        if self.like is None:
            return torch.empty_strided(self.shape, self.out_strides, dtype=self.dtype, device=self.device)
        return operands[self.like].new_empty_strided(self.shape, self.out_strides)

    def _launch(self, spec, per_call: tuple, index):
        entry = self.compiled.get(spec)
        if entry is not None:
            launch.CompiledCache.run(entry, per_call, index)
        else:
            with launch.serialised():
                compiled = elementwise_kernel[self.grid](*per_call, *self.static_args, **self.meta)
            self.compiled.put(spec, compiled, self.grid, self.launch_tail)
            entry = self.compiled.get(spec)
            if entry is not None and spec[0] == 0:  # aligned: C++ may launch it (a pair, from a backward plan)
                native.register(self, entry)


def _make_kept(kernel: ElementwiseKernel, operands: tuple, param, result: torch.Tensor) -> KeptLaunch | None:
    """The kept launch of validated ``operands`` into results laid out as ``result``; None for
    a host 0-d tensor operand (read with ``.item()`` per call, so not kept)."""
    slots = []
    for k, v in enumerate(operands):
        if isinstance(v, torch.Tensor):
            if v.device != result.device:
                return None
            slots.append(k)
        else:
            slots.append(~k)
    slots += [None] * (3 - len(slots))
    grid, static_args, constexprs, meta = None, (), (), {}
    if result.numel() > 0:
        try:
            grid_1d, args, meta = launch_config(
                kernel, operands, param, result, out2=result if kernel.outputs == 2 else None
            )
        except TooManyDims:  # launched in parts by launch_elementwise
            return None
        grid = (grid_1d[0], 1, 1)
        static_args = args[_PER_CALL_ARGS:]
        constexprs = tuple(meta[name] for name in CONSTEXPR_NAMES)
    return KeptLaunch(kernel, result, operands, tuple(slots), static_args, constexprs, meta, grid)


def remember(key, call: Call, result: torch.Tensor) -> None:
    """Keep the launch of a validated eager call whose signature ``key`` can repeat (a key of
    None or :data:`NEEDS_GRAD` keeps nothing)."""
    if (
        key is None
        or key is NEEDS_GRAD
        or call.out is not None
        or backend_for(call.device) == "torch"
        or not launch.enabled()
    ):
        return
    kept = _make_kept(call.kernel, call.operands, call.param, result)
    if kept is not None:
        KEPT.keep(key, kept)


def kept_launch(kernel: ElementwiseKernel, operands: tuple, param, out: torch.Tensor) -> KeptLaunch | None:
    """A kept launch of ``kernel`` for operands with these dtypes, shapes and strides (tensors
    on ``out``'s device, or numbers; validated by the caller), whose results are laid out as
    ``out`` is: ``kept.run(operands, param)`` allocates one and launches, or returns None
    for the caller to take :func:`launch_elementwise`. None where launches are not kept."""
    if kernel.outputs != 1 or backend_for(out.device) == "torch" or not launch.enabled():
        return None
    return _make_kept(kernel, operands, param, out)


def run_kept(key, operands: tuple, param, pair: bool = False):
    """The result (``pair``: both results of a two-output kernel) of the launch kept for the
    call signature ``key``, or None: a key of None or :data:`NEEDS_GRAD`, nothing kept yet, a
    kept launch of the other kind, or one these operands do not fit."""
    if key is None or key is NEEDS_GRAD:
        return None
    kept = KEPT.get(key)
    return None if kept is None or kept.pair != pair else kept.run(operands, param)


def run(kernel: ElementwiseKernel, operands: tuple, param) -> torch.Tensor:
    """An eager call without ``out=`` that autograd does not record (the caller rules out
    tracing, ``torch.func`` and gradients): its kept launch when the signature was seen,
    else validated, launched and kept."""
    key = call_key(kernel, operands, param)
    # (a two-output kernel's kept launch answers run_pair only: here the full path refuses it)
    result = run_kept(key, operands, param)
    if result is None:
        call = validate(kernel, operands, param, None)
        result = run_validated(call)
        remember(key, call, result)
    return result


def run_pair(kernel: ElementwiseKernel, operands: tuple, param) -> tuple[torch.Tensor, torch.Tensor]:
    """Both results of a two-output ``kernel`` (``outputs=2``: its math and its reference
    return a pair) on ``operands``, each of their broadcast shape and result dtype, laid out
    alike: validated, then one launch (the reference on the PyTorch backend), kept as
    :func:`run` keeps one-output calls: a backward's Python launch took three times its
    kernel's time at 2^24 elements (H200). For eager calls outside autograd
    (a backward's), as :func:`run` for one output."""
    key = call_key(kernel, operands, param)
    result = run_kept(key, operands, param, pair=True)
    if result is not None:
        return result
    call = validate(kernel, operands, param, None, outputs=2)
    out, out2 = allocate_out(call), allocate_out(call)
    if backend_for(call.device) == "torch":
        with torch.autograd.grad_mode.no_grad():
            for dst, result in zip((out, out2), _reference_result(call)):
                dst.copy_(result.to(call.dtype))
    else:
        launch_elementwise(kernel, _launch_operands(call), param, out, call.dtype, out2)
        remember(key, call, out)
    return out, out2
