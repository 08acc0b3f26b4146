"""The elementwise kernel registry: the single source of truth.

Every fused elementwise op is an :class:`ElementwiseKernel`: its math (a small
``@triton.jit`` function), its PyTorch reference (the unfused composition it
replaces), the dtypes it takes and its byte model. One generic launcher
(:mod:`fusedkit.runtime.elementwise`) runs any entry; tests, benchmarks and the docs'
op table enumerate the registry, so a new entry gets all three.

Register your own::

    import torch, triton, fusedkit
    import triton.language as tl  # jit functions need it in their module
    from fusedkit.kernels.activations import relu

    @triton.jit
    def sub_relu_math(x, y):
        return relu(x - y)

    fusedkit.registry.register(fusedkit.registry.ElementwiseKernel(
        name="sub_relu", math=sub_relu_math,
        reference=lambda x, y: torch.relu(torch.sub(x, y)),
        param=None, formula="relu(x - y)", unfused=("torch.sub", "torch.relu")))
    fusedkit.elementwise("sub_relu", a, b)
"""

from __future__ import annotations

import dataclasses
import inspect
import math as _math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from triton.runtime import KernelInterface

from .errors import ArgumentError, DTypeError, UnknownKernelError

__all__ = [
    "ElementwiseKernel",
    "Traffic",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "OPERAND_DTYPES",
    "SUPPORTED_DTYPES",
    "register",
    "unregister",
    "get",
    "kernels",
    "names",
    "on_change",
    "RowKernel",
    "register_row",
    "row_kernel",
    "row_kernels",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)
#: Every dtype the generic launcher can load, compute in and store: what an entry's ``dtypes``
#: (its result dtypes) are drawn from.
SUPPORTED_DTYPES = FLOAT_DTYPES + INT_DTYPES
#: What an operand may be besides: the launcher loads it and converts it to the result dtype as
#: torch promotes it (``silu_mul(a_f32, mask_bool)`` is float32), whatever the entry's ``dtypes``.
OPERAND_DTYPES = SUPPORTED_DTYPES + (torch.bool, torch.uint8, torch.int8, torch.int16)
#: Smallest unit of DRAM traffic on NVIDIA GPUs: a strided read still moves whole sectors.
SECTOR_BYTES = 32
#: Arity range the generic kernel has operand slots for.
MAX_ARITY = 3
#: What a kernel may keep for its backward pass: nothing, its result, its operands, or the
#: intermediate its math applies its last step to (``pre``: see :class:`ElementwiseKernel`).
SAVES = ("none", "output", "inputs", "pre")
#: Keywords of :func:`fusedkit.elementwise` itself, which a kernel's ``param`` cannot be.
RESERVED_NAMES = ("kernel", "out")


@dataclass(frozen=True)
class Traffic:
    """Bytes a run moves through device memory: read and written."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.read + other.read, self.written + other.written)


def tensor_read_bytes(t: torch.Tensor) -> int:
    """Bytes that reading every element of ``t`` once moves.

    Counts unique elements (a broadcast operand is read once, its reuse served by
    the cache) and whole 32-byte sectors when the fastest dim is strided: a slice
    ``x[:, ::2]`` of fp32 moves the skipped elements too.
    """
    if t.numel() == 0:
        return 0
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n > 1 and s != 0]
    unique = _math.prod(n for n, _ in dims) if dims else 1
    inner = min((s for _, s in dims), default=1)
    per_element = min(inner * t.element_size(), max(SECTOR_BYTES, t.element_size()))
    return unique * per_element


def _result_bytes(shape, dtype) -> int:
    return _math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class ElementwiseKernel:
    """One fused elementwise op, described once.

    Attributes:
        name: a Python identifier, unique in the registry.
        math: ``@triton.jit`` function of ``arity`` compute-dtype values (plus the
            scalar ``param`` when there is one), returning the result. Pure math:
            no loads, stores or casts.
        reference: the unfused PyTorch composition with the same signature as the
            public op's positional operands plus the param, e.g. ``(x, y, alpha)``.
        arg_names: names of the operands, used in error messages.
        dtypes: result dtypes the op accepts (``torch.result_type`` of the operands). An operand
            may have any dtype in :data:`OPERAND_DTYPES` that promotes to one of them, as in
            torch: it is converted to the result dtype as torch converts it.
        param: name of the single scalar keyword parameter, or ``None``; neither an
            operand's name nor a keyword of :func:`fusedkit.elementwise` (``RESERVED_NAMES``).
        param_default: its default value.
        formula: human-readable formula for the docs.
        unfused: the eager ops the reference launches; each one after the first
            writes and re-reads an intermediate of the output's size.
        saves: what autograd keeps for ``backward``: "none", "output", "inputs" or "pre".
            "pre" is for math of the form ``f(pre(operands))`` where torch would keep the
            intermediate ``pre`` (``gelu(x + alpha * y)`` keeps the sum, as ``F.gelu``
            does): a call that needs a gradient writes ``pre`` beside the result in one
            launch (``forward_pair``) and keeps it, so an operand changed in place afterwards
            (``x += add_gelu(x, pos)``) does not invalidate the backward.
        backward: ``backward(grad, saved, param) -> grads``, one per operand (None
            where no gradient flows), each of the output's shape; ``saved`` is the
            output, the tuple of operands (None in the place of an operand that no
            requested gradient ``needs``) or None, per ``saves``. With ``saves="pre"``:
            ``backward(grad, pre, param) -> grad_pre``, the gradient of ``pre``, which
            ``pre``'s own backward turns into the operands'. It should compute with
            fusedkit kernels. None: the kernel is not differentiable.
        needs: with ``saves="inputs"``, per operand the operands (their indices) its
            gradient reads: a call keeps only those that its requested gradients need
            (``silu_mul(a, w)`` with only ``w`` requiring grad keeps ``a``), so an operand no
            gradient reads may be an inference tensor or change in place afterwards, as in
            torch. None: every gradient reads every operand.
        pre: with ``saves="pre"``, the registered entry that computes ``pre`` from the
            operands and the parameter (``add`` for ``gelu(x + alpha * y)``); it saves
            nothing and its backward gives the operands' gradients from ``pre``'s.
        forward_pair: with ``saves="pre"``, the two-output kernel computing
            ``(result, pre)`` in one pass, ``pre`` rounded to the result dtype as ``pre``'s
            entry rounds it.
        outputs: 1, or 2 for a kernel whose math returns a pair (a backward giving two
            gradients from one read of its inputs; run by
            :func:`fusedkit.runtime.elementwise.run_pair`, never registered).
        backward_kernels: optional ``backward_kernels(param) -> steps | None``, one step
            per operand: ``(kernel, param)`` or ``(kernel, param, result)`` when that
            operand's gradient is ``kernel`` (a registered kernel or its name, or a
            two-output kernel given to :func:`fusedkit.autograd.register_pair`) on
            ``(grad, *saved)`` with that parameter, taking its result
            ``result`` (0, or 1: a two-output kernel's second); None when the operand gets
            no gradient. Steps that differ only in ``result`` share one launch. The same
            gradients as ``backward``, before the reduction of a broadcast operand's
            gradient to its shape and the cast to its dtype (autograd makes both), stated
            so that a repeated call's autograd node launches them from C++ without
            Python; None for a parameter no such plan serves (the Python ``backward``
            runs). Needs ``saves`` "output" or "inputs".

    Each field's type is checked when the entry is made (``DTypeError``, its value:
    ``ArgumentError``); a list given for a tuple field is stored as a tuple.
    """

    name: str
    math: KernelInterface
    reference: Callable[..., torch.Tensor]
    arg_names: tuple[str, ...] = ("x", "y")
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
    param: str | None = "alpha"
    param_default: float | int = 1
    formula: str = ""
    unfused: tuple[str, ...] = field(default=())
    saves: str = "none"
    backward: Callable[..., tuple] | None = None
    backward_kernels: Callable[..., tuple] | None = None
    outputs: int = 1
    needs: tuple[tuple[int, ...], ...] | None = None
    pre: ElementwiseKernel | None = None
    forward_pair: ElementwiseKernel | None = None

    def __post_init__(self) -> None:
        # Every field's type first: a wrong one must not pass as another value (a str where a
        # tuple is meant counts its characters) nor fail later in a plain TypeError.
        if not isinstance(self.name, str):
            raise DTypeError(f"kernel name must be a str, got {_shown(self.name)}")
        if not self.name.isidentifier():
            raise ArgumentError(f"kernel name must be a Python identifier, got {self.name!r}")
        if not isinstance(self.math, KernelInterface):
            raise DTypeError(f"{self.name}: math must be a @triton.jit function, got {type(self.math).__name__}")
        if not callable(self.reference):
            raise DTypeError(f"{self.name}: reference must be callable")
        self._tuple_field("arg_names", "operand names", str)
        if not 1 <= len(self.arg_names) <= MAX_ARITY:
            raise ArgumentError(f"{self.name}: arity must be 1..{MAX_ARITY}, got {len(self.arg_names)}")
        if len(set(self.arg_names)) != len(self.arg_names) or not all(a.isidentifier() for a in self.arg_names):
            raise ArgumentError(f"{self.name}: arg_names must be distinct identifiers, got {self.arg_names}")
        self._tuple_field("dtypes", "torch dtypes", torch.dtype)
        bad = [d for d in self.dtypes if d not in SUPPORTED_DTYPES]
        if not self.dtypes or bad:
            raise ArgumentError(f"{self.name}: dtypes must be a non-empty subset of {SUPPORTED_DTYPES}, got {bad}")
        self._check_param()
        if not isinstance(self.formula, str):
            raise DTypeError(f"{self.name}: formula must be a str, got {_shown(self.formula)}")
        n_math = len(inspect.signature(self.math.fn).parameters)
        expected = self.arity + (self.param is not None)
        if n_math != expected:
            raise ArgumentError(
                f"{self.name}: math takes {n_math} arguments, expected {expected} "
                f"(the operands{' and ' + self.param if self.param else ''})"
            )
        self._tuple_field("unfused", "op names", str)
        if not self.unfused or not all(self.unfused):
            raise ArgumentError(f"{self.name}: unfused must name the eager ops of the reference, got {self.unfused}")
        if not isinstance(self.saves, str):
            raise DTypeError(f"{self.name}: saves must be a str, one of {SAVES}, got {_shown(self.saves)}")
        if self.saves not in SAVES:
            raise ArgumentError(f"{self.name}: saves must be one of {SAVES}, got {self.saves!r}")
        if self.backward is not None and not callable(self.backward):
            raise DTypeError(f"{self.name}: backward must be callable or None")
        if self.backward_kernels is not None and not callable(self.backward_kernels):
            raise DTypeError(f"{self.name}: backward_kernels must be callable or None")
        if type(self.outputs) is not int:  # (not a bool: True would count as one output)
            raise DTypeError(f"{self.name}: outputs must be an int, 1 or 2, got {_shown(self.outputs)}")
        if self.outputs not in (1, 2):
            raise ArgumentError(f"{self.name}: outputs must be 1 or 2, got {self.outputs!r}")
        if self.outputs == 2 and (self.backward is not None or self.saves != "none"):
            raise ArgumentError(
                f"{self.name}: a two-output kernel runs outside autograd (a backward's, or a forward_pair): "
                "it takes no backward and saves nothing"
            )
        if self.backward_kernels is not None and (self.backward is None or self.saves not in ("output", "inputs")):
            raise ArgumentError(
                f"{self.name}: backward_kernels states a backward on what the call saves: it needs "
                "backward and saves='output' or 'inputs'"
            )
        self._check_saving()

    def _check_saving(self) -> None:
        """``needs`` fits ``saves="inputs"`` and the operands; ``pre`` and ``forward_pair``
        come with ``saves="pre"`` and take this entry's operands and parameter."""
        if self.needs is not None:
            if self.saves != "inputs":
                raise ArgumentError(
                    f"{self.name}: needs says which saved operands each gradient reads: it needs saves='inputs'"
                )
            if not (
                isinstance(self.needs, tuple)
                and len(self.needs) == self.arity
                and all(
                    isinstance(n, tuple) and all(type(i) is int and 0 <= i < self.arity for i in n) for n in self.needs
                )
            ):
                raise ArgumentError(
                    f"{self.name}: needs must be a tuple of {self.arity} tuples of operand "
                    f"indices (0..{self.arity - 1}), got {self.needs!r}"
                )
        parts = {"pre": self.pre, "forward_pair": self.forward_pair}
        if self.saves != "pre":
            if any(p is not None for p in parts.values()):
                raise ArgumentError(f"{self.name}: pre and forward_pair come with saves='pre'")
            return
        if self.backward is None:
            raise ArgumentError(f"{self.name}: saves='pre' keeps pre for a backward: give backward")
        for field_name, part in parts.items():
            if not isinstance(part, ElementwiseKernel):
                raise DTypeError(
                    f"{self.name}: saves='pre' needs {field_name}, an ElementwiseKernel; got {type(part).__name__}"
                )
            if part.arg_names != self.arg_names or part.param != self.param:
                raise ArgumentError(
                    f"{self.name}: {field_name} must take this entry's operands "
                    f"{self.arg_names} and parameter {self.param!r}"
                )
        if self.forward_pair.outputs != 2 or self.forward_pair.dtypes != self.dtypes:
            raise ArgumentError(f"{self.name}: forward_pair must be a two-output kernel of this entry's dtypes")
        if self.pre.outputs != 1 or self.pre.saves != "none" or self.pre.backward is None:
            raise ArgumentError(
                f"{self.name}: pre must be a one-output entry that saves nothing and has a backward "
                "(its backward turns pre's gradient into the operands')"
            )

    def _tuple_field(self, field: str, what: str, item: type) -> None:
        """Check that ``field`` is a tuple (a list is taken as one) of ``item``; the dataclass is
        frozen and hashed, so a list is stored as a tuple."""
        value = getattr(self, field)
        if not isinstance(value, (tuple, list)):
            raise DTypeError(f"{self.name}: {field} must be a tuple of {what}, got {_shown(value)}")
        wrong = [v for v in value if not isinstance(v, item)]
        if wrong:
            raise DTypeError(f"{self.name}: {field} must be a tuple of {what}, got {_shown(wrong[0])} in it")
        object.__setattr__(self, field, tuple(value))

    def _check_param(self) -> None:
        """``param``: None, or an identifier the public call can take as its keyword;
        ``param_default``: a real number, as the call's check of the parameter takes it."""
        if self.param is not None:
            if not isinstance(self.param, str):
                raise DTypeError(f"{self.name}: param must be a str or None, got {_shown(self.param)}")
            if not self.param.isidentifier():
                raise ArgumentError(f"{self.name}: param must be an identifier or None, got {self.param!r}")
            if self.param in RESERVED_NAMES or self.param in self.arg_names:
                raise ArgumentError(
                    f"{self.name}: param {self.param!r} is a name the call reserves: fusedkit.elementwise's "
                    f"own keywords ({', '.join(RESERVED_NAMES)}) and the operand names ({', '.join(self.arg_names)})"
                )
        if isinstance(self.param_default, bool) or not isinstance(self.param_default, numbers.Real):
            raise DTypeError(f"{self.name}: param_default must be a real number, got {_shown(self.param_default)}")

    @property
    def arity(self) -> int:
        return len(self.arg_names)

    @property
    def intermediates(self) -> int:
        """Tensors of the output's size that the unfused run writes and reads back."""
        return len(self.unfused) - 1

    def bytes_fused(self, *operands, out_dtype: torch.dtype | None = None) -> Traffic:
        """Modelled DRAM traffic of the fused kernel on these operands."""
        shape, dtype = _out_shape_dtype(operands, out_dtype)
        read = sum(tensor_read_bytes(t) for t in operands if isinstance(t, torch.Tensor))
        return Traffic(read, _result_bytes(shape, dtype))

    def bytes_unfused(self, *operands, out_dtype: torch.dtype | None = None) -> Traffic:
        """Modelled DRAM traffic of the eager composition: the fused bytes plus one
        write and one read of each intermediate."""
        shape, dtype = _out_shape_dtype(operands, out_dtype)
        extra = self.intermediates * _result_bytes(shape, dtype)
        return self.bytes_fused(*operands, out_dtype=out_dtype) + Traffic(extra, extra)


def _shown(value) -> str:
    """A wrong value as an error shows it: its type and repr."""
    return f"{type(value).__name__} {value!r}"


def _out_shape_dtype(operands, out_dtype):
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if out_dtype is None:
        out_dtype = result_dtype(operands)
    return shape, out_dtype


def number_kind(v):
    """A number (traced as a symbol or not) as a constant Python number of its kind: what its
    dtype promotes as (Dynamo traces ``elementwise_dtypes`` on constants only)."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (bool, torch.SymBool)):
        return True
    if isinstance(v, (int, torch.SymInt)):
        return 1
    if isinstance(v, (float, torch.SymFloat)):
        return 1.0
    return v


def result_dtype(operands) -> torch.dtype:
    """PyTorch's result dtype for an elementwise op on ``operands`` (tensors and numbers)."""
    if torch.compiler.is_compiling():
        return _traced_result_dtype(operands)
    if len(operands) == 2:
        return torch.result_type(*operands)
    return elementwise_dtypes(*operands, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def _traced_result_dtype(operands) -> torch.dtype:
    """:func:`result_dtype` as Dynamo traces it: c10's ``result_type`` over the operands' dtypes
    and ranks, constants while tracing, through ``torch.promote_types`` alone (Dynamo folds it;
    torch 2.11's Dynamo refused ``elementwise_dtypes``'s tuple of dtypes). Tensors of one or more
    dims decide first, then 0-d tensors, then numbers (a float number as the default dtype),
    each only where it is of a higher category (bool, integer, floating, complex)."""
    dims = zeros = numbers = None
    for v in operands:
        if isinstance(v, torch.Tensor):
            if v.dim() > 0:
                dims = v.dtype if dims is None else torch.promote_types(dims, v.dtype)
            else:
                zeros = v.dtype if zeros is None else torch.promote_types(zeros, v.dtype)
            continue
        v = number_kind(v)
        if isinstance(v, bool):
            kind = torch.bool
        elif isinstance(v, int):
            kind = torch.int64
        elif isinstance(v, complex):
            kind = _COMPLEX_OF.get(torch.get_default_dtype(), torch.complex64)  # (the default complex dtype)
        else:
            kind = torch.get_default_dtype()
        numbers = kind if numbers is None else torch.promote_types(numbers, kind)
    return _combine_categories(dims, _combine_categories(zeros, numbers))


_COMPLEX_OF = {
    torch.float16: torch.complex32,
    torch.bfloat16: torch.complex64,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


def _combine_categories(higher, lower):
    """c10's ``combine_categories``: ``lower`` counts only where its category is higher."""
    if higher is None:
        return lower
    if lower is None or higher.is_complex:
        return higher
    if lower.is_complex:
        return _COMPLEX_OF.get(higher, lower) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


_REGISTRY: dict[str, ElementwiseKernel] = {}
#: Names of the kernels fusedkit itself registers (:mod:`fusedkit.library`): they can be
#: neither replaced nor removed, since fusedkit's own gradients hold those kernel objects.
BUILTIN_NAMES: set[str] = set()


def register(kernel: ElementwiseKernel, *, replace: bool = False) -> ElementwiseKernel:
    """Add ``kernel`` to the registry; returns it. Refuses a taken name unless ``replace``,
    and a built-in name always."""
    if not isinstance(kernel, ElementwiseKernel):
        raise DTypeError(f"register() takes an ElementwiseKernel, got {type(kernel).__name__}")
    if kernel.outputs != 1:
        raise ArgumentError(
            f"{kernel.name!r} has {kernel.outputs} outputs; the registry's ops return one tensor "
            "(run a two-output kernel with fusedkit.runtime.elementwise.run_pair)"
        )
    if kernel.name in BUILTIN_NAMES:
        raise ArgumentError(
            f"{kernel.name!r} is a built-in kernel and cannot be replaced; register yours under another name"
        )
    if kernel.name in _REGISTRY and not replace:
        raise ArgumentError(f"an elementwise kernel named {kernel.name!r} is already registered")
    replaced = _REGISTRY.get(kernel.name)
    _REGISTRY[kernel.name] = kernel
    if replaced is not None and replaced is not kernel:
        _changed()
    return kernel


def register_builtin(kernel: ElementwiseKernel) -> ElementwiseKernel:
    """Register one of fusedkit's own kernels, fixed from then on."""
    register(kernel)
    BUILTIN_NAMES.add(kernel.name)
    return kernel


def unregister(name: str) -> None:
    """Remove a kernel you registered (the built-in ones are refused)."""
    if name in BUILTIN_NAMES:
        raise ArgumentError(f"{name!r} is built in and cannot be unregistered")
    get(name)  # an unknown name raises UnknownKernelError
    del _REGISTRY[name]
    _changed()


#: What runs when a registered kernel is replaced or removed (layers above the registry that
#: hold what they learned from it: the C++ launch table's autograd nodes).
_LISTENERS: list = []


def on_change(listener) -> None:
    """Call ``listener()`` whenever a registered kernel is replaced or unregistered."""
    _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


def get(name: str) -> ElementwiseKernel:
    """The kernel registered under ``name``."""
    if not isinstance(name, str):
        raise DTypeError(f"a kernel is named by a str or given as an ElementwiseKernel, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownKernelError(f"no elementwise kernel named {name!r}; registered: {sorted(_REGISTRY)}") from None


def kernels() -> Iterator[ElementwiseKernel]:
    """Every registered kernel, in registration order."""
    return iter(tuple(_REGISTRY.values()))


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# --- Row reductions: the norms ---------------------------------------------------------


@dataclass(frozen=True)
class RowKernel:
    """One normalisation over rows (the trailing dims), described once: fusedkit's own
    ``rms_norm``, ``layer_norm``, ``add_rms_norm`` and ``add_layer_norm`` (one kernel
    family, :mod:`fusedkit.kernels.norm`). Tests, benchmarks and the docs' norm table
    enumerate :func:`row_kernels`.

    Attributes:
        name: the public op, ``fusedkit.<name>``.
        rms: RMS statistics (no mean, no bias); else LayerNorm's.
        residual: ``h = x + alpha * residual`` first, returned beside the output.
        formula: for the docs.
        reference: PyTorch's composition, ``reference(x, residual, weight, bias, eps, alpha,
            normalized_shape) -> (y, h or None)``: float64 runs it, compiled code traces it.
        unfused: the eager ops it replaces.
        dtypes: input dtypes the kernels take (float64 runs ``reference``).
    """

    name: str
    rms: bool
    residual: bool
    formula: str
    reference: Callable
    unfused: tuple[str, ...]
    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)

    def bytes_fused(self, rows: int, n: int, dtype: torch.dtype, param_dtype: torch.dtype = torch.float32) -> Traffic:
        """One forward's bytes: x (and residual) read, the output (and h) written, the
        parameters read once, one (LayerNorm: two) float32 statistics a row written (those
        autograd keeps)."""
        inputs = 2 if self.residual else 1
        params, stats = self._side_bytes(rows, n, param_dtype)
        return Traffic(inputs * rows * n * dtype.itemsize + params, inputs * rows * n * dtype.itemsize + stats)

    def bytes_backward(
        self, rows: int, n: int, dtype: torch.dtype, param_dtype: torch.dtype = torch.float32
    ) -> Traffic:
        """One backward's compulsory bytes: the output's gradient, the saved input (h) and its
        statistics read (add + norm: the gradient reaching h too), the weight read; the
        input's gradient written (add + norm: one, both inputs' gradient) and the parameters'
        gradients. The per-program partial sums of those are left out: a few rows each."""
        grads_in = 3 if self.residual else 2
        params, stats = self._side_bytes(rows, n, param_dtype)
        return Traffic(
            grads_in * rows * n * dtype.itemsize + stats + n * param_dtype.itemsize, rows * n * dtype.itemsize + params
        )

    def _side_bytes(self, rows: int, n: int, param_dtype: torch.dtype) -> tuple[int, int]:
        """The parameters' bytes (weight, and LayerNorm's bias) and the float32 statistics'
        (one a row, LayerNorm's two)."""
        per = 1 if self.rms else 2
        return per * n * param_dtype.itemsize, rows * per * 4

    def bytes_unfused(self, rows: int, n: int, dtype: torch.dtype, param_dtype: torch.dtype = torch.float32) -> Traffic:
        """The same in eager PyTorch: the add writes h and the norm (one kernel, torch's own)
        reads it back."""
        norm = dataclasses.replace(self, residual=False).bytes_fused(rows, n, dtype, param_dtype)
        if not self.residual:
            return norm
        add = Traffic(2 * rows * n * dtype.itemsize, rows * n * dtype.itemsize)
        return add + norm


_ROWS: dict[str, RowKernel] = {}


def register_row(kernel: RowKernel) -> RowKernel:
    """Add one of fusedkit's own norms (built in: the family has no user extension point)."""
    if not isinstance(kernel, RowKernel):
        raise DTypeError(f"register_row() takes a RowKernel, got {type(kernel).__name__}")
    if kernel.name in _ROWS:
        raise ArgumentError(f"a row kernel named {kernel.name!r} is already registered")
    _ROWS[kernel.name] = kernel
    return kernel


def row_kernel(name: str) -> RowKernel:
    """The norm registered under ``name``."""
    try:
        return _ROWS[name]
    except KeyError:
        raise UnknownKernelError(f"no row kernel named {name!r}; known: {', '.join(_ROWS)}") from None


def row_kernels() -> tuple[RowKernel, ...]:
    """Every norm, in registration order."""
    return tuple(_ROWS.values())
