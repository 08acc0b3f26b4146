"""fusedkit's ops as ``torch.library`` custom ops, for autograd and tracing.

One generic op serves every registry kernel (``fusedkit::elementwise``, and
``fusedkit::elementwise_out`` for ``out=``), so a kernel a user registers is
differentiable and compiles with ``torch.compile(fullgraph=True)`` too. Each op
has a fake implementation (shape, dtype and layout without data) and autograd
from the registry's ``backward``.

Eager calls skip the dispatcher: on an H200 a custom-op wrapper costs about
23 us more per call than a direct launch (``../shared/h200-anchors.md``), so the
registered op is used only while tracing (``torch.compiler.is_compiling()``) or
when a gradient is needed.
"""

from __future__ import annotations

import torch

from . import _elementwise
from .registry import get

#: torch.library's own spelling of a "Scalar" argument (int, float or bool), so the schema
#: inference of every torch version recognises it.
Scalar = torch.types.Number


def _assemble(arity: int, tensors, tensor_slots, scalars) -> tuple:
    operands: list = [None] * arity
    for slot, t in zip(tensor_slots, tensors):
        operands[slot] = t
    it = iter(scalars)
    return tuple(next(it) if v is None else v for v in operands)


def _split(operands) -> tuple[list, list, list]:
    tensors = [v for v in operands if isinstance(v, torch.Tensor)]
    slots = [i for i, v in enumerate(operands) if isinstance(v, torch.Tensor)]
    scalars = [v for v in operands if not isinstance(v, torch.Tensor)]
    return tensors, slots, scalars


def _param(kernel, param):
    return param if kernel.param is not None else None


@torch.library.custom_op("fusedkit::elementwise", mutates_args=())
def elementwise_op(name: str, tensors: list[torch.Tensor], tensor_slots: list[int], scalars: list[Scalar],
                   param: Scalar) -> torch.Tensor:
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    call = _elementwise._validate(kernel, operands, _param(kernel, param), None)
    call.needs_grad = False
    return _elementwise.run_validated(call)


@elementwise_op.register_fake
def _(name, tensors, tensor_slots, scalars, param):
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    with torch.no_grad():
        call = _elementwise._validate(kernel, operands, _param(kernel, param), None)
    return _elementwise._allocate_out(call)


def _setup_context(ctx, inputs, output):
    name, tensors, tensor_slots, scalars, param = inputs
    ctx.n_slots = len(tensor_slots)
    kernel = get(name)
    ctx.kernel = kernel
    ctx.param = param
    ctx.slots = tensor_slots
    ctx.arity = kernel.arity
    ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
    ctx.scalars = scalars
    if kernel.saves == "output":
        ctx.save_for_backward(output)
    elif kernel.saves == "inputs":
        ctx.save_for_backward(*tensors)


def _reduce_to(grad: torch.Tensor, shape, dtype, device) -> torch.Tensor:
    """Sum a gradient of the broadcast shape back to an operand's shape and dtype."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape) if len(shape) else grad.sum()
    return grad.to(device=device, dtype=dtype)


def _backward(ctx, grad):
    kernel = ctx.kernel
    if kernel.saves == "output":
        saved = ctx.saved_tensors[0]
    elif kernel.saves == "inputs":
        saved = _assemble(ctx.arity, ctx.saved_tensors, ctx.slots, ctx.scalars)
    else:
        saved = None
    grads = kernel.backward(grad, saved, _param(kernel, ctx.param))
    out = []
    for slot, (shape, dtype, device) in zip(ctx.slots, ctx.meta):
        g = grads[slot]
        out.append(None if g is None or not dtype.is_floating_point else _reduce_to(g, shape, dtype, device))
    # The inputs' structure as torch.library sees it: a non-empty list of numbers is
    # one leaf (its gradient None), an empty list stays an empty list.
    return None, out, None if ctx.n_slots else [], None if ctx.scalars else [], None


elementwise_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("fusedkit::elementwise_out", mutates_args=("out",))
def elementwise_out_op(name: str, tensors: list[torch.Tensor], tensor_slots: list[int], scalars: list[Scalar],
                       param: Scalar, out: torch.Tensor) -> None:
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    _elementwise.run_validated(_elementwise._validate(kernel, operands, _param(kernel, param), out))


@elementwise_out_op.register_fake
def _(name, tensors, tensor_slots, scalars, param, out):
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def tracing(operands, out) -> bool:
    """True while Dynamo traces, or when an operand is a tensor subclass (a FakeTensor
    or FunctionalTensor during AOT tracing, for instance): such calls must go through
    the registered op."""
    if torch.compiler.is_compiling():
        return True
    for t in operands:
        if isinstance(t, torch.Tensor) and type(t) not in _PLAIN:
            return True
    return isinstance(out, torch.Tensor) and type(out) not in _PLAIN


def call_op(kernel, operands: tuple, param, out: torch.Tensor | None) -> torch.Tensor:
    """Call ``kernel`` through the registered op (autograd records it; Dynamo traces it)."""
    if get(kernel.name) is not kernel:
        raise KeyError(f"{kernel.name!r}: autograd and torch.compile run registered kernels only; "
                       "fusedkit.registry.register() it first")
    tensors, slots, scalars = _split(operands)
    param = param if param is not None else 0
    if out is not None:
        elementwise_out_op(kernel.name, tensors, slots, scalars, param, out)
        return out
    return elementwise_op(kernel.name, tensors, slots, scalars, param)
