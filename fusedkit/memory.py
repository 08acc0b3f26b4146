"""Where a model's memory traffic goes: :class:`MemoryCounterMode` counts the modelled DRAM
bytes every aten op reads and writes, per op and per module, forward and backward.

Used as ``torch.utils.flop_counter.FlopCounterMode`` is::

    with fusedkit.MemoryCounterMode(depth=2) as counter:
        model(x).sum().backward()
    counter.get_total_bytes(), counter.get_bytes_by_op(), counter.get_table()

The byte model is the registry's (:func:`fusedkit.registry.tensor_read_bytes`): each tensor
an op reads or writes moves its unique elements once (a broadcast operand is read once), in
whole 32-byte sectors when its innermost dim is strided. Views and metadata ops move
nothing; an allocation moves nothing until written; an in-place op reads and writes its
target (an overwrite such as ``fill_`` or ``copy_`` only writes it); an ``out=`` argument is
written, not read; a gather (``embedding``, ``index_select``, ``gather``) reads the rows it
takes, not its whole source.

A scatter writes the elements its index selects, whatever its value: one per element of the
index of ``scatter``, ``scatter_add``, ``scatter_reduce`` and ``put``; a slice of the other dims
per element of the index of ``index_add``, ``index_copy``, ``index_fill`` and ``index_reduce``;
for ``index_put`` (``x[rows] = 0.0``) the positions its index tensors select, broadcast together
(a boolean mask selects its True elements), times the dims they leave. It reads its index
once, its source for as many elements as it writes (a broadcast one once, a 0-d value once, a
Scalar value not at all), and, accumulating (``index_add``, ``scatter_add``, ``accumulate=True``,
a ``reduce``...), the elements it updates. ``masked_fill`` and ``masked_scatter`` are CUDA
elementwise passes: they read the mask and their whole target, keep the elements it does not
select and write all of them (``masked_scatter`` reads a source element per True element, after
a scan of the mask writing an int64 per element, which it reads back); ``index_put`` with one
boolean index and a one-element value (``x[mask] = 0.0``) is one too, as PyTorch runs it as
``masked_fill_``. The model counts a scatter's elements, not the 32-byte sectors that writes at
scattered positions read and write whole, nor the int64 indices ``nonzero`` makes of a boolean
index the other ``index_put`` calls take. An out-of-place scatter (``scatter``, ``index_put``,
``masked_fill``, ``slice_scatter``..., the forms functionalized, compiled and backward code
runs) first copies its whole input into its result: one more read of it and write of the result.
A mask's True elements are data: counted where the mask holds data (outside any dispatch mode;
on a GPU the count waits for the mask); a meta or fake tensor holds none, and all its elements
are counted, the bound. ``constant_pad_nd`` fills its whole result, then copies the input into
it; an out-of-place ``fill`` reads no input, as ``zeros_like`` reads none.

PyTorch's own batch norm in training reads its input twice (statistics, then normalizing;
its backward, computing the input's gradient, reads grad and input twice; cuDNN's is counted
as one pass); a convolution's backward reads grad_output once for each gradient it computes.
A matmul reads each operand once: the model ignores the re-reads its tiling may make, as it
ignores caches. fusedkit's own ops count as one op each, named after their kernel
(``fusedkit.add_relu``). Only shapes, strides and dtypes are read (and a mask's True elements,
where it has them), so it counts on any device, ``meta`` and fake tensors included.

Inside the counter fusedkit's calls go through their registered ops, so the counter sees
each as one op, backward kernels included (a gate's two gradients: ``fusedkit.silu_mul_grad``).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.module_tracker import ModuleTracker

from .errors import FusedkitError
from .registry import Traffic, tensor_read_bytes

__all__ = ["MemoryCounterMode", "op_traffic"]

#: Ops that allocate without writing: they move nothing.
ALLOCATING_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"})
#: Views without an alias annotation in their schema: they move nothing either.
UNANNOTATED_VIEWS = frozenset({"_unsafe_view", "_reshape_alias"})
#: Ops that read their tensor arguments' shapes only: they write their result.
SHAPE_ONLY_OPS = frozenset(
    {
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "fill",
    }
)
#: In-place ops that overwrite their target without reading it.
OVERWRITING_OPS = frozenset(
    {
        "fill_",
        "zero_",
        "copy_",
        "normal_",
        "uniform_",
        "random_",
        "exponential_",
        "bernoulli_",
        "geometric_",
        "log_normal_",
        "cauchy_",
    }
)
#: Gathers, by the name of their index argument: they read the indices and as many source
#: elements as they write.
GATHERING_OPS = {"embedding": "indices", "index_select": "index", "gather": "index", "index": "indices"}
#: Scatters, in place (``scatter_``) or not (``scatter``, ``scatter.out``), by what sizes the elements
#: they write (see :func:`_scatter_traffic`): ``"elements"``, one per element of ``index``;
#: ``"slices"``, a slice of the other dims per element of ``index`` along ``dim``; ``"indices"``,
#: the positions ``indices`` select times the dims they leave; ``"mask"``, every element of the
#: target (CUDA's ``masked_fill_`` and ``masked_scatter_`` are elementwise passes over it, keeping
#: the unselected elements); ``"source"``, the elements of the source (the view scatters).
SCATTERING_OPS = {
    "scatter": "elements",
    "scatter_add": "elements",
    "scatter_reduce": "elements",
    "put": "elements",
    "index_add": "slices",
    "index_copy": "slices",
    "index_fill": "slices",
    "index_reduce": "slices",
    "index_put": "indices",
    "_index_put_impl": "indices",
    "_unsafe_index_put": "indices",
    "masked_fill": "mask",
    "masked_scatter": "mask",
    "select_scatter": "source",
    "slice_scatter": "source",
    "diagonal_scatter": "source",
    "as_strided_scatter": "source",
}
#: A scatter's source argument: each has one of these (a Scalar ``value`` is read from no tensor).
SOURCE_ARGS = ("src", "source", "values", "value")
#: Scatters that read the elements they update (``index_put`` and ``put`` with ``accumulate``,
#: and ``scatter`` with a ``reduce``, too).
ACCUMULATING_OPS = frozenset({"scatter_add", "scatter_reduce", "index_add", "index_reduce"})
#: Batch norm forwards: in training, a pass for the batch statistics, then the normalizing
#: pass, each reading the input (the H200's DRAM reads of a ResNet-50 Bottleneck's: 2.0x the
#: input, cold caches). cuDNN's (``cudnn_batch_norm``: float32 in NCHW on a GPU) is not
#: measured and keeps one read.
BATCH_NORM_OPS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"})
#: The name of the whole-run row, as FlopCounterMode names it.
GLOBAL = "Global"
#: Bytes per unit of the table's figures.
MB = 1e6


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _bytes(tensors) -> int:
    """Bytes of the distinct tensors (one passed twice is read once)."""
    return sum(tensor_read_bytes(t) for t in {id(t): t for t in tensors}.values())


def op_name(func, args) -> str:
    """``aten.mm``; fusedkit's elementwise ops by their kernel: ``fusedkit.add_relu``."""
    packet = func.overloadpacket
    namespace = func.namespace
    if namespace == "fusedkit" and packet.__name__ in ("elementwise", "elementwise_out", "elementwise_pair") and args:
        return f"fusedkit.{args[1]}"  # (the kernel's name: the argument after the tensors)
    if namespace == "fusedkit" and packet.__name__ == "norm":
        return f"fusedkit.{args[4]}"  # (the norm's name: rms_norm, add_layer_norm...)
    if namespace == "fusedkit" and packet.__name__ == "norm_backward":
        return f"fusedkit.{args[6]}_grad"
    return f"{namespace}.{packet.__name__}"


def op_traffic(func, args: tuple, kwargs: dict, out) -> Traffic:
    """The modelled DRAM bytes ``func(*args, **kwargs)`` read and wrote, given its result ``out``
    (see the module's docstring for the rules)."""
    schema = func._schema
    name = func.overloadpacket.__name__
    if name in ALLOCATING_OPS or name in UNANNOTATED_VIEWS or torch.Tag.inplace_view in func.tags:
        return Traffic(0, 0)
    returns_new = [r.alias_info is None for r in schema.returns]
    bound = list(zip(schema.arguments, args)) + [(a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
    by_name = {a.name: v for a, v in bound}
    written_args = [(a, v) for a, v in bound if a.alias_info is not None and a.alias_info.is_write]
    if not written_args and not any(returns_new):
        return Traffic(0, 0)  # a view (or a no-op returning its input)
    results = out if len(schema.returns) > 1 else (out,)  # (one return may be a list: foreach ops)
    written = [t for value, new in zip(results, returns_new) if new for t in _tensors(value)]
    written += [t for _, v in written_args for t in _tensors(v)]
    if name in BATCH_NORM_OPS and not by_name.get("training"):
        # evaluation writes the output only: CUDA returns its statistics allocated, unwritten
        written = _tensors(results[0])
    if name in GATHERING_OPS:
        index = _tensors(by_name.get(GATHERING_OPS[name]))
        return Traffic(_bytes(index) + _bytes(written), _bytes(written))
    base = name.removesuffix("_")  # (an in-place scatter's rules are its out-of-place twin's)
    if base in SCATTERING_OPS:
        return _scatter_traffic(base, bound, by_name, written[0])
    if name in SHAPE_ONLY_OPS:
        # (``fill``'s value may be a 0-d tensor: read, as ``fill_`` reads it)
        return Traffic(_bytes(_tensors(by_name.get("value"))), _bytes(written))
    if name == "constant_pad_nd":
        return _pad_traffic(by_name["self"], by_name["pad"], written[0])
    passes = _multi_pass_read(name, by_name)
    if passes is not None:
        return Traffic(passes, _bytes(written))
    read = []
    for arg, value in bound:
        write = arg.alias_info is not None and arg.alias_info.is_write
        # (``out`` written only: fusedkit's elementwise_out takes it positionally, not as a kwarg-only out)
        if write and (arg.is_out or arg.name == "out" or name in OVERWRITING_OPS):
            continue
        read += _tensors(value)
    return Traffic(_bytes(read), _bytes(written))


def _scatter_traffic(base: str, bound: list, by_name: dict, target: torch.Tensor) -> Traffic:
    """The bytes a scatter (``SCATTERING_OPS``) moves writing into ``target``: ``self`` in place,
    else its result, which it first fills with a copy of ``self``."""
    self = by_name["self"]
    names = [n for n in SOURCE_ARGS if n in by_name]
    source = by_name[names[0]] if names else None
    source = source if isinstance(source, torch.Tensor) else None  # (a Scalar value: no tensor to read)
    # the index or mask, read once: every tensor argument but the target, the copied input and the source
    others = [t for a, v in bound if a.name not in ("self", "out", *names) for t in _tensors(v)]
    kind = SCATTERING_OPS[base]
    accumulating = base in ACCUMULATING_OPS or bool(by_name.get("accumulate")) or by_name.get("reduce") is not None
    if kind == "indices" and _runs_as_masked_fill(by_name["indices"], source, accumulating):
        kind = "mask"
    passes = Traffic(0, 0)  # what runs before the scatter itself
    if kind == "mask":
        # an elementwise pass over the target, keeping what the mask does not select
        written = taken = target.numel()  # (masked_fill's value: one element, read once)
        if base == "masked_scatter":  # the source's elements, in order, one per selected element
            mask = by_name["mask"]
            taken = _selected(mask) * (written // mask.numel()) if mask.numel() else 0
            # CUDA's finds each one's source element with an exclusive scan of the mask first: it
            # reads the mask and writes an int64 per target element, which the pass reads back
            prefix = 8 * written
            passes = Traffic(tensor_read_bytes(mask), prefix) + Traffic(prefix, 0)
    elif kind == "elements":
        written = taken = by_name["index"].numel()
    elif kind == "slices":
        dim = by_name["dim"] % max(target.dim(), 1)
        written = taken = by_name["index"].numel() * math.prod(s for d, s in enumerate(target.shape) if d != dim)
    elif kind == "indices":
        written = taken = _index_put_elements(target, by_name["indices"])
    else:
        written = taken = source.numel()
    read = _bytes(others) + (min(tensor_read_bytes(source), taken * source.element_size()) if source is not None else 0)
    if kind == "mask":
        traffic = Traffic(read + tensor_read_bytes(target), tensor_read_bytes(target))
    else:
        touched = written * target.element_size()
        traffic = Traffic(read + (touched if accumulating else 0), touched)
    if target is not self:
        passes = passes + Traffic(tensor_read_bytes(self), tensor_read_bytes(target))  # the copy of self
    return passes + traffic


def _runs_as_masked_fill(indices, source, accumulating: bool) -> bool:
    """Whether PyTorch runs an ``index_put_`` as ``masked_fill_``: one boolean index (the others
    None) and a one-element value, as ``x[mask] = 0.0``. (PyTorch also wants the value on the CPU,
    where ``x[mask] = 0.0`` puts it for a GPU tensor; the model does not ask where it is.)"""
    given = [i for i in indices if i is not None]
    return (
        not accumulating
        and source is not None
        and source.numel() == 1
        and len(given) == 1
        and given[0].dtype in (torch.bool, torch.uint8)
    )


def _index_put_elements(target: torch.Tensor, indices) -> int:
    """Elements an ``index_put_`` writes: the positions its index tensors select, broadcast
    together (a boolean mask's True elements, in a dim of their own), times the dims they leave."""
    shapes, left, dim = [], 1, 0
    for index in indices:
        if index is None:
            left *= target.shape[dim]
            dim += 1
        elif index.dtype in (torch.bool, torch.uint8):
            shapes.append((_selected(index),))
            dim += index.dim()
        else:
            shapes.append(tuple(index.shape))
            dim += 1
    return math.prod(torch.broadcast_shapes(*shapes)) * left * math.prod(target.shape[dim:])


def _selected(mask: torch.Tensor) -> int:
    """The True elements of a boolean mask, counted where it holds data; a meta or fake tensor (or
    another subclass) holds none, and all of its elements are counted: the bound."""
    if mask.device.type == "meta" or type(mask) is not torch.Tensor:
        return mask.numel()
    # Outside every dispatch mode, so neither this counter nor one beneath it sees the count. On
    # a GPU, reading it back waits for the mask.
    with torch._C._DisableTorchDispatch():
        return int(torch.count_nonzero(mask))


def _pad_traffic(self: torch.Tensor, pad, result: torch.Tensor) -> Traffic:
    """``constant_pad_nd``: where any pad is positive it fills its whole result, then copies into
    it the part of ``self`` the negative pads leave; else it copies that part alone."""
    kept = list(self.shape)
    for i in range(len(pad) // 2):
        kept[-1 - i] -= max(-pad[2 * i], 0) + max(-pad[2 * i + 1], 0)
    copied = math.prod(max(k, 0) for k in kept) * self.element_size()
    filled = tensor_read_bytes(result) if any(p > 0 for p in pad) else 0
    return Traffic(min(tensor_read_bytes(self), copied), filled + copied)


def _multi_pass_read(name: str, by_name: dict) -> int | None:
    """The bytes read by an op whose algorithm passes over some arguments more than once, or
    None (every argument read once)."""

    def size(*names):
        return sum(_bytes(_tensors(by_name.get(n))) for n in names)

    if name in BATCH_NORM_OPS and by_name.get("training"):
        # the batch statistics, then the normalizing pass
        return 2 * size("input") + size("weight", "bias", "running_mean", "running_var")
    if name == "native_batch_norm_backward" and by_name.get("train") and by_name["output_mask"][0]:
        # the reduction the input's gradient needs, then the elementwise pass: both read both
        return 2 * size("grad_out", "input") + size("weight", "running_mean", "running_var", "save_mean", "save_invstd")
    if name == "convolution_backward":
        # each gradient its own kernel reading grad_output; the input's reads the weight, the
        # weight's the input
        grad_input, grad_weight, grad_bias = by_name["output_mask"]
        return (
            (grad_input + grad_weight + grad_bias) * size("grad_output")
            + grad_input * size("weight")
            + grad_weight * size("input")
        )
    return None


class _Counting(TorchDispatchMode):
    """The dispatch mode: runs each op, then hands it to the counter."""

    def __init__(self, counter: MemoryCounterMode):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter._count(func, args, kwargs, out)
        return out


class MemoryCounterMode:
    """Counts the modelled DRAM bytes read and written by every aten op run inside it, per
    op and per module (by qualified name, as ``FlopCounterMode`` shows them), split into
    forward and backward.

    Args:
        module: accepted for ``FlopCounterMode``'s signature; not needed (modules are found
            as they run).
        depth: how many levels of modules :meth:`get_table` shows by default.
        display: print the table on leaving the context.
    """

    def __init__(self, module: torch.nn.Module | None = None, depth: int = 2, display: bool = True):
        self.depth = depth
        self.display = display
        #: counts[module][op] = [forward Traffic, backward Traffic]
        self._counts: dict = defaultdict(lambda: defaultdict(lambda: [Traffic(0, 0), Traffic(0, 0)]))
        self._tracker = None
        self._mode = None
        #: Ops whose tensors the byte model could not size (a jagged nested tensor), by name: how
        #: many calls went uncounted.
        self.uncounted: dict[str, int] = defaultdict(int)

    def __enter__(self) -> MemoryCounterMode:
        if self._mode is not None:
            raise FusedkitError("MemoryCounterMode: this counter is counting already (use another one to nest)")
        self._counts.clear()
        self.uncounted.clear()
        self._tracker = ModuleTracker()
        self._tracker.__enter__()
        self._mode = _Counting(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._tracker.__exit__(*exc)
        self._mode = None
        if self.display and exc[0] is None:
            print(self.get_table())

    def _count(self, func, args, kwargs, out) -> None:
        name = op_name(func, args)
        try:
            traffic = op_traffic(func, args, kwargs, out)
        except Exception:
            self.uncounted[name] += 1
            return
        if traffic.total == 0:
            return
        phase = 1 if self._tracker.is_bw else 0
        for module in set(self._tracker.parents):
            cell = self._counts[module][name]
            cell[phase] = cell[phase] + traffic

    # --- Results --------------------------------------------------------------------------

    def get_total_bytes(self) -> int:
        """Bytes read plus bytes written by every op, forward and backward."""
        return sum(f.total + b.total for f, b in self._counts[GLOBAL].values())

    def get_bytes_by_op(self) -> dict[str, int]:
        """Bytes read plus written per op (``aten.mm``, ``fusedkit.add_relu``), forward and backward."""
        return {op: f.total + b.total for op, (f, b) in self._counts[GLOBAL].items()}

    def get_traffic_by_module(self) -> dict[str, dict[str, tuple[Traffic, Traffic]]]:
        """Per module (``Global`` for the whole run), per op: (forward, backward) Traffic, each
        with ``read`` and ``written`` bytes."""
        return {m: {op: tuple(cell) for op, cell in ops.items()} for m, ops in self._counts.items()}

    def get_table(self, depth: int | None = None) -> str:
        """The counts as a text table: each module to ``depth`` levels (``Global`` is level 0),
        and under each the ops by bytes moved, in MB (10^6 bytes)."""
        depth = self.depth if depth is None else depth
        depth = float("inf") if depth is None else depth  # (None: every level, as FlopCounterMode)
        total = self.get_total_bytes()
        modules = sorted((m for m in self._counts if m == GLOBAL or m.count(".") < depth), key=_module_order)
        labels = [_level(m) + len(m) for m in modules]
        labels += [_level(m) + 3 + len(op) for m in modules for op in self._counts[m]]
        width = max([len("Module"), *labels])
        head = (
            f"{'Module':<{width}} {'read MB':>10} {'written MB':>10} {'forward MB':>10} {'backward MB':>11} "
            f"{'% total':>7}"
        )
        lines = [head, "-" * len(head)]
        for m in modules:
            ops = self._counts[m]
            lines.append(_row(" " * _level(m) + m, ops.values(), total, width))
            for op, cell in sorted(ops.items(), key=lambda kv: -(kv[1][0].total + kv[1][1].total)):
                lines.append(_row(" " * _level(m) + " - " + op, [cell], total, width))
        return "\n".join(lines)


def _level(module: str) -> int:
    return 0 if module == GLOBAL else module.count(".") + 1


def _module_order(module: str):
    return (module != GLOBAL, module)


def _row(label: str, cells, total: int, width: int) -> str:
    forward = sum((c[0] for c in cells), Traffic(0, 0))
    backward = sum((c[1] for c in cells), Traffic(0, 0))
    both = forward + backward
    share = both.total / total if total else 0.0
    return (
        f"{label:<{width}} {both.read / MB:>10.3f} {both.written / MB:>10.3f} {forward.total / MB:>10.3f} "
        f"{backward.total / MB:>11.3f} {share:>7.1%}"
    )
