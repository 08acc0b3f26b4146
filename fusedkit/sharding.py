"""Sharding rules of fusedkit's custom ops, for tensor parallelism with ``DTensor``.

Under ``torch.distributed.tensor.parallel`` (``ColwiseParallel``, ``RowwiseParallel``) the
weights and activations that reach fusedkit's ops are ``DTensor`` s; they take the registered
ops (:mod:`fusedkit.autograd`), and DTensor needs a rule for each: which placements of the
inputs each op computes on its local shards, and what placement the result then has.

- ``fusedkit::elementwise``: pointwise. All replicated, or every operand sharded along the
  same dim of the result (a broadcast operand, size 1 or missing there, replicated). An
  ``out=`` DTensor is written as torch writes one: the result computed, then copied into it
  (:mod:`fusedkit.dispatch`), since a rule would redistribute ``out`` into a temporary.
- ``fusedkit::norm`` and ``fusedkit::norm_backward`` (rows of ``n``): replicated, or
  row-sharded with the parameters replicated; the backward's parameter gradients are then
  partial sums over each rank's rows (``Partial``).
- ``fusedkit::matmul`` (``a`` (M, K) @ ``b`` (K, N) + bias): replicated; row-sharded ``a``
  (result rows sharded); column-sharded ``b`` and bias (result columns sharded: a
  column-parallel ``LinearReLU``); and a sharded K, whose local products are partial sums
  (``Partial``), only without an activation, which does not distribute over a sum (a
  row-parallel layer's activation runs after the reduction: :mod:`fusedkit.dispatch`).

The MLP ops (``fusedkit.mlp``, ``fusedkit.gated_mlp``) are Python functions over several
kernels, not one registered op: on DTensors they run on each rank's local shards through
DTensor's ``local_map`` where the placements are one of tensor parallelism's (:func:`local_mlp`):
all replicated; rows sharded with the weights replicated; or the column-parallel up (and gate)
projections and the row-parallel down projection of Megatron-style tensor parallelism, whose
local results are partial sums (``Partial``; the down projection's bias is added after them,
once). Other placements run the ops' PyTorch composition, which DTensor shards op by op.

The rules are registered as ``torch.distributed.tensor`` is imported, before or after
``fusedkit`` (no DTensor exists before): at ``import fusedkit`` when it is imported already,
else by a finder on ``sys.meta_path`` that registers them right after its import. So
``import fusedkit`` does not import ``torch.distributed`` (0.4 s), and a compiled
tensor-parallel model finds the rules even when no eager call came first.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

import torch

from . import autograd  # noqa: F401 - defines the torch.ops.fusedkit ops the rules are for

__all__ = ["ensure_registered", "has_dtensor", "install", "k_sharded", "local_mlp", "reduce_partial"]

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


class _Loader(importlib.abc.Loader):
    """``torch.distributed.tensor``'s own loader, registering the rules once it has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        try:
            ensure_registered()
        except Exception as exc:
            warnings.warn(f"fusedkit: DTensor sharding rules not registered: {exc!r}", RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.tensor`` as the other finders do, with :class:`_Loader` around
    its loader (which takes this finder off ``sys.meta_path`` once the module has run: a bare
    ``importlib.util.find_spec`` imports nothing)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DTENSOR_MODULE:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Finder):
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register the rules now if ``torch.distributed.tensor`` is imported, else as it is."""
    if _DTENSOR_MODULE in sys.modules:
        ensure_registered()
    elif torch.distributed.is_available() and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def has_dtensor(values) -> bool:
    """Whether any of ``values`` is a DTensor (a check for calls already off the eager path).
    ``_DTensor`` is None only where no DTensor exists: the rules register with its import."""
    return _DTensor is not None and any(isinstance(v, _DTensor) for v in values)


def k_sharded(a, b) -> bool:
    """Whether a matmul's operands are DTensors sharded along the contraction dim K (``a``'s
    last dim or ``b``'s first), so the local products are partial sums."""
    if (type(a) in _PLAIN and type(b) in _PLAIN) or _DTensor is None:
        return False  # (the eager path's check: two type lookups)
    return any(
        isinstance(t, _DTensor) and t.dim() >= 1 and any(p.is_shard(dim % t.dim()) for p in t.placements)
        for t, dim in ((a, -1), (b, 0))
    )


#: An MLP operand's role in :func:`local_mlp`: the input rows, a column-parallel weight (output
#: features sharded: the up and gate projections) or its bias, the row-parallel weight (input
#: features sharded: the down projection) or its bias.
ROWS, COLUMN, COLUMN_BIAS, ROW, ROW_BIAS = "rows", "column", "column bias", "row", "row bias"


def _mlp_placements(roles, tensors):
    """``(in_placements, in_grad_placements, out_placement, bias_after)`` for an MLP op's operands
    on a 1-D mesh (None for a missing one), or None where their placements are none of
    :func:`local_mlp`'s; ``bias_after``: the row bias is added to the reduced result, not on
    every rank."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    given = [t for t in tensors if t is not None]
    if not all(isinstance(t, _DTensor) for t in given):
        return None  # (plain tensors beside DTensors: DTensor's own ops say what it takes)
    mesh = given[0].device_mesh
    if mesh.ndim != 1 or any(t.device_mesh != mesh for t in given):
        return None
    placed = [(role, t.placements[0]) for role, t in zip(roles, tensors) if t is not None]
    shards = [p for _, p in placed]
    x = tensors[0]

    def each(placement_of):
        return tuple(None if t is None else (placement_of(role),) for role, t in zip(roles, tensors))

    if all(p.is_replicate() for p in shards):
        ins = each(lambda role: Replicate())
        return ins, ins, Replicate(), False
    rows = shards[0]
    # (evenly: local_map makes the result from each rank's rows as if every rank held as many)
    even = rows.is_shard() and x.shape[rows.dim % x.dim()] % mesh.size() == 0
    if even and rows.dim % x.dim() != x.dim() - 1 and all(p.is_replicate() for p in shards[1:]):
        # each rank's rows: its rows of the result; the parameters' gradients summed over ranks
        ins = each(lambda role: rows if role == ROWS else Replicate())
        grads = each(lambda role: rows if role == ROWS else Partial())
        return ins, grads, Shard(rows.dim % x.dim()), False
    wanted = {ROWS: Replicate(), COLUMN: Shard(0), COLUMN_BIAS: Shard(0), ROW: Shard(1), ROW_BIAS: Replicate()}
    if all(p == wanted[role] for role, p in placed):  # (each operand: gate and up share a role)
        # Megatron's MLP: the hidden features sharded; each rank's down projection a partial sum
        ins = each(wanted.__getitem__)
        grads = each(lambda role: Partial() if role == ROWS else wanted[role])
        return ins, grads, Partial(), True
    return None


def local_mlp(call, roles, tensors):
    """``call(*tensors)`` (an MLP op on plain tensors, the operands in ``roles``' order) on each
    rank's local shards of the DTensors ``tensors``, the result a DTensor; None where their
    placements are none that a local call computes (:func:`_mlp_placements`)."""
    from torch.distributed.tensor.experimental import local_map

    found = _mlp_placements(roles, tensors)
    if found is None:
        return None
    ins, grads, out, bias_after = found
    at = roles.index(ROW_BIAS)
    bias = tensors[at] if bias_after else None
    if bias is not None:  # (added once, to the reduced result)
        tensors = (*tensors[:at], None, *tensors[at + 1 :])
        ins, grads = (tuple(None if i == at else p for i, p in enumerate(t)) for t in (ins, grads))
    mesh = next(t for t in tensors if t is not None).device_mesh
    y = local_map(call, [out], in_placements=ins, in_grad_placements=grads, device_mesh=mesh)(*tensors)
    return y if bias is None else reduce_partial(y) + bias


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
    def _elementwise(tensors, name, tensor_slots, scalars, param):
        shapes = _shapes(tensors)
        return [(out, [*ins, None, None, None, None]) for out, ins in _pointwise(_broadcast(shapes), shapes)]

    @register_sharding(ops.matmul.default)
    def _matmul(a, b, bias, activation, store_pre):
        def option(result, pa, pb, pbias):
            # ``pre`` is sharded as the result when kept, else an empty tensor, replicated.
            return [result, result if store_pre else Replicate()], [pa, pb, None if bias is None else pbias, None, None]

        options = [
            option(Replicate(), Replicate(), Replicate(), Replicate()),
            option(Shard(0), Shard(0), Replicate(), Replicate()),
            option(Shard(1), Replicate(), Shard(1), Shard(0)),
        ]
        if activation is None:
            options.append(option(Partial(), Shard(1), Shard(0), Partial()))
        return options

    @register_sharding(ops.norm.default)
    def _norm(x2, residual2, weight, bias, name, eps, alpha, y_dtype, h_dtype):
        def option(rows):
            # (h without a residual and RMS's mean are empty: replicated)
            h = rows if residual2 is not None else Replicate()
            mean = rows if "layer" in name else Replicate()
            params = [None if t is None else Replicate() for t in (residual2, weight, bias)]
            params[0] = None if residual2 is None else rows
            return [rows, h, mean, rows], [rows, *params, None, None, None, None, None]

        return [option(Replicate()), option(Shard(0))]

    @register_sharding(ops.norm_backward.default)
    def _norm_backward(dy, rows, weight, mean, rstd, dh_out, name, has_bias, need_weight):
        def option(placement, summed):
            ins = [placement, placement, None if weight is None else Replicate()]
            ins += [placement if "layer" in name else Replicate(), placement, None if dh_out is None else placement]
            return [placement, summed, summed], [*ins, None, None, None]

        # row-sharded: each rank's rows give a partial sum of the parameters' gradients
        return [option(Replicate(), Replicate()), option(Shard(0), Partial())]

    # register_sharding keys its cache on the tensor arguments and those from the first int
    # argument on: none here, so the kernel name, the activation and store_pre, which change
    # the rule or the result's shape, would not be in the key. All arguments are (a scalar
    # operand's value too: a new value propagates again, 2.4 ms on a CPU host).
    propagator = DTensor._op_dispatcher.sharding_propagator
    for op in (ops.elementwise.default, ops.matmul.default, ops.norm.default, ops.norm_backward.default):
        propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_argnum=0, needs_pytree=True)
    _DTensor, _Replicate = DTensor, Replicate
