"""fusedkit's ops for autograd, ``torch.func`` and tracing.

- Custom ops (``torch.library``): ``fusedkit::elementwise`` (one op serves every registry
  kernel, so one a user registers is differentiable and compiles with
  ``torch.compile(fullgraph=True)`` too), ``fusedkit::elementwise_out`` for ``out=``, and
  ``fusedkit::matmul``. Traced code calls them; each has a fake implementation (shape,
  dtype and layout without data), a vmap rule and autograd.
- :class:`EagerElementwise` and :class:`EagerMatmul`: eager calls that need a gradient,
  the custom ops' saved tensors and backward without the dispatcher (a call through a
  registered op costs about eight times a kept eager launch's host time on the H200 host;
  ``python -m fusedkit bench --latency`` measures both).
- :class:`FuncElementwise` and :class:`FuncMatmul`: calls under a ``torch.func`` transform,
  with the ``setup_context`` and vmap rule those need.

Forwards run the runtime (:mod:`fusedkit.runtime`). Backwards compute with the derivative
each op declares: a registry entry's ``backward``, and the matmul's, given by
:func:`register_matmul_backward` (:mod:`fusedkit.library`); both call the public ops, so a
gradient of a gradient is recorded, transformed or traced as any call is.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from .errors import ArgumentError, NotDifferentiableError, SignatureError, UnknownKernelError
from .registry import get, result_dtype
from .runtime import elementwise, matmul, native
from .runtime import norm as row_norm

__all__ = [
    "EagerElementwise",
    "EagerPreElementwise",
    "EagerMatmul",
    "FuncElementwise",
    "FuncMatmul",
    "GatedMLP",
    "MLP",
    "MLP_PROLOGUE",
    "Norm",
    "norm_backward_op",
    "norm_grads",
    "norm_op",
    "PAIRS",
    "call_autograd",
    "call_functorch",
    "call_op",
    "call_pair",
    "elementwise_op",
    "elementwise_out_op",
    "elementwise_pair_op",
    "functorch_active",
    "matmul_functorch",
    "matmul_op",
    "matmul_setup_context",
    "native_backward",
    "record_matmul",
    "register_matmul_backward",
    "register_pair",
]

#: Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is active; a C call. Its
#: wrapped tensors have no storage, so a launch waits until none is.
functorch_active = torch._C._are_functorch_transforms_active


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


# The ops take their tensors first: torch 2.11's DTensor looks for the device mesh in an op's
# first argument only (with the kernel's name first, every tensor-parallel call failed there).
@torch.library.custom_op("fusedkit::elementwise", mutates_args=())
def elementwise_op(
    tensors: list[torch.Tensor], name: str, tensor_slots: list[int], scalars: list[Scalar], param: Scalar
) -> torch.Tensor:
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    call = elementwise.validate(kernel, operands, _param(kernel, param), None)
    call.needs_grad = False
    return elementwise.run_validated(call)


@elementwise_op.register_fake
def _(tensors, name, tensor_slots, scalars, param):
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    with torch.no_grad():
        call = elementwise.validate(kernel, operands, _param(kernel, param), None)
    return elementwise.allocate_out(call)


def _save(
    ctx, kernel, param, tensor_slots, scalars, tensors, output, needed_only: bool = False, for_forward: bool = False
) -> None:
    """What a backward needs, kept on ``ctx`` (the registered op's and the Functions'). A kernel
    that saves "pre" keeps its operands here: these paths compute ``pre`` again in the
    backward (the eager one keeps it: :class:`EagerPreElementwise`). ``needed_only``: keep only
    the operands the requested gradients read (``ElementwiseKernel.needs``), as torch keeps
    them, so another may change in place afterwards. An inference tensor is held on ``ctx``
    outside ``save_for_backward``, which refuses it (it cannot change outside inference mode).
    ``for_forward``: the same tensors for a ``jvp`` (forward-mode AD) too."""
    ctx.kernel = kernel
    ctx.param = param
    ctx.slots = tensor_slots
    ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
    ctx.scalars = scalars
    ctx.held = {}
    kept = ()
    if kernel.saves == "output":
        kept = (output,)
    elif kernel.saves in ("inputs", "pre"):
        needed = range(kernel.arity)
        if needed_only and kernel.needs is not None:
            needed = {i for slot, t in zip(tensor_slots, tensors) if t.requires_grad for i in kernel.needs[slot]}
        ctx.kept = [slot in needed for slot in tensor_slots]
        ctx.held = {k: t for k, (t, keep) in enumerate(zip(tensors, ctx.kept)) if keep and t.is_inference()}
        kept = tuple(t for k, (t, keep) in enumerate(zip(tensors, ctx.kept)) if keep and k not in ctx.held)
    ctx.save_for_backward(*kept)
    if for_forward:
        ctx.save_for_forward(*kept)


def _saved_operands(ctx) -> tuple:
    """The operands as :func:`_save` kept them: None in the place of a tensor not kept."""
    saved = iter(ctx.saved_tensors)
    tensors = [ctx.held[k] if k in ctx.held else next(saved) if keep else None for k, keep in enumerate(ctx.kept)]
    operands: list = [None] * ctx.kernel.arity
    scalars = iter(ctx.scalars)
    for slot, t in zip(ctx.slots, tensors):
        operands[slot] = t
    tensor_slots = set(ctx.slots)
    return tuple(v if i in tensor_slots else next(scalars) for i, v in enumerate(operands))


def _reduce_to(grad: torch.Tensor, shape, device) -> torch.Tensor:
    """Sum a gradient of the broadcast shape back to an operand's shape, on its device. Its
    dtype is the engine's to set, as for torch's own nodes: the operand's, or the
    ``grad_dtype`` a leaf asks for (None: the gradient's own)."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape) if len(shape) else grad.sum()
    return grad.to(device=device)


def _kernel_grads(ctx, grad, run=None) -> tuple:
    """The kernel's gradients from ``grad`` (one per operand, of the result's shape, None where
    none flows), from what ``_save`` kept; ``run(kernel, operands, param)``: how this path runs a
    kernel (``pre``'s, which a kernel that saves "pre" computes again here from its operands)."""
    kernel = ctx.kernel
    param = _param(kernel, ctx.param)
    if kernel.saves == "pre":
        return _pre_grads(kernel, grad, run(kernel.pre, _saved_operands(ctx), param), param)
    saved = ctx.saved_tensors[0] if kernel.saves == "output" else None
    if kernel.saves == "inputs":
        saved = _saved_operands(ctx)
    return _checked_grads(kernel, kernel.backward(grad, saved, param))


def _input_grads(ctx, grad, run=None) -> list:
    """The gradient of each tensor operand (None where none flows), reduced to its shape."""
    grads = _kernel_grads(ctx, grad, run)
    return [_operand_grad(grads[slot], meta) for slot, meta in zip(ctx.slots, ctx.meta)]


def _tangent(ctx, tangents, run) -> torch.Tensor | None:
    """The result's tangent (forward-mode AD) from the operands': an elementwise op's Jacobian
    is diagonal per operand, so operand i's part is the kernel's backward (its stated
    derivative, computed by the kernels or, under a transform, by torch ops) applied to that
    operand's tangent, broadcast to the result. None where no operand has one."""
    total = None
    for slot, t, (_, dtype, _) in zip(ctx.slots, tangents, ctx.meta):
        if t is None or not dtype.is_floating_point:
            continue
        part = _kernel_grads(ctx, t.expand(ctx.shape), run)[slot]
        if part is not None:
            total = part if total is None else total + part
    return None if total is None else total.to(ctx.dtype)


def _pre_grads(kernel, grad, pre, param, grad_pre=None):
    """The operands' gradients of a kernel that saves "pre": its backward gives ``pre``'s
    gradient (plus ``grad_pre``, what flowed into ``pre`` itself in a double backward), which
    ``pre``'s entry's backward turns into the operands'."""
    total = kernel.backward(grad, pre, param) if grad is not None else None
    if grad_pre is not None:
        total = grad_pre if total is None else total + grad_pre
    return _checked_grads(kernel.pre, kernel.pre.backward(total, None, param))


def _checked_grads(kernel, grads):
    """``kernel.backward``'s result, refused unless a tuple or list of one tensor or None per
    operand: autograd would index past its end or ``zip`` would drop an operand's gradient."""
    if not isinstance(grads, (tuple, list)) or len(grads) != kernel.arity:
        given = f"{len(grads)} gradient(s)" if isinstance(grads, (tuple, list)) else f"a {type(grads).__name__}"
        raise SignatureError(
            f"{kernel.name}: backward returned {given} for its {kernel.arity} operand(s) "
            f"({', '.join(kernel.arg_names)}); it must return a tuple of one tensor or None per operand"
        )
    for name, g in zip(kernel.arg_names, grads):
        if g is not None and not isinstance(g, torch.Tensor):
            raise SignatureError(
                f"{kernel.name}: backward returned a {type(g).__name__} as {name}'s gradient; "
                "it must return a tensor or None per operand"
            )
    return grads


def _operand_grad(grad, meta):
    """One operand's gradient from the kernel's (of the broadcast shape): None where none flows
    or the operand is not floating, else reduced to the shape and device of the operand's
    ``meta`` (shape, dtype, device); autograd casts it."""
    shape, dtype, device = meta
    return None if grad is None or not dtype.is_floating_point else _reduce_to(grad, shape, device)


def native_backward(kernel, param, operand_signature, device, shape, dtype):
    """``(backward, saves, plan)`` for the C++ autograd node of a kept launch whose operands
    are all tensors (:mod:`fusedkit.runtime.native`), or None when the kernel has no gradient
    or is not the registered one (the Python path raises then). ``backward(grad, saved)``
    gives each operand's gradient, as :func:`_input_grads` does for the Functions; ``plan``:
    the kernel's ``backward_kernels`` as ``(kernel, param, result)`` per operand (None: none),
    when every operand is floating, else empty. The plan's kernels give gradients of the
    result's shape and dtype; the autograd engine sums a broadcast operand's to its shape and
    casts it to the dtype its operand takes, as it does for torch's own nodes (``AddBackward``
    returns the incoming gradient for both operands), which ``_operand_grad`` leaves it."""
    if kernel.backward is None or kernel.saves == "pre":  # (its pre and forward launch are Python's)
        return None
    try:
        if get(kernel.name) is not kernel:
            return None
    except UnknownKernelError:
        return None
    param = _param(kernel, param)
    meta = [(torch.Size(shape), dtype, device) for dtype, shape, _ in operand_signature]
    formula, saves = kernel.backward, kernel.saves

    def backward(grad, saved):
        arg = saved[0] if saves == "output" else saved if saves == "inputs" else None
        return [_operand_grad(g, m) for g, m in zip(_checked_grads(kernel, formula(grad, arg, param)), meta)]

    plan = ()
    if kernel.backward_kernels is not None and all(d.is_floating_point for _, d, _ in meta):
        plan = _plan(kernel, param)
    return backward, native.SAVES[saves], plan


def _plan(kernel, param) -> tuple:
    """``kernel.backward_kernels(param)`` as ``(kernel, param, result)`` steps, one per operand;
    empty (the Python backward runs) when it gives None, or anything but one step per operand,
    each None or a kernel on ``(grad, *saved)`` (registered, or a two-output kernel given to
    :func:`register_pair`) with a number as parameter (None: a kernel without one) and a
    result it has: a wrong plan must not break the forward."""
    operands = 2 if kernel.saves == "output" else 1 + kernel.arity
    try:
        steps = kernel.backward_kernels(param)
        if steps is None:
            return ()
        plan = tuple(None if step is None else _step(*step) for step in steps)
    except Exception:
        return ()
    if len(plan) != kernel.arity or not all(step is None or _step_fits(*step, operands) for step in plan):
        return ()
    return plan


def _step(kernel, param, result=0) -> tuple:
    if isinstance(kernel, str):
        kernel = get(kernel)
    elif PAIRS.get(kernel.name) is not kernel and get(kernel.name) is not kernel:
        raise UnknownKernelError(f"{kernel.name!r}: a plan's kernel must be registered")
    return kernel, param, result


def _step_fits(kernel, param, result, operands: int) -> bool:
    takes_param = (param is None) if kernel.param is None else isinstance(param, (int, float))
    return kernel.arity == operands and takes_param and type(result) is int and 0 <= result < kernel.outputs


native.set_backward_factory(native_backward)


def _elementwise_setup_context(ctx, inputs, output):
    tensors, name, tensor_slots, scalars, param = inputs
    ctx.n_slots = len(tensor_slots)
    _save(ctx, get(name), param, tensor_slots, scalars, tensors, output)


def _run_op(kernel, operands, param):
    return call_op(kernel, operands, param, None)


def _elementwise_backward(ctx, grad):
    out = _input_grads(ctx, grad, _run_op)
    # The inputs' structure as torch.library sees it: a non-empty list of numbers is
    # one leaf (its gradient None), an empty list stays an empty list.
    return out, None, None if ctx.n_slots else [], None if ctx.scalars else [], None


elementwise_op.register_autograd(_elementwise_backward, setup_context=_elementwise_setup_context)


def _batch_first(kernel, tensors, tensor_slots, scalars, in_dims) -> list:
    """vmap's batched operands with the batch dim moved to the front and size-1 dims
    after it, so every operand broadcasts as its per-example self does; unbatched
    operands as they are. A batched operand that is 0-d per example is converted to the
    per-example result dtype first: gaining dims, it would otherwise promote as a tensor
    with dims (an fp32 0-d beside fp16 gives fp16 in torch, fp32 with dims)."""
    per_example = [
        torch.empty((1,) * (t.dim() - (d is not None)), dtype=t.dtype, device="meta") for t, d in zip(tensors, in_dims)
    ]
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


def _elementwise_vmap(info, in_dims, tensors, name, tensor_slots, scalars, param):
    # (the other arguments are not tensors)
    return elementwise_op(
        _batch_first(get(name), tensors, tensor_slots, scalars, in_dims[0]), name, tensor_slots, scalars, param
    ), 0


torch.library.register_vmap(elementwise_op, _elementwise_vmap)


@torch.library.custom_op("fusedkit::elementwise_out", mutates_args=("out",))
def elementwise_out_op(
    tensors: list[torch.Tensor],
    name: str,
    tensor_slots: list[int],
    scalars: list[Scalar],
    param: Scalar,
    out: torch.Tensor,
) -> None:
    kernel = get(name)
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    elementwise.run_validated(elementwise.validate(kernel, operands, _param(kernel, param), out))


@elementwise_out_op.register_fake
def _(tensors, name, tensor_slots, scalars, param, out):
    return None


def _elementwise_out_vmap(info, in_dims, tensors, name, tensor_slots, scalars, param, out):
    tensor_dims, out_dim = in_dims[0], in_dims[5]
    if out_dim is None:
        # torch's rule for in-place ops under vmap: the written tensor must be batched.
        raise ArgumentError("fusedkit: vmap over an out= call needs out to be batched when an input is")
    rank = max(t.dim() - (d is not None) for t, d in zip(tensors, tensor_dims))
    out = out.movedim(out_dim, 0)
    out = out.reshape(out.shape[0], *(1,) * (rank - out.dim() + 1), *out.shape[1:])
    elementwise_out_op(
        _batch_first(get(name), tensors, tensor_slots, scalars, tensor_dims), name, tensor_slots, scalars, param, out
    )
    return None, None


torch.library.register_vmap(elementwise_out_op, _elementwise_out_vmap)


#: Two-output kernels by name (``ElementwiseKernel(outputs=2)``: backwards' kernels, kept out
#: of the registry), for ``fusedkit::elementwise_pair``; :func:`register_pair` adds one.
PAIRS: dict = {}


def register_pair(kernel) -> None:
    """Let ``fusedkit::elementwise_pair`` run the two-output ``kernel`` by its name."""
    PAIRS[kernel.name] = kernel


@torch.library.custom_op("fusedkit::elementwise_pair", mutates_args=())
def elementwise_pair_op(
    tensors: list[torch.Tensor], name: str, tensor_slots: list[int], scalars: list[Scalar], param: Scalar
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both results of a two-output kernel: the registered op a dispatch mode sees (a byte
    counter, ``make_fx``) where an eager call would call ``run_pair`` directly."""
    kernel = PAIRS[name]
    operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
    return elementwise.run_pair(kernel, operands, _param(kernel, param))


@elementwise_pair_op.register_fake
def _(tensors, name, tensor_slots, scalars, param):
    kernel = PAIRS[name]
    with torch.no_grad():
        call = elementwise.validate(
            kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), _param(kernel, param), None, outputs=2
        )
    return elementwise.allocate_out(call), elementwise.allocate_out(call)


def call_pair(kernel, operands: tuple, param=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both results of a two-output ``kernel`` (registered with :func:`register_pair`) through
    ``fusedkit::elementwise_pair``."""
    tensors, slots, scalars = _split(operands)
    return elementwise_pair_op(tensors, kernel.name, slots, scalars, param if param is not None else 0)


def _check_registered(kernel) -> None:
    if get(kernel.name) is not kernel:
        raise UnknownKernelError(
            f"{kernel.name!r}: autograd and torch.compile run registered kernels only; "
            "fusedkit.registry.register() it first"
        )


def call_op(kernel, operands: tuple, param, out: torch.Tensor | None) -> torch.Tensor:
    """Call ``kernel`` through the registered op (autograd records it; Dynamo traces it)."""
    _check_registered(kernel)
    tensors, slots, scalars = _split(operands)
    param = param if param is not None else 0
    if out is not None:
        elementwise_out_op(tensors, kernel.name, slots, scalars, param, out)
        return out
    return elementwise_op(tensors, kernel.name, slots, scalars, param)


class EagerElementwise(torch.autograd.Function):
    """An eager call that needs a gradient: the registered op's autograd without the
    dispatcher. ``forward`` runs with grad off: a kept launch when the signature repeats.

    ``forward`` takes ``ctx`` (no ``setup_context``): with a ``setup_context``, every
    ``apply`` binds its arguments through ``inspect.signature``, 40% of this path's
    host time on a CPU host. ``torch.func`` transforms need one: they get
    :class:`FuncElementwise`."""

    @staticmethod
    def forward(ctx, kernel, param, tensor_slots, scalars, *tensors):
        output = elementwise.run(kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), param)
        _save(ctx, kernel, param, tensor_slots, scalars, tensors, output, needed_only=True)
        return output

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *_input_grads(ctx, grad))


class EagerPreElementwise(torch.autograd.Function):
    """An eager call that needs a gradient of a kernel that saves "pre" (``gelu(x + alpha * y)``
    keeps the sum, as torch does): one launch of its ``forward_pair`` writes the result and
    ``pre``, which is kept as a second output, so a gradient of the gradient (which reads
    ``pre``) flows back into it and through ``pre``'s own backward."""

    @staticmethod
    def forward(ctx, kernel, param, observed, tensor_slots, scalars, *tensors):
        operands = _assemble(kernel.arity, tensors, tensor_slots, scalars)
        if observed:  # (a dispatch mode watches: the pair through its registered op, which it sees)
            output, pre = call_pair(kernel.forward_pair, operands, param)
        else:
            output, pre = elementwise.run_pair(kernel.forward_pair, operands, param)
        ctx.set_materialize_grads(False)
        ctx.kernel, ctx.param, ctx.slots = kernel, param, tensor_slots
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.save_for_backward(pre)
        return output, pre

    @staticmethod
    def backward(ctx, grad, grad_pre):
        if grad is None and grad_pre is None:
            return (None,) * (5 + len(ctx.slots))
        (pre,) = ctx.saved_tensors
        kernel = ctx.kernel
        grads = _pre_grads(kernel, grad, pre, _param(kernel, ctx.param), grad_pre)
        return (None,) * 5 + tuple(_operand_grad(grads[slot], meta) for slot, meta in zip(ctx.slots, ctx.meta))


class FuncElementwise(torch.autograd.Function):
    """A call under a ``torch.func`` transform (vmap, grad, jacrev, ...): the same saved
    tensors and backward, with the ``setup_context`` and the vmap rule those transforms
    need (the registered op's generated autograd has no ``setup_context``). Its forward
    and vmap rule come back here while a transform is still active (:func:`_inner`)."""

    @staticmethod
    def forward(kernel, param, tensor_slots, scalars, *tensors):
        return _inner(kernel, _assemble(kernel.arity, tensors, tensor_slots, scalars), param)

    @staticmethod
    def setup_context(ctx, inputs, output):
        kernel, param, tensor_slots, scalars, *tensors = inputs
        _save(ctx, kernel, param, tensor_slots, scalars, tensors, output, for_forward=True)
        ctx.shape, ctx.dtype = output.shape, output.dtype

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, None, *_input_grads(ctx, grad, _inner))

    @staticmethod
    def jvp(ctx, _kernel, _param, _slots, _scalars, *tangents):
        return _tangent(ctx, tangents, _inner)

    @staticmethod
    def vmap(info, in_dims, kernel, param, tensor_slots, scalars, *tensors):
        moved = _batch_first(kernel, tensors, tensor_slots, scalars, in_dims[4:])
        return _inner(kernel, _assemble(kernel.arity, moved, tensor_slots, scalars), param), 0


def call_functorch(kernel, operands: tuple, param) -> torch.Tensor:
    """A call of ``kernel`` under a ``torch.func`` transform, validated on the wrapped
    tensors before anything runs."""
    elementwise.validate(kernel, operands, param, None)
    tensors, slots, scalars = _split(operands)
    return FuncElementwise.apply(kernel, param, slots, scalars, *tensors)


def call_autograd(kernel, operands: tuple, param, observed: bool = False) -> torch.Tensor:
    """An eager call of ``kernel`` that autograd records (validated inside the Function);
    ``observed``: a dispatch mode watches, and sees the launches through registered ops."""
    if kernel.backward is None:
        elementwise.validate(kernel, operands, param, None)  # raises: no backward (or what comes first)
    elementwise.check_arity(kernel, operands)
    _check_registered(kernel)
    tensors, slots, scalars = _split(operands)
    if kernel.saves == "pre":
        return EagerPreElementwise.apply(kernel, param, observed, slots, scalars, *tensors)[0]
    return EagerElementwise.apply(kernel, param, slots, scalars, *tensors)


def _inner(kernel, operands: tuple, param) -> torch.Tensor:
    """A call from a :class:`FuncElementwise` forward or vmap rule: the transform below this
    one runs its rule next; with none left, autograd records the call where it must
    (``torch.func.vmap`` over tensors that require grad), else it runs."""
    if functorch_active():
        return call_functorch(kernel, operands, param)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands):
        return call_autograd(kernel, operands, param)
    return elementwise.run(kernel, operands, param)


@torch.library.custom_op("fusedkit::matmul", mutates_args=())
def matmul_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None, store_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``act(a @ b + bias)`` and, when ``store_pre``, the pre-activation (else an empty tensor)."""
    out, pre = matmul.forward(a, b, bias, activation, store_pre)
    return out, pre if pre is not None else out.new_empty(0)


@matmul_op.register_fake
def _(a, b, bias, activation, store_pre):
    out = a.new_empty((a.shape[0], b.shape[1]))
    return out, a.new_empty(out.shape if store_pre else (0,))


def matmul_setup_context(ctx, inputs, output):
    """What a matmul's backward reads: a, b, the activation, whether there is a bias, and the
    output (ReLU) or the pre-activation (GELU, SiLU), in the input dtype."""
    a, b, bias, activation, store_pre = inputs
    out, pre = output
    # The op's second output (pre) never gets a gradient: no zeros for it (a dispatch mode
    # saw an M x N aten.zeros in the backward that an eager step never runs).
    ctx.set_materialize_grads(False)
    ctx.activation = activation
    ctx.has_bias = bias is not None
    # ReLU's backward needs only the output; GELU/SiLU need the pre-activation,
    # saved in the input dtype (never an fp32 copy); no activation needs neither.
    saved = pre if activation in matmul.NEEDS_PRE else out if activation == "relu" else None
    ctx.save_for_backward(a, b, saved)
    return a, b, saved


#: The matmul's gradient, ``backward(ctx, grad_out) -> (grad_a, grad_b, grad_bias)`` from what
#: :func:`matmul_setup_context` kept: registered by :mod:`fusedkit.library` (it calls the public
#: ops, which sit above this module).
_matmul_backward = None


def register_matmul_backward(backward, jvp=None, grad_steps=None) -> None:
    """Give the matmul (the custom op and the Functions below) its gradient formula and, for
    forward-mode AD, ``jvp(ctx, tangent_a, tangent_b, tangent_bias) -> (tangent_out,
    tangent_pre)`` on what :func:`matmul_setup_context` kept. ``grad_steps``: by activation,
    the ``(kernel, param)`` the backward launches on ``(grad, saved)`` for the activation's
    gradient (the C++ node launches it too: :func:`native_matmul`)."""
    global _matmul_backward, _matmul_jvp, _matmul_grad_steps
    _matmul_backward, _matmul_jvp, _matmul_grad_steps = backward, jvp, dict(grad_steps or {})


_matmul_jvp = None
_matmul_grad_steps: dict = {}


def _op_backward(ctx, grad_out, _grad_pre):
    if grad_out is None:  # (not materialised: nothing flows back through out)
        return None, None, None, None, None
    return (*_matmul_backward(ctx, grad_out), None, None)


matmul_op.register_autograd(_op_backward, setup_context=matmul_setup_context)


class EagerMatmul(torch.autograd.Function):
    """An eager matmul that needs a gradient: the registered op's autograd (same saved
    tensors, same backward) without the dispatcher and its host time. Only ``out`` is an
    output; the pre-activation, when kept, is saved as an intermediate."""

    @staticmethod
    def forward(ctx, a2, b, bias, activation, store_pre, kept=None):
        if store_pre:
            out, pre = (
                kept.launch_pre(a2, b, bias) if kept is not None else matmul.forward(a2, b, bias, activation, store_pre)
            )
        elif kept is not None:  # a repeated signature's kept plan
            out, pre = kept.launch(a2, b, bias), None
        else:  # grad is off in here: a repeated call is kept
            out, pre = matmul.run(a2, b, bias, activation), None
        matmul_setup_context(ctx, (a2, b, bias, activation, store_pre), (out, pre))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None, None, None, None
        if torch.is_grad_enabled() and ctx.activation in matmul.NEEDS_PRE:
            # The saved pre-activation carries no graph, so a second derivative would
            # silently miss its term.
            raise NotDifferentiableError(
                f"matmul(): double backward through activation={ctx.activation!r} is not "
                "supported (None and 'relu' are)"
            )
        return (*_matmul_backward(ctx, grad_out), None, None, None)


class FuncMatmul(torch.autograd.Function):
    """A 2-D matmul under a ``torch.func`` transform: the registered op's saved tensors and
    backward, with the ``setup_context`` and vmap rule the transforms need. Returns
    ``(out, pre)`` as the op does (``pre`` empty unless kept)."""

    @staticmethod
    def forward(a2, b, bias, activation, store_pre):
        if functorch_active():  # a transform below this one (vmap inside grad): its rule runs next
            return FuncMatmul.apply(a2, b, bias, activation, store_pre)
        out, pre = matmul.forward(a2, b, bias, activation, store_pre)
        return out, pre if pre is not None else out.new_empty(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(*matmul_setup_context(ctx, inputs, output))

    @staticmethod
    def jvp(ctx, tangent_a, tangent_b, tangent_bias, _activation, _store_pre):
        return _matmul_jvp(ctx, tangent_a, tangent_b, tangent_bias)

    @staticmethod
    def backward(ctx, grad_out, grad_pre):
        if grad_out is None:
            return None, None, None, None, None
        return (*_matmul_backward(ctx, grad_out), None, None)

    @staticmethod
    def vmap(info, in_dims, a2, b, bias, activation, store_pre):
        a_dim, b_dim, bias_dim = in_dims[:3]
        if b_dim is None and bias_dim is None:
            # Only ``a`` is batched: the batch joins its rows, one launch.
            a3 = a2.movedim(a_dim, 0)
            batch, m = a3.shape[0], a3.shape[1]
            out, pre = FuncMatmul.apply(a3.reshape(batch * m, a3.shape[2]), b, bias, activation, store_pre)
            out = out.view(batch, m, out.shape[1])
            return (out, pre.view(batch, m, -1) if store_pre else pre), (0, 0 if store_pre else None)
        parts = []
        for i in range(info.batch_size):
            pick = [t if d is None else t.select(d, i) for t, d in ((a2, a_dim), (b, b_dim), (bias, bias_dim))]
            parts.append(FuncMatmul.apply(*pick, activation, store_pre))
        out = torch.stack([p[0] for p in parts])
        pre = torch.stack([p[1] for p in parts]) if store_pre else parts[0][1]
        return (out, pre), (0, 0 if store_pre else None)


def record_matmul(a2, b, bias, activation, kept=None) -> torch.Tensor:
    """An eager 2-D matmul that autograd records; ``kept``: the signature's kept plan."""
    store_pre = activation in matmul.NEEDS_PRE  # (a kept plan of such a call stores it too)
    return EagerMatmul.apply(a2, b, bias, activation, store_pre, kept)


def native_matmul(kept, a, a2, b, bias, out):
    """``kept``'s copy in the C++ launch table (``runtime.native.matmul_recipe``) as ``(table,
    handle)``: its launch and, with a gradient, its node in C++ (an autograd Function's apply
    and Python's launch took about 40% of a repeated ``linear_gelu``'s host time), or None
    where the table does not take it."""
    activation = kept.activation
    step = None
    if activation is not None:
        step = _matmul_grad_steps.get(activation)
        if step is None:
            return None
        step = (step[0], _param(*step))
    fallback = functools.partial(_native_matmul_grads, activation, bias is not None)
    launched = matmul.table_launch(kept.plan, a2, b, bias)
    store_pre = kept.grad and activation in matmul.NEEDS_PRE
    return native.matmul_recipe(
        kept, a, a2, b, bias, out, launched, store_pre, step, "FusedkitMatmulBackward", fallback
    )


def _native_matmul_grads(activation, has_bias: bool, grad, a, b, saved, needs) -> tuple:
    """The C++ node's backward where it does not launch it: :class:`EagerMatmul`'s, on ``a``'s
    2-D view, ``a``'s gradient shaped as ``a``."""
    if torch.is_grad_enabled() and activation in matmul.NEEDS_PRE:
        raise NotDifferentiableError(
            f"matmul(): double backward through activation={activation!r} is not supported (None and 'relu' are)"
        )
    a2 = a.reshape(grad.shape[0], a.shape[-1])
    ctx = SimpleNamespace(
        saved_tensors=(a2, b, saved), activation=activation, has_bias=has_bias, needs_input_grad=tuple(needs)
    )
    grad_a, grad_b, grad_bias = _matmul_backward(ctx, grad)
    return None if grad_a is None else grad_a.reshape(a.shape), grad_b, grad_bias


def matmul_functorch(a2, b, bias, activation) -> torch.Tensor:
    """A 2-D matmul under a ``torch.func`` transform."""
    return FuncMatmul.apply(a2, b, bias, activation, activation in matmul.NEEDS_PRE)[0]


#: How ``MLP`` keeps the output ``h`` of an activation whose derivative reads its input (GELU,
#: SiLU): not at all, its GEMMs reading ``pre`` through the prologue (True: memory, the
#: activation recomputed once a column tile of the GEMMs that read it), or written by the
#: first GEMM's epilogue and saved, as eager keeps it (False: no recomputation). ReLU keeps
#: ``h`` alone either way. The default is the memory mode (docs/matmul.md).
MLP_PROLOGUE = True


class MLP(torch.autograd.Function):
    """``linear(act(linear(x, w1, b1)), w2, b2)`` on 2-D ``x2`` with weights as ``nn.Linear``
    stores them, read through their strides. With :data:`MLP_PROLOGUE`, the activation's
    output ``h`` is never written:
    - forward: ``pre = x2 @ w1^T + b1`` (bias in the epilogue), then ``y = act(pre) @ w2^T +
      b2`` with the activation in the second GEMM's prologue, applied to ``pre``'s tiles as
      they load;
    - backward: ``dpre = (dy @ w2) * act'(pre)`` and ``db1`` from one GEMM's backward epilogue
      (``matmul.activation_grad``); ``dw2 = dy^T act(pre)``, as ``(act(pre)^T dy)^T`` with
      the prologue again; ``dw1`` and ``dx`` as plain GEMMs.
    Saved: ``x2``, the weights and ``pre``, where eager keeps ``h`` too. Without the prologue
    the first GEMM writes ``h`` (and ``pre`` where the derivative needs it) from its epilogue
    and both are saved. ``recompute`` keeps ``x2`` and the weights (and ``b1``) and runs the
    first GEMM again in the backward."""

    @staticmethod
    def forward(ctx, x2, w1, b1, w2, b2, activation: str, recompute: bool):
        # (ReLU keeps h either way: its derivative reads its output, so h is the one tensor of
        # the hidden size it needs, and no GEMM pays for the prologue: a 4% faster training step
        # of GPT-2 medium's MLP on an H100, at the same peak memory)
        prologue = recompute or (MLP_PROLOGUE and activation in matmul.NEEDS_PRE)
        if prologue:
            h, pre = None, matmul.forward(x2, w1.t(), b1, None, False)[0]
            y = matmul.forward(pre, w2.t(), b2, None, False, prologue=activation)[0]
        else:  # (ReLU's derivative reads its output: h stands for pre)
            h, pre = matmul.forward(x2, w1.t(), b1, activation, activation in matmul.NEEDS_PRE)
            y = matmul.forward(h, w2.t(), b2, None, False)[0]
        ctx.activation, ctx.recompute, ctx.has_b1, ctx.has_b2 = activation, recompute, b1 is not None, b2 is not None
        if recompute:
            ctx.save_for_backward(x2, w1, b1, w2)
        else:
            ctx.save_for_backward(x2, w1, w2, pre, h)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            raise NotDifferentiableError("mlp(): double backward is not supported")
        activation = ctx.activation
        if ctx.recompute:
            x2, w1, b1, w2 = ctx.saved_tensors
            pre, h = matmul.forward(x2, w1.t(), b1, None, False)[0], None
        else:
            x2, w1, w2, pre, h = ctx.saved_tensors
        dy = matmul.resolve_neg(dy).to(x2.dtype)  # (the kernel reads memory: a lazy negation is not in it)
        need = ctx.needs_input_grad
        dpre, db1 = matmul.activation_grad(dy, w2, h if pre is None else pre, activation, ctx.has_b1 and need[2])
        dx = dpre @ w1 if need[0] else None
        dw1 = dpre.t() @ x2 if need[1] else None
        dw2 = None
        if need[3]:
            dw2 = (
                dy.t() @ h
                if h is not None
                else matmul.forward(pre.t(), dy, None, None, False, prologue=activation)[0].t()
            )
        db2 = dy.sum(0) if ctx.has_b2 and need[4] else None
        return dx, dw1, db1, dw2, db2, None, None


def gated_forward(x2, w_gate, w_up, b_gate, b_up, activation: str, keep: bool, fused: bool | None = None):
    """``(h, gate, up)`` of a gated MLP's first GEMM on validated 2-D ``x2``: ``h = act(x2 @
    w_gate^T + b_gate) * (x2 @ w_up^T + b_up)``, with the gate and up projections kept
    (``keep``) or None. ``fused`` (default: up to ``GATED_GEMM_MAX_M`` rows): one launch of the
    gated epilogue, weights as ``nn.Linear`` stores them with equal strides (the kernel reads
    both B tiles through one set); else two GEMMs and the registry's gate, one launch."""
    M, N = x2.shape[0], w_gate.shape[0]
    if not (M <= matmul.GATED_GEMM_MAX_M if fused is None else fused):
        gate = torch.nn.functional.linear(x2, w_gate, b_gate)
        up = torch.nn.functional.linear(x2, w_up, b_up)
        h = elementwise.run(get(f"{activation}_mul"), (gate, up), None)  # (the registry's gate)
        return (h, gate, up) if keep else (h, None, None)
    h = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    gate = torch.empty_like(h) if keep else None
    up = torch.empty_like(h) if keep else None
    if h.numel() == 0 or x2.shape[1] == 0:  # (K == 0: the products are the biases alone)
        z = torch.zeros_like(h)
        g, u = z + (0 if b_gate is None else b_gate), z + (0 if b_up is None else b_up)
        h.copy_(matmul.torch_activation(g, activation) * u)
        if keep:
            gate.copy_(g), up.copy_(u)
        return h, gate, up
    matmul.launch_matmul(x2, w_gate.t(), b_gate, activation, h, gate, gate=matmul.Gate(w_up.t(), b_up, up))
    return h, gate, up


class GatedMLP(torch.autograd.Function):
    """``linear(act(linear(x, w_gate, b_gate)) * linear(x, w_up, b_up), w_down, b_down)`` on 2-D
    ``x2``, weights as ``nn.Linear`` stores them:
    - forward: the gate and up projections and ``act(gate) * up`` from one GEMM with the gated
      epilogue (:func:`gated_forward`), then the down projection;
    - backward: ``h`` again from the kept gate and up (the registry's gate, one elementwise
      pass), ``dw_down = dy^T h``; ``dh = dy @ w_down``; both gate gradients from one launch of
      the gate's two-output gradient kernel; ``dx = dgate @ w_gate + dup @ w_up`` (one GEMM
      accumulating into the other), ``dw_gate = dgate^T x2``, ``dw_up = dup^T x2``.
    Saved: ``x2``, the weights and biases, the gate and up projections: two tensors of the
    hidden size where eager keeps four (the gate, its activation, up and ``h``). ``recompute``
    keeps ``x2``, the weights and biases only and runs the gated GEMM again in the backward. A
    gradient of the gradient differentiates PyTorch's composition on the kept inputs."""

    @staticmethod
    def forward(ctx, x2, w_gate, w_up, w_down, b_gate, b_up, b_down, activation: str, recompute: bool):
        h, gate, up = gated_forward(x2, w_gate, w_up, b_gate, b_up, activation, not recompute)
        y = torch.nn.functional.linear(h, w_down, b_down)
        ctx.activation, ctx.recompute = activation, recompute
        ctx.has_bias = (b_gate is not None, b_up is not None, b_down is not None)
        # (the biases too, for a gradient of the gradient: no copies)
        ctx.save_for_backward(x2, w_gate, w_up, w_down, b_gate, b_up, b_down, gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            return (*_composed_gated_grads(ctx, dy), None, None)
        gate_name = f"{ctx.activation}_mul"  # (the registry's gate; its gradient is <name>_grad)
        need = ctx.needs_input_grad
        if not any(need[:4]) and not any(need[4:6]):  # (only b_down's: dy's column sums)
            db_down = dy.sum(0) if ctx.has_bias[2] and need[6] else None
            return None, None, None, None, None, None, db_down, None, None
        x2, w_gate, w_up, w_down, b_gate, b_up, _, gate, up = ctx.saved_tensors
        h = None
        if ctx.recompute:
            h, gate, up = gated_forward(x2, w_gate, w_up, b_gate, b_up, ctx.activation, True)
        dy = matmul.resolve_neg(dy).to(x2.dtype)
        dw_down = db_down = None
        if need[3]:
            if h is None:
                h = elementwise.run(get(gate_name), (gate, up), None)
            dw_down = dy.t() @ h
        del h  # (each tensor of the hidden size freed once read: the step's peak memory)
        if ctx.has_bias[2] and need[6]:
            db_down = dy.sum(0)
        if not any(need[:3]) and not any(need[4:6]):
            return None, None, None, dw_down, None, None, db_down, None, None
        dh = dy @ w_down
        dgate, dup = elementwise.run_pair(PAIRS[f"{gate_name}_grad"], (dh, gate, up), None)
        del dh
        dx = torch.addmm(dgate @ w_gate, dup, w_up) if need[0] else None
        dw_gate = dgate.t() @ x2 if need[1] else None
        dw_up = dup.t() @ x2 if need[2] else None
        db_gate = dgate.sum(0) if ctx.has_bias[0] and need[4] else None
        db_up = dup.sum(0) if ctx.has_bias[1] and need[5] else None
        return dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down, None, None


def _composed_gated_grads(ctx, dy) -> list:
    """The seven input gradients of :class:`GatedMLP` as differentiable PyTorch ops (a gradient
    of the gradient, under ``create_graph``): the forward recomputed as its composition on the
    kept inputs, differentiated."""
    x2, w_gate, w_up, w_down, b_gate, b_up, b_down, _, _ = ctx.saved_tensors
    inputs = (x2, w_gate, w_up, w_down, b_gate, b_up, b_down)
    wanted = [i for i, (t, need) in enumerate(zip(inputs, ctx.needs_input_grad)) if need and t is not None]
    grads = [None] * 7
    if dy is None or not wanted:
        return grads
    F = torch.nn.functional
    with torch.enable_grad():
        gate = matmul.torch_activation(F.linear(x2, w_gate, b_gate), ctx.activation)
        y = F.linear(gate * F.linear(x2, w_up, b_up), w_down, b_down)
        got = torch.autograd.grad(y, [inputs[i] for i in wanted], dy, create_graph=True, allow_unused=True)
    for i, g in zip(wanted, got):
        grads[i] = g
    return grads


class Norm(torch.autograd.Function):
    """An eager normalisation (RMSNorm or LayerNorm over rows, an optional residual added
    first) that needs a gradient. Keeps the normalised rows (the input, or ``h``: an output the
    caller holds anyway), the parameters and the per-row statistics, nothing of the output's
    size and not the add's operands (as the eager add keeps neither); the backward is one
    kernel over the rows. A gradient of the gradient differentiates PyTorch's composition of
    the norm on the kept rows (``h`` carries the add's graph back to x and residual)."""

    @staticmethod
    def forward(ctx, x2, residual2, weight, bias, eps, alpha, rms, y_dtype, h_dtype):
        y, h, mean, rstd = row_norm.forward(x2, residual2, weight, bias, eps, alpha, rms, y_dtype, h_dtype, True)
        ctx.set_materialize_grads(False)
        ctx.eps, ctx.alpha, ctx.rms = eps, alpha, rms
        ctx.dtypes = (x2.dtype, None if residual2 is None else residual2.dtype)
        ctx.save_for_backward(x2 if h is None else h, weight, bias, mean, rstd)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        return (*norm_grads(ctx, rows, weight, bias, mean, rstd, dy, dh_out), *(None,) * 5)


class KeptNorm(torch.autograd.Function):
    """:class:`Norm` for a repeated signature with a grad recipe (``row_norm.GradRecipe``): its
    forward and backward launch their kept kernels on the call's own tensors, with no rows
    views, argument tuples or launch keys built, and the statistics in one buffer. What it
    keeps and computes is :class:`Norm`'s; a backward the recipe does not take (a gradient of
    the gradient, gradients laid out otherwise, a first backward) runs :func:`norm_grads`."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, recipe, ptrs):
        y, h, stats = row_norm.run_grad_forward(recipe, ptrs)
        ctx.set_materialize_grads(False)
        ctx.recipe = recipe
        ctx.save_for_backward(x if h is None else h, weight, bias, stats)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        rows, weight, bias, stats = ctx.saved_tensors
        r = ctx.recipe
        needs = ctx.needs_input_grad
        got = None
        if dy is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            got = row_norm.run_grad_backward(r, dy, rows, weight, bias, stats, dh_out)
        if got is None:
            return (*_kept_norm_grads(ctx, r, rows, weight, bias, stats, dy, dh_out), None, None)
        dh, dw, db = got
        x_dtype, r_dtype = r.dtypes
        dr = None
        if r_dtype is not None and needs[1]:
            dr = dh if r.alpha == 1 else dh * r.alpha
            dr = dr if dr.dtype == r_dtype else dr.to(r_dtype)
        dx = (dh if dh.dtype == x_dtype else dh.to(x_dtype)) if needs[0] else None
        return dx, dr, (dw if needs[2] else None), (db if needs[3] else None), None, None


def _kept_norm_grads(ctx, r, rows, weight, bias, stats, dy, dh_out) -> tuple:
    """:class:`KeptNorm`'s gradients through :func:`norm_grads` on the rows views (then kept
    for the next backward of the recipe where the ordinary path's launch allows)."""
    ctx.eps, ctx.alpha, ctx.rms, ctx.dtypes = r.eps, r.alpha, r.rms, r.dtypes
    count, n = r.rows, r.n
    mean, rstd = row_norm.stats_views(r, stats)
    rows2 = row_norm.rows_of(rows, count, n)
    dy2, dh2 = (None if g is None else g.reshape(count, n) for g in (dy, dh_out))
    dx, dr, dw, db = norm_grads(ctx, rows2, weight, bias, mean, rstd, dy2, dh2)
    if dy is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        row_norm.learn_backward(r, dy, rows, weight, bias, stats, dh_out, ctx.needs_input_grad[2])

    def shaped(g):
        # (in the input's shape, one tensor for one gradient: two views of one would each be
        # taken as a leaf's .grad, sharing its memory; the gradient that reached h itself,
        # passed through, as it came)
        return None if g is None else dh_out if g is dh2 else g.view(r.shape)

    shaped_dx = shaped(dx)
    return shaped_dx, (shaped_dx if dr is dx else shaped(dr)), dw, db


def native_norm(recipe):
    """``recipe``'s copy in the C++ launch table (``runtime.native.norm_recipe``): its forward
    launched and its node recorded in C++, and its backward once one backward of it kept its
    launch (a Python Function's forward and backward alone take about half the host time of
    eager's add + RMSNorm forward and backward: ``benchmarks/host_profile.py``'s
    ``function_roundtrip``); None where the table does not take it."""
    return native.norm_recipe(recipe, functools.partial(_native_norm_grads, recipe))


def _native_norm_grads(recipe, handle, dy, dh_out, rows, weight, bias, stats, needs) -> tuple:
    """The C++ node's backward where its kept launch does not take the call: :func:`norm_grads`
    on the rows views, as :class:`KeptNorm`'s; then the backward launch it kept, given to the
    table for the next."""
    grads = _kept_norm_grads(SimpleNamespace(needs_input_grad=needs), recipe, rows, weight, bias, stats, dy, dh_out)
    given = dh_out is not None
    backward = recipe.backward.get(given)
    if backward is not None and not handle.has_backward(given):
        native.norm_backward(handle, given, recipe, backward)
    return grads


def kept_norm(recipe, x, residual, weight, bias):
    """``y`` (or ``(y, h)``) of a call with a gradient whose signature kept ``recipe``; None
    where its launch does not take this call (another alignment, another current device)."""
    ptrs = row_norm.grad_pointers(recipe, x, residual, weight, bias)
    if ptrs is None:
        return None
    return KeptNorm.apply(x, residual, weight, bias, recipe, ptrs)


def norm_grads(ctx, rows, weight, bias, mean, rstd, dy, dh_out, launch=None) -> tuple:
    """``(dx, dresidual, dweight, dbias)`` of a norm from what it kept: one backward launch
    (``launch``, default :func:`_launch_norm_backward`: ``(dh, dweight, dbias)``, the
    parameters' in float32), or under ``create_graph`` PyTorch's composition on ``rows``
    (differentiable). ``ctx`` holds ``eps``, ``alpha``, ``rms``, ``dtypes`` (x's and the
    residual's) and ``needs_input_grad``."""
    x_dtype, r_dtype = ctx.dtypes
    needs = ctx.needs_input_grad
    if torch.is_grad_enabled():
        dh, dw, db = _composed_norm_grads(ctx, rows, weight, bias, dy, dh_out)
    elif dy is None:  # only the residual stream reached the loss: the norm's parameters get none
        dh, dw, db = dh_out, None, None
    else:
        if launch is None:
            # (compiled autograd traces a Function's backward: the registered op, which it can)
            launch = _launch_norm_backward_op if torch.compiler.is_compiling() else _launch_norm_backward
        dh, dw, db = launch(ctx, rows, weight, bias, mean, rstd, dy, dh_out)
        dw = None if dw is None else dw.to(weight.dtype)
        db = None if db is None else db.to(bias.dtype)
    dr = None
    if r_dtype is not None and needs[1] and dh is not None:
        dr = (dh if ctx.alpha == 1 else dh * ctx.alpha).to(r_dtype)
    dx = dh.to(x_dtype) if needs[0] and dh is not None else None
    return dx, dr, (dw if needs[2] else None), (db if needs[3] else None)


def _launch_norm_backward(ctx, rows, weight, bias, mean, rstd, dy, dh_out):
    n = rows.shape[1]
    # (the gradients as rows with unit column stride: a sum's gradient arrives expanded)
    dy = row_norm.rows_of(dy, rows.shape[0], n)
    dh_out = None if dh_out is None else row_norm.rows_of(dh_out, rows.shape[0], n)
    need_weight = weight is not None and ctx.needs_input_grad[2]
    return row_norm.backward(dy, rows, weight, mean, rstd, dh_out, ctx.rms, bias is not None, rows.dtype, need_weight)


def _composed_norm_grads(ctx, rows, weight, bias, dy, dh_out):
    """The norm's input and parameter gradients as differentiable PyTorch ops on the kept rows
    (recomputing the forward as the composition), plus the gradient that reached ``h``."""
    params = [t for t in (weight, bias) if t is not None and t.requires_grad]
    dh = dh_out
    dw = db = None
    if dy is not None:
        with torch.enable_grad():
            y, _ = row_norm.reference(rows, None, weight, bias, ctx.eps, 1, ctx.rms, (rows.shape[-1],))
            leaves = [rows] + params if rows.requires_grad else params
            got = list(torch.autograd.grad(y, leaves, dy, create_graph=True, allow_unused=True))
        g_rows = got.pop(0) if rows.requires_grad else None
        dh = g_rows if dh_out is None else (dh_out if g_rows is None else g_rows + dh_out)
        named = dict(zip([id(p) for p in params], got))
        dw = named.get(id(weight)) if weight is not None else None
        db = named.get(id(bias)) if bias is not None else None
    return dh, dw, db


# --- The norms as registered ops: what a dispatch mode (a byte counter) and compiled code with
# compiled_elementwise="kernel" see: one op forward, one backward, as eager launches them.


@torch.library.custom_op("fusedkit::norm", mutates_args=())
def norm_op(
    x2: torch.Tensor,
    residual2: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    name: str,
    eps: float,
    alpha: float,
    y_dtype: torch.dtype,
    h_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``name`` (rms_norm, layer_norm, add_rms_norm, add_layer_norm) over the rows of ``x2``:
    ``(y, h, mean, rstd)``, an absent one (h without a residual, RMS's mean) empty."""
    x2, residual2 = (None if t is None else row_norm.rows_of(t, *x2.shape) for t in (x2, residual2))
    y, h, mean, rstd = row_norm.forward(x2, residual2, weight, bias, eps, alpha, "rms" in name, y_dtype, h_dtype, True)
    empty = x2.new_empty(0, dtype=torch.float32)
    return y, x2.new_empty(0, dtype=h_dtype) if h is None else h, empty if mean is None else mean, rstd


@norm_op.register_fake
def _(x2, residual2, weight, bias, name, eps, alpha, y_dtype, h_dtype):
    rows, n = x2.shape
    return (
        x2.new_empty((rows, n), dtype=y_dtype),
        x2.new_empty((rows, n) if residual2 is not None else (0,), dtype=h_dtype),
        x2.new_empty((rows,) if "layer" in name else (0,), dtype=torch.float32),
        x2.new_empty((rows,), dtype=torch.float32),
    )


@torch.library.custom_op("fusedkit::norm_backward", mutates_args=())
def norm_backward_op(
    dy: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dh_out: torch.Tensor | None,
    name: str,
    has_bias: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`norm_op`'s ``name``: ``(dx, dweight, dbias)`` (empty where none;
    the parameters' in float32: a sharded call's partial sums are reduced before rounding)."""
    n = rows.shape[1]
    # (rows as the forward read them: the op's input may be a view of other column strides)
    dy, dh_out, rows = (None if t is None else row_norm.rows_of(t, rows.shape[0], n) for t in (dy, dh_out, rows))
    dx, dw, db = row_norm.backward(
        dy,
        rows,
        weight,
        None if "rms" in name else mean,
        rstd,
        dh_out,
        "rms" in name,
        has_bias,
        rows.dtype,
        need_weight,
    )
    # (an empty tensor each: an op's outputs do not alias each other)
    dw = rows.new_empty(0, dtype=torch.float32) if dw is None else dw
    return dx, dw, rows.new_empty(0, dtype=torch.float32) if db is None else db


@norm_backward_op.register_fake
def _(dy, rows, weight, mean, rstd, dh_out, name, has_bias, need_weight):
    n = rows.shape[1]
    dw = rows.new_empty((n,) if weight is not None and need_weight else (0,), dtype=torch.float32)
    return rows.new_empty(rows.shape), dw, rows.new_empty((n,) if has_bias else (0,), dtype=torch.float32)


def _norm_setup_context(ctx, inputs, output):
    x2, residual2, weight, bias, name, eps, alpha, y_dtype, h_dtype = inputs
    y, h, mean, rstd = output
    ctx.set_materialize_grads(False)
    ctx.name, ctx.eps, ctx.alpha, ctx.rms = name, eps, alpha, "rms" in name
    ctx.dtypes = (x2.dtype, None if residual2 is None else residual2.dtype)
    ctx.save_for_backward(x2 if residual2 is None else h, weight, bias, mean, rstd)


def _norm_op_backward(ctx, dy, dh, _dmean, _drstd):
    rows, weight, bias, mean, rstd = ctx.saved_tensors
    return (*norm_grads(ctx, rows, weight, bias, mean, rstd, dy, dh, _launch_norm_backward_op), *(None,) * 5)


def _launch_norm_backward_op(ctx, rows, weight, bias, mean, rstd, dy, dh_out):
    """The backward as the registered op (what a dispatch mode sees); its empty tensors as None."""
    need_weight = weight is not None and ctx.needs_input_grad[2]
    # (the op's name, which a byte counter reports; a Function's ctx, traced by compiled
    # autograd, has a name() method instead, and holds what names the op)
    name = getattr(ctx, "name", None)
    if not isinstance(name, str):
        name = ("add_" if ctx.dtypes[1] is not None else "") + ("rms_norm" if ctx.rms else "layer_norm")
    dx, dw, db = norm_backward_op(dy, rows, weight, mean, rstd, dh_out, name, bias is not None, need_weight)
    return dx, dw if need_weight else None, db if bias is not None else None


norm_op.register_autograd(_norm_op_backward, setup_context=_norm_setup_context)
