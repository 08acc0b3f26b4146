"""Sharding rules of fusedkit's custom ops, for tensor parallelism with ``DTensor``.

Under ``torch.distributed.tensor.parallel`` (``ColwiseParallel``, ``RowwiseParallel``) the
weights and activations that reach fusedkit's ops are ``DTensor`` s; they take the registered
ops (:mod:`fusedkit.autograd`), and DTensor needs a rule for each: which placements of the
inputs each op computes on its local shards, and what placement the result then has.

- ``fusedkit::elementwise``: pointwise. All replicated, or every operand sharded along the
  same dim of the result (a broadcast operand, size 1 or missing there, replicated). An
  ``out=`` DTensor is written as torch writes one: the result computed, then copied into it
  (:mod:`fusedkit.dispatch`), since a rule would redistribute ``out`` into a temporary.
- ``fusedkit::matmul`` (``a`` (M, K) @ ``b`` (K, N) + bias): replicated; row-sharded ``a``
  (result rows sharded); column-sharded ``b`` and bias (result columns sharded: a
  column-parallel ``LinearReLU``); and a sharded K, whose local products are partial sums
  (``Partial``), only without an activation, which does not distribute over a sum (a
  row-parallel layer's activation runs after the reduction: :mod:`fusedkit.dispatch`).

The rules are registered when ``fusedkit`` is imported after ``torch.distributed.tensor``,
else the first time an eager call sees a DTensor (:func:`ensure_registered`), so
``import fusedkit`` does not import ``torch.distributed`` (0.4 s). A program that compiles a
tensor-parallel model before any eager call must import ``torch.distributed.tensor`` before
``fusedkit`` (importing ``torch.distributed.tensor.parallel`` does).
"""

from __future__ import annotations

import sys

import torch

from . import autograd  # noqa: F401 - defines the torch.ops.fusedkit ops the rules are for

__all__ = ["ensure_registered", "has_dtensor", "k_sharded", "reduce_partial"]

_DTENSOR_MODULE = "torch.distributed.tensor"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_registered = False
#: DTensor's classes, once the rules are registered (module globals: a compiled graph reads
#: them without an import).
_DTensor = None
_Replicate = None


def ensure_registered() -> None:
    """Register the rules once, when DTensor has been imported (no DTensor exists before)."""
    global _registered
    if not _registered and _DTENSOR_MODULE in sys.modules:
        _register()
        _registered = True


def has_dtensor(values) -> bool:
    """Whether any of ``values`` is a DTensor (a check for calls already off the eager path)."""
    if _DTENSOR_MODULE not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in values)


def k_sharded(a, b) -> bool:
    """Whether a matmul's operands are DTensors sharded along the contraction dim K (``a``'s
    last dim or ``b``'s first), so the local products are partial sums."""
    if type(a) in _PLAIN and type(b) in _PLAIN:
        return False  # (the eager path's check: two type lookups)
    if _DTensor is None:
        if torch.compiler.is_compiling():
            return False  # (no DTensor has reached fusedkit eagerly, nor been imported before it)
        ensure_registered()
        if _DTensor is None:
            return False
    return any(isinstance(t, _DTensor) and t.dim() >= 1 and any(p.is_shard(dim % t.dim()) for p in t.placements)
               for t, dim in ((a, -1), (b, 0)))


def reduce_partial(t):
    """DTensor ``t`` with its partial sums reduced (replicated there); other placements kept."""
    return t.redistribute(t.device_mesh, [_Replicate() if p.is_partial() else p for p in t.placements])


def _pointwise(out_shape, inputs) -> list[tuple[list, list]]:
    """The pointwise strategies: ``(output placements, input placements)`` per option, one
    placement per tensor input (``inputs``: each tensor's global shape)."""
    from torch.distributed.tensor import Replicate, Shard

    options = [([Replicate()], [Replicate() for _ in inputs])]
    rank = len(out_shape)
    for dim in range(rank):
        placements = []
        for shape in inputs:
            own = dim - (rank - len(shape))  # the operand's dim that broadcasts to ``dim``
            placements.append(Shard(own) if own >= 0 and shape[own] == out_shape[dim] else Replicate())
        if any(p.is_shard() for p in placements):
            options.append(([Shard(dim)], placements))
    return options


def _broadcast(shapes) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*shapes))


def _register() -> None:
    global _DTensor, _Replicate
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.fusedkit

    def _shapes(tensors):
        return [tuple(t.shape) for t in tensors]

    @register_sharding(ops.elementwise.default)
    def _elementwise(name, tensors, tensor_slots, scalars, param):
        shapes = _shapes(tensors)
        return [(out, [None, *ins, None, None, None]) for out, ins in _pointwise(_broadcast(shapes), shapes)]

    @register_sharding(ops.matmul.default)
    def _matmul(a, b, bias, activation, store_pre):
        def option(result, pa, pb, pbias):
            # ``pre`` is sharded as the result when kept, else an empty tensor, replicated.
            return [result, result if store_pre else Replicate()], [pa, pb, None if bias is None else pbias, None, None]
        options = [option(Replicate(), Replicate(), Replicate(), Replicate()),
                   option(Shard(0), Shard(0), Replicate(), Replicate()),
                   option(Shard(1), Replicate(), Shard(1), Shard(0))]
        if activation is None:
            options.append(option(Partial(), Shard(1), Shard(0), Partial()))
        return options

    # register_sharding keys its cache on the tensor arguments and those from the first int
    # argument on: none here, so the kernel name, the activation and store_pre, which change
    # the rule or the result's shape, would not be in the key. All arguments are (a scalar
    # operand's value too: a new value propagates again, 2.4 ms on a CPU host).
    propagator = DTensor._op_dispatcher.sharding_propagator
    for op in (ops.elementwise.default, ops.matmul.default):
        propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=0, needs_pytree=True)
    _DTensor, _Replicate = DTensor, Replicate
