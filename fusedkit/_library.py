"""fusedkit's ops as ``torch.library`` custom ops, for autograd and tracing.

One generic op serves every registry kernel (``fusedkit::elementwise``, and
``fusedkit::elementwise_out`` for ``out=``), so a kernel a user registers is
differentiable and compiles with ``torch.compile(fullgraph=True)`` too. Each op
has a fake implementation (shape, dtype and layout without data) and autograd
from the registry's ``backward``.

Eager calls skip the dispatcher: the registered op is used only while tracing
(``torch.compiler.is_compiling()``, or tensor subclasses such as fake tensors).
Eager calls that need a gradient run :class:`_EagerElementwise`, a plain
``torch.autograd.Function`` with the same saved tensors and backward as the op:
on the H200 a call through the registered op cost 91-146 us of host time against
7-19 us for the eager fast path (1K-1M elements, commit 87e937c), and the add_relu
backward through it took 112 us against eager torch's 29 at 2**24 bf16 elements,
host-bound. Through the Function: 65.6 us against 30.2 (commit e375e1b), still
host-bound (a Python backward on the autograd engine's thread).
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


def _save(ctx, kernel, param, tensor_slots, scalars, tensors, output) -> None:
    """What a backward needs, kept on ``ctx`` (the registered op's and the eager Function's)."""
    ctx.kernel = kernel
    ctx.param = param
    ctx.slots = tensor_slots
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


def _input_grads(ctx, grad) -> list:
    """The gradient of each tensor operand (None where none flows), from what ``_save`` kept."""
    kernel = ctx.kernel
    if kernel.saves == "output":
        saved = ctx.saved_tensors[0]
    elif kernel.saves == "inputs":
        saved = _assemble(kernel.arity, ctx.saved_tensors, ctx.slots, ctx.scalars)
    else:
        saved = None
    grads = kernel.backward(grad, saved, _param(kernel, ctx.param))
    out = []
    for slot, (shape, dtype, device) in zip(ctx.slots, ctx.meta):
        g = grads[slot]
        out.append(None if g is None or not dtype.is_floating_point else _reduce_to(g, shape, dtype, device))
    return out


def _setup_context(ctx, inputs, output):
    name, tensors, tensor_slots, scalars, param = inputs
    ctx.n_slots = len(tensor_slots)
    _save(ctx, get(name), param, tensor_slots, scalars, tensors, output)


def _backward(ctx, grad):
    out = _input_grads(ctx, grad)
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
#: Python dispatch modes (``TorchDispatchMode``: make_fx, FlopCounterMode, selective
#: activation checkpointing, op loggers) on the stack; a C call of ~50 ns.
dispatch_mode_active = torch._C._len_torch_dispatch_stack


def tracing(operands, out) -> bool:
    """True while Dynamo traces, while a Python dispatch mode is active, or when an
    operand is a tensor subclass (a FakeTensor or FunctionalTensor during AOT tracing,
    for instance): such calls must go through the registered op, which they can see."""
    if torch.compiler.is_compiling() or dispatch_mode_active():
        return True
    for t in operands:
        if isinstance(t, torch.Tensor) and type(t) not in _PLAIN:
            return True
    return isinstance(out, torch.Tensor) and type(out) not in _PLAIN


def _check_registered(kernel) -> None:
    if get(kernel.name) is not kernel:
        raise KeyError(f"{kernel.name!r}: autograd and torch.compile run registered kernels only; "
                       "fusedkit.registry.register() it first")


def call_op(kernel, operands: tuple, param, out: torch.Tensor | None) -> torch.Tensor:
    """Call ``kernel`` through the registered op (autograd records it; Dynamo traces it)."""
    _check_registered(kernel)
    tensors, slots, scalars = _split(operands)
    param = param if param is not None else 0
    if out is not None:
        elementwise_out_op(kernel.name, tensors, slots, scalars, param, out)
        return out
    return elementwise_op(kernel.name, tensors, slots, scalars, param)


class _EagerElementwise(torch.autograd.Function):
    """An eager call that needs a gradient: the registered op's autograd without the
    dispatcher. ``forward`` runs with grad off, so it takes the eager fast path.

    ``forward`` takes ``ctx`` (no ``setup_context``): with a ``setup_context``, every
    ``apply`` binds its arguments through ``inspect.signature``, 40% of this path's
    host time on a CPU host. (torch.func transforms would need a ``setup_context``;
    the registered op does not support them either.)"""

    @staticmethod
    def forward(ctx, kernel, param, tensor_slots, scalars, *tensors):
        output = _elementwise.dispatch(kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), param, None)
        _save(ctx, kernel, param, tensor_slots, scalars, tensors, output)
        return output

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *_input_grads(ctx, grad))


def call_autograd(kernel, operands: tuple, param) -> torch.Tensor:
    """An eager call of ``kernel`` (which declares a backward) that records its gradient."""
    _elementwise.check_arity(kernel, operands)  # (the rest is validated inside the Function)
    _check_registered(kernel)
    tensors, slots, scalars = _split(operands)
    return _EagerElementwise.apply(kernel, param, slots, scalars, *tensors)
