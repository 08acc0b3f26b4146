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
on the H200 a call through the registered op costs 110-190 us of host time against
13-22 us for the eager fast path (1K-1M elements; ``python -m fusedkit bench --latency``).
"""

from __future__ import annotations

import torch

from . import _elementwise
from .errors import ArgumentError, UnknownKernelError
from .registry import get, result_dtype

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


def _batch_first(kernel, tensors, tensor_slots, scalars, in_dims) -> list:
    """vmap's batched operands with the batch dim moved to the front and size-1 dims
    after it, so every operand broadcasts as its per-example self does; unbatched
    operands as they are. A batched operand that is 0-d per example is converted to the
    per-example result dtype first: gaining dims, it would otherwise promote as a tensor
    with dims (an fp32 0-d beside fp16 gives fp16 in torch, fp32 with dims)."""
    per_example = [torch.empty((1,) * (t.dim() - (d is not None)), dtype=t.dtype, device="meta")
                   for t, d in zip(tensors, in_dims)]
    rank = max(t.dim() for t in per_example)
    dtype = result_dtype(_assemble(kernel.arity, per_example, tensor_slots, scalars))
    moved = []
    for t, d, example in zip(tensors, in_dims, per_example):
        if d is not None:
            t = t.movedim(d, 0)
            if example.dim() == 0 and t.dtype != dtype:
                t = t.to(dtype)
            t = t.reshape(t.shape[0], *(1,) * (rank - example.dim()), *t.shape[1:])  # a view
        moved.append(t)
    return moved


def _elementwise_vmap(info, in_dims, name, tensors, tensor_slots, scalars, param):
    # (the other arguments are not tensors)
    return elementwise_op(name, _batch_first(get(name), tensors, tensor_slots, scalars, in_dims[1]), tensor_slots,
                          scalars, param), 0


torch.library.register_vmap(elementwise_op, _elementwise_vmap)


@torch.library.custom_op("fusedkit::elementwise_out", mutates_args=("out",))
def elementwise_out_op(name: str, tensors: list[torch.Tensor], tensor_slots: list[int], scalars: list[Scalar],
                       param: Scalar, out: torch.Tensor) -> None:
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    _elementwise.run_validated(_elementwise._validate(kernel, operands, _param(kernel, param), out))


@elementwise_out_op.register_fake
def _(name, tensors, tensor_slots, scalars, param, out):
    return None


def _elementwise_out_vmap(info, in_dims, name, tensors, tensor_slots, scalars, param, out):
    tensor_dims, out_dim = in_dims[1], in_dims[5]
    if out_dim is None:
        # torch's rule for in-place ops under vmap: the written tensor must be batched.
        raise ArgumentError("fusedkit: vmap over an out= call needs out to be batched when an input is")
    rank = max(t.dim() - (d is not None) for t, d in zip(tensors, tensor_dims))
    out = out.movedim(out_dim, 0)
    out = out.reshape(out.shape[0], *(1,) * (rank - out.dim() + 1), *out.shape[1:])
    elementwise_out_op(name, _batch_first(get(name), tensors, tensor_slots, scalars, tensor_dims), tensor_slots,
                       scalars, param, out)
    return None, None


torch.library.register_vmap(elementwise_out_op, _elementwise_out_vmap)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: Python dispatch modes (``TorchDispatchMode``: make_fx, FlopCounterMode, selective
#: activation checkpointing, op loggers) on the stack; a C call of ~50 ns.
dispatch_mode_active = torch._C._len_torch_dispatch_stack


#: Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is active; a C call. Its
#: wrapped tensors have no storage, so such calls go through the registered op too.
functorch_active = torch._C._are_functorch_transforms_active


def tracing(operands, out) -> bool:
    """True while Dynamo traces, while a Python dispatch mode or a ``torch.func``
    transform is active, or when an operand is a tensor subclass (a FakeTensor or
    FunctionalTensor during AOT tracing, for instance): such calls must go through the
    registered op, which they can see."""
    if torch.compiler.is_compiling() or dispatch_mode_active() or functorch_active():
        return True
    for t in operands:
        if isinstance(t, torch.Tensor) and type(t) not in _PLAIN:
            return True
    return isinstance(out, torch.Tensor) and type(out) not in _PLAIN


def _check_registered(kernel) -> None:
    if get(kernel.name) is not kernel:
        raise UnknownKernelError(f"{kernel.name!r}: autograd and torch.compile run registered kernels only; "
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
    host time on a CPU host. ``torch.func`` transforms need one: they get
    :class:`_FuncElementwise`."""

    @staticmethod
    def forward(ctx, kernel, param, tensor_slots, scalars, *tensors):
        output = _elementwise.dispatch(kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), param, None)
        _save(ctx, kernel, param, tensor_slots, scalars, tensors, output)
        return output

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *_input_grads(ctx, grad))


class _FuncElementwise(torch.autograd.Function):
    """A call under a ``torch.func`` transform (vmap, grad, jacrev, ...): the same saved
    tensors and backward, with the ``setup_context`` and the vmap rule those transforms
    need (the registered op's generated autograd has no ``setup_context``). Its forward,
    backward and vmap rule call :func:`fusedkit._elementwise.dispatch`, which comes back
    here while a transform is still active and launches once none is."""

    @staticmethod
    def forward(kernel, param, tensor_slots, scalars, *tensors):
        return _elementwise.dispatch(kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), param, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        kernel, param, tensor_slots, scalars, *tensors = inputs
        _save(ctx, kernel, param, tensor_slots, scalars, tensors, output)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *_input_grads(ctx, grad))

    @staticmethod
    def vmap(info, in_dims, kernel, param, tensor_slots, scalars, *tensors):
        moved = _batch_first(kernel, tensors, tensor_slots, scalars, in_dims[4:])
        return _elementwise.dispatch(kernel, _assemble(kernel.arity, moved, tensor_slots, scalars), param, None), 0


def call_functorch(kernel, operands: tuple, param) -> torch.Tensor:
    """A call of ``kernel`` under a ``torch.func`` transform."""
    _elementwise.check_arity(kernel, operands)
    tensors, slots, scalars = _split(operands)
    return _FuncElementwise.apply(kernel, param, slots, scalars, *tensors)


def call_autograd(kernel, operands: tuple, param) -> torch.Tensor:
    """An eager call of ``kernel`` (which declares a backward) that records its gradient."""
    _elementwise.check_arity(kernel, operands)  # (the rest is validated inside the Function)
    _check_registered(kernel)
    tensors, slots, scalars = _split(operands)
    return _EagerElementwise.apply(kernel, param, slots, scalars, *tensors)
