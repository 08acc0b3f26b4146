"""The one decision every fused call takes: where it runs.

For an elementwise call (:func:`elementwise`) and a matmul (:func:`matmul`), in this order:
1. **Eager and seen before**: no ``out=``, no tracing, no Python dispatch mode, no
   ``torch.func`` transform, no profiler (C-level flags, one C call each): the C++ table's
   kept launch (:mod:`fusedkit.runtime.native`, which records the autograd node too), else
   the signature's kept launch in Python (:mod:`fusedkit.runtime`), or autograd records the
   call (:mod:`fusedkit.autograd`) when a tensor requires grad.
2. **Under a profiler**: the Python kept launches of 1 inside a ``fusedkit::<name>`` range.
3. **Under a ``torch.func`` transform**: the transform's Function, validated first.
4. **Traced** (``torch.compile``, a dispatch mode, a tensor subclass such as a FakeTensor):
   the registered custom op, whose fake implementation validates and infers the result.
5. **Eager, first time**: validated, launched (or recorded by autograd), and kept.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import autograd, registry, settings, sharding
from .errors import (
    ArgumentError,
    DeviceError,
    DTypeError,
    FusedkitError,
    NotDifferentiableError,
    ShapeError,
    TracingError,
)
from .registry import ElementwiseKernel, RowKernel, number_kind, result_dtype
from .runtime import elementwise as ew
from .runtime import matmul as mm
from .runtime import native
from .runtime import norm as rn
from .runtime.launch import CallCache

__all__ = ["elementwise", "matmul", "norm", "norm_dtype", "observed", "tracing"]

_is_compiling = torch.compiler.is_compiling
#: ``torch.jit.trace`` recording: calls go through the registered op, which it records.
_jit_tracing = torch._C._is_tracing
#: Python dispatch modes (``TorchDispatchMode``: make_fx, FlopCounterMode, selective
#: activation checkpointing, op loggers) on the stack; one C call.
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch = autograd.functorch_active
#: Whether a profiler is recording: ranges cost host time only then.
_profiling = torch._C._autograd._profiler_enabled
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_einsum = torch._VF.einsum
_forward_ad = torch.autograd.forward_ad
_call_key = ew.call_key
_NEEDS_GRAD = ew.NEEDS_GRAD


def tracing(tensors, out=None) -> bool:
    """True while Dynamo traces, while a Python dispatch mode or a ``torch.func`` transform
    is active, or when a tensor is a subclass (a FakeTensor or FunctionalTensor during AOT
    tracing, for instance): such calls go through the registered op, which they can see."""
    if _is_compiling() or _dispatch_modes() or _functorch() or _jit_tracing():
        return True
    for t in tensors:
        if isinstance(t, torch.Tensor) and type(t) not in _PLAIN:
            return True
    return isinstance(out, torch.Tensor) and type(out) not in _PLAIN


def observed(tensors) -> bool:
    """True when a Python dispatch mode watches eager calls on plain tensors (a byte or FLOP
    counter, ``make_fx``), not while compiling or under a ``torch.func`` transform: fusedkit's
    kernels run there, through registered ops the mode sees."""
    return (
        bool(_dispatch_modes())
        and not _is_compiling()
        and not _functorch()
        and all(type(t) in _PLAIN for t in tensors if isinstance(t, torch.Tensor))
    )


def elementwise(kernel: ElementwiseKernel, operands: tuple, param, out: torch.Tensor | None) -> torch.Tensor:
    """Run ``kernel`` on parsed arguments (``param`` None for a kernel without one)."""
    if _is_compiling():
        if out is None and settings.current().compiled_elementwise == "inductor":
            return _composed(kernel, operands, param)
        return _elementwise(kernel, operands, param, out, None)
    if out is None:
        table = native.TABLE
        if table is not None:
            # A kept launch in C++ (``native_launch``), autograd node and all: None when it
            # does not apply (the table makes the checks below, and the launch hooks', itself).
            result = table.call(kernel, operands, param)
            if result is not None:
                return result
    if _profiling():
        # Under a range, the same path as unprofiled: a profile shows what the call costs
        # (validating every call instead took over ten times a kept launch's host time in a
        # ResNet-50 training step on the H200 host; ``python -m fusedkit bench --latency`` times calls).
        with torch.profiler.record_function(f"fusedkit::{kernel.name}"):
            return _kept_or_first(kernel, operands, param, out)
    return _kept_or_first(kernel, operands, param, out)


def _composed(kernel: ElementwiseKernel, operands: tuple, param) -> torch.Tensor:
    """A call Dynamo traces, as the kernel's PyTorch composition (its registry reference),
    validated as every call is: Inductor fuses it, forward and backward, with its neighbours
    (``compiled_elementwise="inductor"``, the default; measured in docs/results.md)."""
    # (a number as its kind: Dynamo tells a traced one from a constant by neither isinstance
    # nor type, so a parameter's range is not checked under compile)
    ew.validate(kernel, operands, None if param is None else number_kind(param), None)
    dtype = result_dtype(operands)
    operands = tuple(_traced_number(v, dtype) for v in operands)
    result = kernel.reference(*operands) if param is None else kernel.reference(*operands, param)
    return result.to(dtype)


def _traced_number(v, dtype: torch.dtype):
    """A number operand as a 0-d tensor: Inductor (torch 2.13) drops ``alpha`` from
    ``relu(add(x, s, alpha=a))`` where Dynamo traces ``s`` as a symbol; as a tensor it keeps it.
    The tensor holds the number as the op computes with it for a ``dtype`` result (float32 for
    a half or float32 result, float64 for float64, else ``dtype``): a 0-d tensor can promote
    where a number does not, so the caller casts the result to ``dtype``."""
    if not isinstance(v, (bool, int, float, torch.SymBool, torch.SymInt, torch.SymFloat)):
        return v
    if dtype.is_floating_point:
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.scalar_tensor(v, dtype=dtype)


def _has_tangent(tensors) -> bool:
    """Whether an eager call's operand carries a tangent (``torch.autograd.forward_ad``): such a
    call goes through the autograd Function with a ``jvp`` (the ``torch.func`` one), so its
    result carries the tangent the op's derivative gives. A global read unless a dual level is open."""
    return (
        _forward_ad._current_level >= 0
        and not _functorch()
        and any(isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    )


def _kept_or_first(kernel: ElementwiseKernel, operands: tuple, param, out: torch.Tensor | None) -> torch.Tensor:
    """An eager call the C++ table did not take: an ``out=None`` call outside any dispatch
    mode, transform or trace runs its kept launch, or autograd records it; everything else,
    and a first call (which keeps a launch for its signature), takes the full path."""
    if _has_tangent(operands):
        if out is not None:
            raise NotDifferentiableError(
                f"{kernel.name}(): out= does not support forward-mode AD (an operand carries a tangent)"
            )
        return autograd.call_functorch(kernel, operands, param)
    if _has_tangent((out,)):
        raise NotDifferentiableError(f"{kernel.name}(): out= carries a tangent; forward-mode AD does not write it")
    if out is not None or _dispatch_modes() or _functorch() or _jit_tracing():
        return _elementwise(kernel, operands, param, out, None)
    key = _call_key(kernel, operands, param)
    if key is _NEEDS_GRAD:
        key = None
        if kernel.backward is not None:  # (without one, validation below raises)
            return autograd.call_autograd(kernel, operands, param)
    else:
        result = ew.run_kept(key, operands, param)
        if result is not None:
            return result
    return _elementwise(kernel, operands, param, None, key)


def _no_jit_trace(name: str) -> None:
    if not _is_compiling() and _jit_tracing():  # (Dynamo cannot trace the flag's query)
        raise TracingError(
            f"fusedkit.{name}(): torch.jit.trace cannot record fusedkit's ops (their kernels would "
            "be missing from the trace); use torch.compile or torch.export"
        )


def _elementwise(kernel: ElementwiseKernel, operands: tuple, param, out: torch.Tensor | None, key) -> torch.Tensor:
    """Every call the kept launches did not finish; ``key``: its signature, to keep one for."""
    _no_jit_trace(kernel.name)
    if _functorch() and not _is_compiling():
        if out is None:
            return autograd.call_functorch(kernel, operands, param)
        # (inside a transform ``requires_grad`` says whether it differentiates through a tensor)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*operands, out) if isinstance(t, torch.Tensor)):
            raise FusedkitError(
                f"{kernel.name}(): out= does not support automatic differentiation, but a "
                "torch.func transform tracks the gradient of an argument"
            )
        # vmap: the out= op's rule unwraps the batch, and the call it makes is validated then.
        return autograd.call_op(kernel, operands, param, out)
    if tracing(operands, out):
        if not _is_compiling() and sharding.has_dtensor((*operands, out)):
            return _distributed(kernel, operands, param, out)
        if (
            kernel.saves == "pre"
            and out is None
            and not _is_compiling()
            and observed(operands)
            and _grad_needed(operands)
        ):
            # An eager step a mode watches (a byte counter): the launches eager makes, through
            # registered ops it sees (the forward pair that writes pre, then pre's gradient).
            ew.validate(kernel, operands, param, None)
            return autograd.call_autograd(kernel, operands, param, observed=True)
        return autograd.call_op(kernel, operands, param, out)
    call = ew.validate(kernel, operands, param, out)
    if call.needs_grad:
        return autograd.call_autograd(kernel, operands, param)
    result = ew.run_validated(call)
    ew.remember(key, call, result)
    return result


def _grad_needed(operands) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands)


def _distributed(kernel: ElementwiseKernel, operands: tuple, param, out) -> torch.Tensor:
    """A call on DTensors: validated as any call (fusedkit's errors, not a failed sharding
    propagation), then the registered op on the shards (:mod:`fusedkit.sharding`'s rules). An
    ``out=`` gets the result copied in, as torch writes a DTensor ``out`` (a rule would give
    the kernel a redistributed temporary in its place)."""
    ew.validate(kernel, operands, param, out)
    result = autograd.call_op(kernel, operands, param, None)
    if out is None:
        return result
    with torch.autograd.grad_mode.no_grad():
        out.copy_(result)
    return out


#: Device types whose autocast state :func:`matmul` follows.
AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast(*tensors) -> tuple:
    """The tensors as autocast's lower-precision policy (``F.linear``'s) casts them when
    autocast is on for the first one's device: floating tensors other than float64 to the
    autocast dtype; anything else, and everything when autocast is off there, as it is."""
    first = tensors[0]
    if not (
        isinstance(first, torch.Tensor)
        and first.device.type in AUTOCAST_DEVICES
        and torch.is_autocast_enabled(first.device.type)
    ):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(
        _cast(t, dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


#: Devices whose autocast casts a weight through its cache by way of ``_einsum`` (CPU autocast
#: has no lower-precision op that is a view: there a weight casts each call, as ``t.to``).
CACHED_CAST_DEVICES = ("cuda",)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` as autocast's ``F.linear`` gets it: a model's weight (a float32 leaf that
    requires grad), or its transpose ``w.t()`` as ``fusedkit.nn`` and ``fuse`` pass it, through
    autocast's cast cache where autocast keeps one, so that it is cast once per autocast region,
    as ``F.linear``'s is (a decode loop under one region calls every layer once a token)."""
    leaf = _transposed_leaf(t)
    weight = t if leaf is None else leaf
    if (
        weight.dtype is torch.float32
        and weight.device.type in CACHED_CAST_DEVICES
        and t.requires_grad
        and weight.is_leaf
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and torch.is_autocast_cache_enabled()
        and not _is_compiling()
        and not _functorch()  # (a transform's wrapped weight casts as it did)
        and not _jit_tracing()
        and (not torch.is_inference_mode_enabled() or _autocast_caches_in_inference_mode(weight.device.type))
    ):
        # autocast casts a lower-precision op's arguments through its cache; einsum is one on
        # CUDA, and with one operand and the identity equation it is a view of its argument's
        # cast (a cached one: no kernel). Called as the ATen op (torch.einsum's Python wrapper,
        # for sublists and opt_einsum's paths, took half its host time on the CPU).
        view = _einsum("...->...", (weight,))
        if view.dtype is dtype:
            return view if leaf is None else view.t()
    return t.to(dtype)


def _transposed_leaf(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is the ``.t()`` of, where ``t`` is one: autocast caches only a leaf's
    cast, not a view's, and ``w.t()`` cast as a view costs a weight-sized cast kernel a call (a
    fused BERT step's matmuls spent about two thirds of their host time there; docs/design.md)."""
    base = t._base
    if base is None or t.dim() != 2 or base.dim() != 2 or not base.requires_grad:
        return None
    if t.is_leaf and torch.is_grad_enabled():
        return None  # (a leaf view's gradient is its own: torch.randn(n, k).t().requires_grad_(); w.t()
        # made under no_grad is a leaf too, and casts as w's there: generate() runs so)
    if t.shape[::-1] != base.shape or t.stride()[::-1] != base.stride() or t.data_ptr() != base.data_ptr():
        return None  # (not its transpose; or a view of the data the base had before w.data = ...)
    if t.retains_grad or t._backward_hooks:
        return None  # (the view's own hooks and .grad: a cast of the leaf would pass them by)
    return base


@functools.cache
def _autocast_caches_in_inference_mode(device_type: str) -> bool:
    """Whether autocast keeps its weight casts under ``torch.inference_mode`` (recent PyTorch does
    not: there every call casts again, ``F.linear``'s too, and the einsum would only add host
    time): learnt once from torch itself, on a two-element weight, in the caller's region."""
    with torch.inference_mode(False):
        probe = torch.nn.Parameter(torch.ones(2, device=device_type))
    first, again = _einsum("...->...", (probe,)), _einsum("...->...", (probe,))  # (both held)
    return first.dtype != probe.dtype and first.data_ptr() == again.data_ptr()


def matmul(a, b, bias=None, activation=None) -> torch.Tensor:
    """``act(a @ b + bias)`` (see :func:`fusedkit.matmul`)."""
    if not _is_compiling() and _profiling():
        with torch.profiler.record_function("fusedkit::matmul"):
            return _matmul(a, b, bias, activation)
    return _matmul(a, b, bias, activation)


def _matmul(a, b, bias, activation):
    forward_ad = not _is_compiling() and _has_tangent((a, b, bias))
    a, b, bias = autocast(a, b, bias)
    key = None
    if not _is_compiling() and not _dispatch_modes() and not _functorch() and not _jit_tracing() and not forward_ad:
        key = mm.call_key(a, b, bias, activation)
        if key is not None:
            kept = mm.KEPT.get(key)
            if kept is not None:
                made = mm.NATIVE.get(key, 0)  # (the C++ table's copy, or how often making one failed)
                if type(made) is tuple:
                    out = made[0].matmul(made[1], a, b, bias)
                    if out is not None:
                        return out
                if kept.grad:
                    out = mm.with_lead(autograd.record_matmul(kept.a2(a), b, bias, activation, kept), kept.lead)
                else:
                    out = kept.run(a, b, bias)
                if type(made) is int and made < mm.NATIVE_TRIES:
                    made = autograd.native_matmul(kept, a, kept.a2(a), b, bias, out.view(kept.m, kept.n))
                    mm.NATIVE[key] = made if made is not None else mm.NATIVE.get(key, 0) + 1
                return out
    _no_jit_trace("matmul")
    mm.validate(a, b, bias, activation, "matmul")
    if not _is_compiling():
        a, b, bias = mm.resolve_neg(a), mm.resolve_neg(b), mm.resolve_neg(bias)
    lead = a.shape[:-1]
    a2 = a.reshape(lead.numel(), a.shape[-1])  # a view whenever the strides allow
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a2, b, bias))
    out = _matmul_2d(a2, b, bias, activation, needs_grad, forward_ad)
    if key is not None:
        mm.remember(key, a2, b, bias, activation, lead, out, needs_grad)
    return mm.with_lead(out, lead)


def _matmul_2d(a2, b, bias, activation, needs_grad: bool, forward_ad: bool = False):
    """One validated 2-D matmul on the path its tensors and mode call for (``forward_ad``: an
    operand carries a tangent, which the ``torch.func`` Function's ``jvp`` propagates)."""
    if ew.backend_for(a2.device) == "torch":
        return mm.matmul_reference(a2, b, bias, activation)
    if (_functorch() or forward_ad) and not _is_compiling():
        return autograd.matmul_functorch(a2, b, bias, activation)
    if tracing((a2, b, bias)):
        return autograd.matmul_op(a2, b, bias, activation, needs_grad and activation in mm.NEEDS_PRE)[0]
    if needs_grad:
        return autograd.record_matmul(a2, b, bias, activation)
    return mm.forward(a2, b, bias, activation, store_pre=False)[0]


#: ``fusedkit.mlp``'s activations: (activation, approximate) -> the matmul epilogue's name.
MLP_ACTIVATIONS = {
    ("gelu", "none"): "gelu",
    ("gelu", "tanh"): "gelu_tanh",
    ("relu", "none"): "relu",
    ("silu", "none"): "silu",
}


def _check_like_x(op: str, x, named) -> None:
    """An MLP op's operands (``named``: (name, tensor or None) pairs) share ``x``'s dtype and
    device, one the matmul kernels take."""
    for name, value in named:
        if value is not None and value.dtype != x.dtype:
            raise DTypeError(f"{op}(): {name} is {value.dtype}, x is {x.dtype}: they must share a dtype")
        if value is not None and value.device != x.device:
            raise DeviceError(f"{op}(): {name} is on {value.device}, x on {x.device}")
    if x.dtype not in mm.MATMUL_DTYPES:
        raise DTypeError(f"{op}(): dtype {x.dtype} is not supported; supported: {mm.MATMUL_DTYPES}")


def _check_tensors(op: str, named, optional: bool = False) -> None:
    """``DTypeError`` for an argument of ``op`` (name, value) that is not a tensor (or None, where
    ``optional``)."""
    for name, value in named:
        if not isinstance(value, torch.Tensor) and not (optional and value is None):
            kind = "a Tensor or None" if optional else "a Tensor"
            raise DTypeError(f"{op}(): {name} must be {kind}, got {type(value).__name__}")


def _mlp_activation(op: str, table: dict, activation, approximate, choices: str) -> str:
    """The activation ``table`` names for ``(activation, approximate)`` (both strings), else
    ``ArgumentError`` listing ``choices``."""
    act = table.get((activation, approximate)) if type(activation) is type(approximate) is str else None
    if act is None:
        raise ArgumentError(
            f"{op}(): activation={activation!r}, approximate={approximate!r}: choose activation {choices}"
        )
    return act


def _composes(x, tensors) -> bool:
    """Whether an MLP op runs PyTorch's composition rather than the kernels: traced, transformed,
    watched by a dispatch mode, carrying a tangent, on DTensors, or on the PyTorch backend."""
    return (
        _is_compiling()
        or _functorch()
        or _dispatch_modes()
        or _jit_tracing()
        or _has_tangent(tensors)
        or sharding.has_dtensor(tensors)
        or tracing(tensors)
        or ew.backend_for(x.device) == "torch"
    )


#: The MLP ops' operands by tensor-parallel role (:func:`sharding.local_mlp`).
_MLP_ROLES = (sharding.ROWS, sharding.COLUMN, sharding.COLUMN_BIAS, sharding.ROW, sharding.ROW_BIAS)
_GATED_ROLES = (sharding.ROWS, sharding.COLUMN, sharding.COLUMN, sharding.ROW, sharding.COLUMN_BIAS)
_GATED_ROLES += (sharding.COLUMN_BIAS, sharding.ROW_BIAS)


def mlp(x, w1, b1, w2, b2, activation: str, approximate: str, recompute: bool):
    """``F.linear(act(F.linear(x, w1, b1)), w2, b2)`` (see :func:`fusedkit.mlp`): checked before
    anything runs; eager calls on the kernels (``autograd.MLP`` where a gradient is needed);
    DTensors placed as tensor parallelism places an MLP on each rank's shards
    (``sharding.local_mlp``); traced, transformed and other DTensor calls, and the PyTorch
    backend, run the composition."""
    key, given = None, (x, w1, b1, w2, b2)
    if _plain_eager() and settings.current().fast_launch and type(activation) is type(approximate) is str:
        # a repeated signature: its checks and path were settled by its first call
        key = _mlp_key(given, activation, approximate, bool(recompute))
        kept = MLP_KEPT.get(key) if key is not None else None
        if kept is not None:
            return _mlp_run(kept, *(autocast(*given) if kept.cast else given))
    _check_tensors("mlp", (("x", x), ("w1", w1), ("w2", w2)))
    _check_tensors("mlp", (("b1", b1), ("b2", b2)), optional=True)
    act = _mlp_activation(
        "mlp", MLP_ACTIVATIONS, activation, approximate, "'gelu' (approximate 'none' or 'tanh'), 'relu' or 'silu'"
    )
    x, w1, b1, w2, b2 = autocast(x, w1, b1, w2, b2)
    if w1.dim() != 2 or w2.dim() != 2:
        raise ShapeError(f"mlp(): w1 and w2 must be 2-D (out, in), got {tuple(w1.shape)} and {tuple(w2.shape)}")
    hidden, inner = w1.shape
    if x.dim() < 1 or x.shape[-1] != inner:
        raise ShapeError(f"mlp(): x{tuple(x.shape)} does not end in w1's in_features ({inner})")
    if w2.shape[1] != hidden:
        raise ShapeError(f"mlp(): w2{tuple(w2.shape)} must take w1's {hidden} hidden features (out, {hidden})")
    for name, value, size in (("b1", b1, hidden), ("b2", b2, w2.shape[0])):
        if value is not None and tuple(value.shape) != (size,):
            raise ShapeError(f"mlp(): {name} must have shape ({size},), got {tuple(value.shape)}")
    tensors = (x, w1, b1, w2, b2)
    _check_like_x("mlp", x, zip(("w1", "b1", "w2", "b2"), tensors[1:]))
    if sharding.has_dtensor(tensors) and not _is_compiling():
        y = sharding.local_mlp(
            lambda x, w1, b1, w2, b2: mlp(x, w1, b1, w2, b2, activation, approximate, recompute), _MLP_ROLES, tensors
        )
        if y is not None:
            return y
    if _composes(x, tensors):
        return F.linear(mm.torch_activation(F.linear(x, w1, b1), act), w2, b2)
    used = tuple(mm.resolve_neg(t) for t in tensors)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in given)
    plan = MLPPlan(x.shape[:-1], inner, act, grad, bool(recompute), any(a is not b for a, b in zip(given, tensors)))
    if key is not None and all(a is b for a, b in zip(tensors, used)):  # (no negated view resolved)
        MLP_KEPT.keep(key, plan)
    return _mlp_run(plan, *used)


def _mlp_run(plan: MLPPlan, x, w1, b1, w2, b2):
    x2 = x.reshape(plan.lead.numel(), plan.inner)
    if plan.grad:
        y = autograd.MLP.apply(x2, w1, b1, w2, b2, plan.act, plan.recompute)
    else:
        h = mm.forward(x2, w1.t(), b1, plan.act, False)[0]
        y = mm.forward(h, w2.t(), b2, None, False)[0]
    return y.view(*plan.lead, y.shape[1])


#: ``fusedkit.gated_mlp``'s activations: (activation, approximate) -> the gated epilogue's name.
GATED_ACTIVATIONS = {("silu", "none"): "silu", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh"}


def gated_mlp(x, w_gate, w_up, w_down, activation: str, approximate: str, bias, recompute: bool):
    """``F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)`` (see
    :func:`fusedkit.gated_mlp`): checked before anything runs; eager calls on the kernels
    (``autograd.GatedMLP`` where a gradient is needed), on each rank's shards for DTensors placed
    as tensor parallelism places it (``sharding.local_mlp``); traced, transformed and other DTensor calls,
    the PyTorch backend, and gate and up weights laid out differently run the composition."""
    key = None
    if _plain_eager() and settings.current().fast_launch:
        # a repeated signature: its checks and path were settled by its first call (a decode
        # step's MLP is all host time)
        if (bias is None or (type(bias) is tuple and len(bias) == 3)) and type(activation) is type(approximate) is str:
            tensors = (x, w_gate, w_up, w_down, *(bias or (None, None, None)))
            key = _mlp_key(tensors, activation, approximate, bool(recompute))
            kept = GATED_KEPT.get(key) if key is not None else None
            if kept is not None:
                return _gated_run(kept, *(autocast(*tensors) if kept.cast else tensors))
    _check_tensors("gated_mlp", (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)))
    if bias is None:
        bias = (None, None, None)
    if not isinstance(bias, (tuple, list)) or len(bias) != 3:
        raise ArgumentError("gated_mlp(): bias must be None or (b_gate, b_up, b_down), each a Tensor or None")
    _check_tensors("gated_mlp", zip(("b_gate", "b_up", "b_down"), bias), optional=True)
    act = _mlp_activation(
        "gated_mlp", GATED_ACTIVATIONS, activation, approximate, "'silu' or 'gelu' (approximate 'none' or 'tanh')"
    )
    given = (x, w_gate, w_up, w_down, *bias)
    cast = autocast(*given)
    x, w_gate, w_up, w_down, b_gate, b_up, b_down = cast
    if w_gate.dim() != 2 or w_up.dim() != 2 or w_down.dim() != 2:
        raise ShapeError("gated_mlp(): w_gate, w_up and w_down must be 2-D (out, in)")
    hidden, inner = w_gate.shape
    if tuple(w_up.shape) != (hidden, inner):
        raise ShapeError(f"gated_mlp(): w_up{tuple(w_up.shape)} must have w_gate's shape {(hidden, inner)}")
    if x.dim() < 1 or x.shape[-1] != inner:
        raise ShapeError(f"gated_mlp(): x{tuple(x.shape)} does not end in w_gate's in_features ({inner})")
    if w_down.shape[1] != hidden:
        raise ShapeError(f"gated_mlp(): w_down{tuple(w_down.shape)} must take the {hidden} hidden features")
    for name, value, size in (("b_gate", b_gate, hidden), ("b_up", b_up, hidden), ("b_down", b_down, w_down.shape[0])):
        if value is not None and tuple(value.shape) != (size,):
            raise ShapeError(f"gated_mlp(): {name} must have shape ({size},), got {tuple(value.shape)}")
    tensors = (x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    _check_like_x("gated_mlp", x, zip(("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"), tensors[1:]))
    if sharding.has_dtensor(tensors) and not _is_compiling():

        def local(x, w_gate, w_up, w_down, b_gate, b_up, b_down):
            bias = (b_gate, b_up, b_down)
            return gated_mlp(x, w_gate, w_up, w_down, activation, approximate, bias, recompute)

        y = sharding.local_mlp(local, _GATED_ROLES, tensors)
        if y is not None:
            return y
    composed = _composes(x, tensors)
    if not composed:
        # (strides compared as the kernel will read them: a lazily negated view resolves to a copy)
        x, w_gate, w_up, w_down, b_gate, b_up, b_down = (mm.resolve_neg(t) for t in tensors)
        composed = w_gate.stride() != w_up.stride()  # (the kernel reads both through one set of strides)
    if composed:
        g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        if not _is_compiling() and observed(tensors):  # (a byte counter sees the registry's gate, one op)
            return F.linear(elementwise(registry.get(f"{act}_mul"), (g, u), None, None), w_down, b_down)
        return F.linear(mm.torch_activation(g, act) * u, w_down, b_down)
    alike = True
    if (b_gate is None) != (b_up is None) or (b_gate is not None and b_gate.stride() != b_up.stride()):
        # The epilogue adds both biases or neither, read with one stride: hidden-size vectors,
        # made alike (the missing one zeros).
        one = b_gate if b_gate is not None else b_up
        zeros = torch.zeros(one.shape, dtype=one.dtype, device=one.device)
        b_gate, b_up = (zeros if b is None else b.contiguous() for b in (b_gate, b_up))
        alike = False
    # (from the call's own tensors, as its key: where autocast hands a grad-mode call the cast it
    # cached under no_grad, without grad history (pytorch#158232), a plan kept without autograd
    # would lose every later region's gradients, not that region's alone, as F.linear's are)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in given)
    recast = any(a is not b for a, b in zip(given, cast))
    plan = MLPPlan(x.shape[:-1], inner, act, grad, bool(recompute), recast)
    # (kept where the call's own tensors, or autocast's casts of them, go to the kernels: no
    # negated view resolved or bias made alike on the way)
    used = (x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    if key is not None and alike and all(a is b for a, b in zip(cast, used)):
        GATED_KEPT.keep(key, plan)
    return _gated_run(plan, x, w_gate, w_up, w_down, b_gate, b_up, b_down)


class MLPPlan(NamedTuple):
    """An MLP op's settled path (:func:`mlp`, :func:`gated_mlp`): the kernels, with autograd's
    Function where a gradient is needed."""

    lead: torch.Size
    inner: int
    act: str
    grad: bool
    recompute: bool
    cast: bool  # autocast casts the tensors (its dtype is in the call's key)


#: Kept MLP op plans by call signature (:func:`_mlp_key`), for eager calls on plain tensors.
MLP_KEPT = CallCache()
GATED_KEPT = CallCache()


def _mlp_key(tensors, *args) -> tuple | None:
    """Everything an MLP op's checks and path depend on (the tensors' classes, shapes, strides,
    dtypes, devices, whether they require grad and carry a negation or conjugate bit; ``args``,
    its other arguments; grad mode and autocast), or None where it cannot be a key."""
    try:
        device = tensors[0].device.type
        autocast = device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device)
        key = (
            tuple(
                None
                if t is None
                else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_neg(), t.is_conj())
                for t in tensors
            ),
            *args,
            torch.is_grad_enabled(),
            autocast and torch.get_autocast_dtype(device),
        )
        hash(key)
    except (TypeError, AttributeError):
        return None
    return key


def _gated_run(plan: MLPPlan, x, w_gate, w_up, w_down, b_gate, b_up, b_down):
    x2 = x.reshape(plan.lead.numel(), plan.inner)
    if plan.grad:
        y = autograd.GatedMLP.apply(x2, w_gate, w_up, w_down, b_gate, b_up, b_down, plan.act, plan.recompute)
    else:
        h = autograd.gated_forward(x2, w_gate, w_up, b_gate, b_up, plan.act, False)[0]
        y = F.linear(h, w_down, b_down)
    return y.view(*plan.lead, y.shape[1])


def norm(kernel: RowKernel, x, residual, normalized_shape, weight, bias, eps, alpha):
    """The norm ``kernel`` (RMSNorm or LayerNorm, a residual added first where it takes one) of
    ``x`` over ``normalized_shape``: ``y``, or ``(y, h)`` with a residual (see
    :func:`fusedkit.rms_norm`). Checked before anything runs. Traced, transformed, float64 and
    DTensor calls run its PyTorch composition (Inductor fuses it under ``torch.compile``;
    ``compiled_elementwise="kernel"``: the registered op); eager calls the kernels."""
    name, rms = kernel.name, kernel.rms
    key = None
    if _plain_eager() and settings.current().fast_launch:
        # a repeated signature: its checks and path were settled by its first call
        device = x.device.type if isinstance(x, torch.Tensor) else None
        autocast = device in AUTOCAST_DEVICES and torch.is_autocast_enabled(device)
        state = (torch.is_grad_enabled(), autocast and torch.get_autocast_dtype(device))
        key = rn.call_key(name, x, residual, normalized_shape, weight, bias, eps, alpha, state)
        kept = rn.KEPT.get(key) if key is not None else None
        if kept is not None:
            if kept.grad:
                recipe = rn.GRAD_RECIPES.get(key)
                out = None
                if recipe is not None:
                    made = rn.NATIVE.get(key)  # (the C++ table's copy: forward, node and backward there)
                    if made is not None:
                        out = made[0].norm(made[1], x, residual, weight, bias)
                    if out is None:
                        out = autograd.kept_norm(recipe, x, residual, weight, bias)
            else:
                recipe = rn.RECIPES.get(key)
                out = None if recipe is None else rn.run_recipe(recipe, x, residual, weight, bias)
            if out is not None:
                return out
            return _kept_norm(kept, x, residual, weight, bias, key)
    for arg, value in (("input", x), ("residual", residual if kernel.residual else x)):
        if not isinstance(value, torch.Tensor):
            raise DTypeError(f"{name}(): {arg} must be a tensor, got {type(value).__name__}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ArgumentError(f"{name}(): alpha must be a real number, got {alpha!r}")
    if kernel.residual and residual.shape != x.shape:
        # a residual that broadcasts (a position embedding of one batch row): torch's add, then
        # the norm of its result; shapes that do not broadcast raise as torch.add's would
        try:
            torch.broadcast_shapes(x.shape, residual.shape)
        except RuntimeError:
            raise ShapeError(
                f"{name}(): residual of shape {list(residual.shape)} does not broadcast with the input's "
                f"{list(x.shape)}"
            ) from None
        h = torch.add(x, residual, alpha=alpha)
        plain = registry.row_kernel(name.removeprefix("add_"))
        return norm(plain, h, None, normalized_shape, weight, bias, eps, 1), h
    shape, n = rn.normalized_size(x, normalized_shape, name)
    rn.validate(name, x, residual, weight, bias, shape, eps)
    if not _is_compiling() and any(t is not None and t.is_neg() for t in (x, residual, weight, bias)):
        # a lazily negated view (the kernels read memory as it is): resolved, this call not kept
        # (Dynamo traces no negation bit: compiled code runs on values)
        x, residual, weight, bias = (mm.resolve_neg(t) for t in (x, residual, weight, bias))
        key = None
    _no_jit_trace(name)
    h_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    if eps is None:  # (torch: the epsilon of the dtype the norm computes in: float32 for half inputs)
        eps = torch.finfo(torch.float64 if h_dtype == torch.float64 else torch.float32).eps if rms else 1e-5
    tensors = (x, residual, weight, bias)
    kernels = all(t is None or t.dtype in rn.KERNEL_DTYPES for t in tensors) and ew.backend_for(x.device) != "torch"
    if _is_compiling():  # (Dynamo reads neither the dispatch-mode stack nor the transforms)
        registered = settings.current().compiled_elementwise == "kernel"
    else:  # a byte counter's eager call, or DTensors (the op's sharding rules: fusedkit.sharding)
        registered = not _functorch() and (observed(tensors) or sharding.has_dtensor(tensors))
    if kernels and registered:
        # the registered op, forward and backward: what a byte counter or compiled code sees
        y_dtype = norm_dtype(h_dtype, x.device.type, rms)
        lead = x.shape[: x.dim() - len(shape)]
        rows = lead.numel()
        y, h, _, _ = autograd.norm_op(
            x.reshape(rows, n),
            None if residual is None else residual.reshape(rows, n),
            None if weight is None else weight.reshape(n),
            None if bias is None else bias.reshape(n),
            name,
            float(eps),
            float(alpha),
            y_dtype,
            h_dtype,
        )
        y = y.view(*lead, *shape)
        return y if residual is None else (y, h.view(*lead, *shape))
    if (
        tracing(tensors)
        or _has_tangent(tensors)
        or any(t is not None and t.dtype not in rn.KERNEL_DTYPES for t in tensors)
        or ew.backend_for(x.device) == "torch"
    ):
        y, h = kernel.reference(x, residual, weight, bias, eps, alpha, shape)
        return y if residual is None else (y, h)
    # (the composition above follows autocast itself; the kernels write its dtype directly)
    lead = tuple(x.shape[: x.dim() - len(shape)])
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    plan = rn.Kept(
        math.prod(lead), n, lead, shape, eps, alpha, rms, norm_dtype(h_dtype, x.device.type, rms), h_dtype, grad
    )
    if key is not None:
        rn.keep(key, plan)
    return _kept_norm(plan, x, residual, weight, bias, key)


def _plain_eager() -> bool:
    """An eager call no trace, transform, dispatch mode or dual level watches (a kept plan
    may serve it: the tensors' classes are in its key)."""
    return not (
        _is_compiling() or _dispatch_modes() or _functorch() or _jit_tracing() or _forward_ad._current_level >= 0
    )


def _kept_norm(plan, x, residual, weight, bias, key=None):
    """An eager norm on the kernels by a settled plan: the rows views, one launch (autograd's
    Function where a gradient is needed); the call's recipe kept under ``key`` (``rn.RECIPES``,
    or ``rn.GRAD_RECIPES`` with a gradient) for the next call of its signature."""
    rows, n = plan.rows, plan.n
    x2 = rn.rows_of(x, rows, n)
    r2 = None if residual is None else rn.rows_of(residual, rows, n)
    w1 = None if weight is None else weight.reshape(n)
    b1 = None if bias is None else bias.reshape(n)
    args = (x2, r2, w1, b1, plan.eps, plan.alpha, plan.rms, plan.y_dtype, plan.h_dtype)
    if plan.grad:
        out = autograd.Norm.apply(*args)
        y, h = out if residual is not None else (out, None)
        if key is not None and key not in rn.GRAD_RECIPES:  # (None kept too: a signature tried once)
            recipe = rn.grad_recipe(x, residual, weight, bias, x2, r2, w1, b1, y, h, plan)
            rn.GRAD_RECIPES[key] = recipe
            rn.NATIVE[key] = None if recipe is None else autograd.native_norm(recipe)
    else:
        y, h, _, _ = rn.forward(*args, False)
        if key is not None and key not in rn.RECIPES:  # (None kept too: a signature tried once)
            rn.RECIPES[key] = rn.recipe(x, residual, weight, bias, x2, r2, w1, b1, y, h, plan.eps, plan.alpha, plan.rms)
    y = y.view(*plan.lead, *plan.shape)
    return y if residual is None else (y, h.view(*plan.lead, *plan.shape))


def norm_dtype(dtype: torch.dtype, device_type: str, rms: bool) -> torch.dtype:
    """The dtype a norm of a ``dtype`` input returns here and now: ``dtype``, or what torch's
    norm gives under autocast where it is on (float32 under CUDA's policy)."""
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return _autocast_norm_dtype(device_type, torch.get_autocast_dtype(device_type), dtype, rms)
    return dtype


@functools.cache
def _autocast_norm_dtype(device_type: str, autocast_dtype: torch.dtype, dtype: torch.dtype, rms: bool) -> torch.dtype:
    """The dtype torch's norm returns under autocast for an input of ``dtype`` (CUDA's policy
    runs norms in float32): learnt once from torch itself, on a two-element tensor."""
    probe = torch.ones(1, 2, dtype=dtype, device=device_type)
    with torch.autocast(device_type, dtype=autocast_dtype):
        out = F.rms_norm(probe, (2,)) if rms else F.layer_norm(probe, (2,))
    return out.dtype
