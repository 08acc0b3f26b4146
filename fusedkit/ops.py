"""fusedkit's public ops: documented fronts over :mod:`fusedkit.dispatch`.

``add``, ``add_relu``, ``silu_mul``, ``gelu_mul`` and ``add_gelu`` are registry entries
(the last two pick theirs by ``approximate``); ``elementwise`` runs any entry; ``matmul``,
``matmul_relu`` and ``linear_relu`` are the matmul with a fused epilogue.
"""

from __future__ import annotations

import math

import torch

from . import dispatch, sharding
from .errors import ArgumentError, DTypeError, ShapeError, SignatureError
from .library import (
    ADD,
    ADD_GELU,
    ADD_GELU_TANH,
    ADD_LAYER_NORM,
    ADD_RELU,
    ADD_RMS_NORM,
    GELU_MUL,
    GELU_TANH_MUL,
    LAYER_NORM,
    RMS_NORM,
    SILU_MUL,
)
from .registry import ElementwiseKernel, get
from .runtime import matmul as mm
from .runtime.layout import broadcast_shape

__all__ = [
    "add",
    "add_gelu",
    "add_layer_norm",
    "add_relu",
    "add_rms_norm",
    "elementwise",
    "gelu_mul",
    "layer_norm",
    "linear_relu",
    "matmul",
    "matmul_relu",
    "gated_mlp",
    "mlp",
    "rms_norm",
    "silu_mul",
]

#: What an operand may be: a tensor, or a host number standing for a scalar.
Operand = torch.Tensor | float | int


def add(x: Operand, y: Operand, *, alpha: float | int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + alpha * y`` in one kernel; the same result as ``torch.add(x, y, alpha=alpha)``.

    Args:
        x: a tensor, or a Python number / 0-d tensor when ``y`` is a tensor. Any shape
            that broadcasts with ``y``; strided, transposed, sliced and broadcast views
            are read through their strides, never copied.
        y: the same, for the second operand.
        alpha: real number multiplying ``y``, in the compute dtype (float32 for half
            types); an integer when the result is integral.
        out: optional tensor of the result's shape and device, of any dtype the result
            casts to (``torch.can_cast``); it may be ``x`` or ``y`` itself (in place) but
            must not partially overlap a dense input. Its version counter is bumped.

    Returns:
        A tensor of the broadcast shape and ``torch.result_type(x, y)``: float16,
        bfloat16, float32, float64, int32 or int64. Half types compute in float32,
        ``x + alpha * y`` as one fused multiply-add. A new result has the strides
        torch's TensorIterator would give it.

    Raises:
        ShapeError: shapes that do not broadcast, or an ``out`` of the wrong shape.
        DTypeError: an unsupported or complex dtype, a non-tensor operand, a float
            ``alpha`` for an integral result, or an ``out`` dtype the result does not cast to.
        ArgumentError: an ``alpha`` torch refuses: beyond the range of the dtype torch converts it
            to, which is the result dtype on the CPU (fp16's 65504) and the compute dtype on
            CUDA (float32 for half types).
        DeviceError: operands (or ``out``) on different devices.
        OverlapError: an ``out`` that partially overlaps a dense input, or itself.
        FusedkitError: an inference tensor as ``out`` outside inference mode.

    All are ``FusedkitError`` subclasses (a ``RuntimeError``), raised before anything is
    launched or written.
    """
    return dispatch.elementwise(ADD, (x, y), alpha, out)


def add_relu(x: Operand, y: Operand, *, alpha: float | int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x + alpha * y)`` in one kernel: reads x and y once and writes once,
    where ``torch.relu(torch.add(x, y, alpha=alpha))`` also writes and re-reads the sum.

    Same arguments, shapes, dtypes and errors as :func:`add`. ``relu(NaN)`` is NaN
    and ``relu(-0.0)`` is ``-0.0``, as in PyTorch. ``out=x`` computes in place, as a
    residual join does.
    """
    return dispatch.elementwise(ADD_RELU, (x, y), alpha, out)


def silu_mul(a: Operand, b: Operand, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.silu(a) * b`` in one kernel, the SwiGLU gate of LLaMA-style MLPs: reads a and b once
    and writes once, where the eager composition also writes and re-reads ``silu(a)``.

    Shapes, dtypes (float16, bfloat16, float32, float64; half types compute in float32 and
    round once), broadcasting, strided views, ``out=`` and errors as :func:`add`.
    Differentiable: autograd keeps a and b, those the requested gradients read (no
    intermediate), and takes both gradients in one
    kernel.
    """
    return dispatch.elementwise(SILU_MUL, (a, b), None, out)


_GELU_MUL = {"none": GELU_MUL, "tanh": GELU_TANH_MUL}
_ADD_GELU = {"none": ADD_GELU, "tanh": ADD_GELU_TANH}


def _by_approximate(kernels: dict, approximate, op: str) -> ElementwiseKernel:
    """The entry for GELU's ``approximate``, "none" or "tanh" as ``F.gelu`` requires."""
    kernel = kernels.get(approximate) if isinstance(approximate, str) else None
    if kernel is None:
        raise ArgumentError(f"{op}(): approximate must be 'none' or 'tanh', got {approximate!r}")
    return kernel


def gelu_mul(a: Operand, b: Operand, *, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(a, approximate=approximate) * b`` in one kernel, the GeGLU gate; as
    :func:`silu_mul`. ``approximate``: "none" (erf) or "tanh"; anything else raises
    ``ArgumentError``, as ``F.gelu`` refuses it."""
    return dispatch.elementwise(_by_approximate(_GELU_MUL, approximate, "gelu_mul"), (a, b), None, out)


def add_gelu(
    x: Operand, y: Operand, *, alpha: float | int = 1, approximate: str = "none", out: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.gelu(torch.add(x, y, alpha=alpha), approximate=approximate)`` in one kernel: a bias
    or residual added before a GELU. Arguments and errors as :func:`add` (floating dtypes
    only) and :func:`gelu_mul`. Differentiable: autograd keeps the sum, as ``F.gelu`` keeps its
    input (the forward writes it beside the result in one launch), and takes
    the gradient in one kernel."""
    return dispatch.elementwise(_by_approximate(_ADD_GELU, approximate, "add_gelu"), (x, y), alpha, out)


def elementwise(kernel: ElementwiseKernel | str, *operands, out: torch.Tensor | None = None, **param):
    """Run a registered elementwise kernel: ``elementwise("add_relu", x, y, alpha=2)``.

    ``operands`` are tensors or real numbers that broadcast together; the result
    has their broadcast shape and PyTorch's promoted dtype. ``param`` is the
    kernel's one scalar keyword (e.g. ``alpha``), defaulting as registered.
    ``out`` receives the result when given (it may be one of the inputs).
    """
    if not isinstance(kernel, ElementwiseKernel):
        kernel = get(kernel)  # a name; anything else raises DTypeError
    if kernel.param is None:
        if param:
            raise SignatureError(f"{kernel.name}() takes no keyword {', '.join(param)}")
        value = None
    else:
        value = param.pop(kernel.param, kernel.param_default)  # ``param`` is this call's own dict
        if param:
            raise SignatureError(f"{kernel.name}() got unexpected keyword(s) {', '.join(sorted(param))}")
    return dispatch.elementwise(kernel, operands, value, out)


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """``act(a @ b + bias)`` in one kernel: bias and activation run on the accumulator.

    Args:
        a: (..., M, K), or (K,) for a (N,) result as ``torch.matmul`` gives. Leading dims are
            flattened, without a copy when the strides allow.
        b: (K, N), any strides (an ``nn.Linear`` weight's ``.t()`` is read as is).
        bias: optional (N,).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu".

    Returns:
        (..., M, N) in the inputs' dtype: float16, bfloat16, float32 (TF32 when
        PyTorch's matmul setting allows it; else as ``fusedkit.settings``' ``fp32_precision``
        says: three TF32 products each, with fp32-sized errors, or fp32 multiply-adds) or
        float64.
        Accumulates in fp32 (fp64 for float64). Differentiable in a, b and bias.

    Raises:
        ShapeError: ``a`` with fewer than 2 dims, ``b`` not 2-D, mismatched K, or a bias not (N,).
        DTypeError: a non-tensor, an unsupported dtype, or operands of different dtypes.
        DeviceError: operands on different devices.
        ArgumentError: an unknown activation.

    Each is raised before any launch. Under ``torch.autocast`` the operands are cast to
    the autocast dtype first, as ``F.linear`` casts them (float64 stays float64). Under
    ``torch.profiler`` each call is a ``fusedkit::matmul`` range.

    ``DTensor`` operands (tensor parallelism) run on their shards by the rules of
    :mod:`fusedkit.sharding`; where K is sharded (a row-parallel layer) the product is a
    partial sum, reduced before the bias and activation run, in one fused kernel for ReLU and
    GELU.
    """
    if activation is not None and sharding.k_sharded(a, b):
        return _reduced_then_activated(a, b, bias, activation)
    return dispatch.matmul(a, b, bias, activation)


def _reduced_then_activated(a, b, bias, activation: str) -> torch.Tensor:
    """A row-parallel ``act(a @ b + bias)``: an activation does not distribute over the
    shards' partial sums, so the product's partial sums are reduced (replicated there, where
    a row-parallel layer's result goes) and then bias and activation run."""
    a, b, bias = dispatch.autocast(a, b, bias)
    mm.validate(a, b, bias, activation, "matmul")
    # Only the partial sums are reduced: a dim sharded over another mesh dim stays sharded.
    product = sharding.reduce_partial(dispatch.matmul(a, b, None, None))
    shift = 0 if bias is None else bias
    if activation == "relu":
        return add_relu(product, shift)
    if activation in ("gelu", "gelu_tanh"):
        return add_gelu(product, shift, approximate="none" if activation == "gelu" else "tanh")
    return torch.nn.functional.silu(product + shift)  # (no fused add + SiLU entry)


def matmul_relu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.relu(a @ b + bias)`` in one kernel; see :func:`matmul`."""
    return matmul(a, b, bias, "relu")


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.relu(F.linear(x, weight, bias))``: x (..., in) or (in,), weight (out, in), bias
    (out,) in one kernel, the weight read transposed through its strides, never copied.

    Takes the inputs ``F.linear`` takes: a bias of shape () or (1,) is expanded (a view);
    a 1-D weight, or a bias over the batch dims, runs the product and then one fused
    ``add_relu``. A bias that would widen the result raises ``ShapeError`` (torch's addmm
    refuses it too). Follows ``torch.autocast`` as ``F.linear`` does, bias included.
    """
    for name, value in (("x", x), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise DTypeError(f"linear_relu(): {name} must be a Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise DTypeError(f"linear_relu(): bias must be a Tensor or None, got {type(bias).__name__}")
    if weight.dim() not in (1, 2):
        raise ShapeError(f"linear_relu(): weight must be 2-D (out, in) or 1-D (in,), got shape {tuple(weight.shape)}")
    x, weight, bias = dispatch.autocast(x, weight, bias)
    if weight.dim() == 2 and (bias is None or (bias.dim() <= 1 and bias.numel() in (1, weight.shape[0]))):
        if bias is not None and bias.shape != weight.shape[:1]:
            bias = bias.expand(weight.shape[0])
        return matmul(x, weight.t(), bias, "relu")
    # F.linear's other shapes: the product, then bias and ReLU in one kernel. The bias may
    # not widen the product's shape (torch's addmm refuses that); a 1-D x keeps its (out,) shape.
    product = tuple(x.shape[:-1]) + tuple(weight.shape[:-1])  # (checked before anything launches)
    if bias is not None:
        shape = broadcast_shape([product, tuple(bias.shape)])
        if shape != product and not (x.dim() == 1 and shape is not None and math.prod(shape) == math.prod(product)):
            raise ShapeError(
                f"linear_relu(): a bias of shape {tuple(bias.shape)} does not broadcast to the "
                f"product's shape {product}, as F.linear requires"
            )
    y = matmul(x, weight[:, None]).squeeze(-1) if weight.dim() == 1 else matmul(x, weight.t())
    if bias is None:
        return dispatch.elementwise(ADD_RELU, (y, 0), 1, None)
    out = dispatch.elementwise(ADD_RELU, (y, bias), 1, None)
    return out if out.shape == y.shape else out.reshape(y.shape)


def mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    *,
    activation: str = "gelu",
    approximate: str = "none",
    recompute: bool = False,
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, w1, b1)), w2, b2)``, the MLP of GPT-2, BERT, ViT and timm's
    ``Mlp``, as one trainable unit: x (..., in), w1 (hidden, in) and w2 (out, hidden) as
    ``nn.Linear`` stores them (read through their strides, never copied), b1 (hidden,) and
    b2 (out,) or None. ``activation``: "gelu" (``approximate`` "none" or "tanh"), "relu" or
    "silu", as ``F.gelu`` / ``F.relu`` / ``F.silu``.

    The up-projection's bias runs in its GEMM's epilogue. For GELU and SiLU the activation runs
    in the next GEMMs' prologue, as ``pre``'s tiles load, so its output is never written; ReLU's
    runs in the first epilogue. In the backward, the GEMM that makes ``dy @ w2`` multiplies by
    the activation's derivative and sums the bias gradient in its epilogue, so the activation's
    gradient is written once and never read back. Saved for the backward: ``x`` and the
    activation's input (ReLU: its output), where eager keeps GELU's and SiLU's input and
    output; ``recompute=True`` keeps only ``x`` and runs the first GEMM again in the backward.
    Follows ``torch.autocast`` as ``F.linear`` does. DTensor operands placed as tensor
    parallelism places an MLP (``w1`` column-parallel, ``w2`` row-parallel; or rows sharded;
    or all replicated) run on each rank's shards (:mod:`fusedkit.sharding`). Traced,
    ``torch.func``, other DTensor and CPU calls run the PyTorch composition.
    """
    return dispatch.mlp(x, w1, b1, w2, b2, activation, approximate, recompute)


def gated_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: str = "silu",
    approximate: str = "none",
    bias: tuple | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """``F.linear(act(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)``, the gated MLP of LLaMA,
    Mistral, Qwen and Gemma (SwiGLU with ``activation="silu"``, GeGLU with "gelu", ``approximate``
    "none" or "tanh"), as one trainable unit. Weights as ``nn.Linear`` stores them: ``w_gate``
    and ``w_up`` (hidden, in), ``w_down`` (out, hidden), read in place (a stacked
    ``gate_up_proj`` weight's two halves are views, so it needs no copy either); ``bias``: None
    or ``(b_gate, b_up, b_down)``, each a tensor or None.

    The gate and up projections run as one GEMM that loads each tile of ``x`` once, multiplies
    it by both weights' tiles and writes ``act(gate) * up`` from its epilogue: the two
    projections are never written for inference, and for training they are the two tensors of
    the hidden size kept for the backward (eager keeps four). ``recompute=True`` keeps only
    ``x`` and runs that GEMM again in the backward. Follows ``torch.autocast`` as ``F.linear``
    does. DTensor operands placed as tensor parallelism places a gated MLP (gate and up
    column-parallel, down row-parallel; or rows sharded; or all replicated) run on each rank's
    shards (:mod:`fusedkit.sharding`). Traced, ``torch.func``, other DTensor and CPU calls, and
    gate and up weights with different strides, run the PyTorch composition; a gradient of the
    gradient differentiates it.
    """
    return dispatch.gated_mlp(x, w_gate, w_up, w_down, activation, approximate, bias, recompute)


# --- Normalisation over rows: RMSNorm and LayerNorm, with a residual add first -------------


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``F.rms_norm`` in one kernel: ``input / sqrt(mean(input^2) + eps) * weight`` over the
    trailing ``normalized_shape`` dims, computed in float32 and rounded once.

    Arguments, result dtype (the input's; float32 under CUDA autocast, as torch's norms run)
    and ``eps`` (None: the machine epsilon of that dtype) as ``torch.nn.functional.rms_norm``.
    Rows at any one stride (a slice of a wider buffer) are read in place; float16, bfloat16
    and float32 run the kernels, float64 PyTorch's composition. Autograd keeps the input and
    one float32 per row (its inverse RMS), nothing of the output's size; the backward is one
    kernel, the weight's gradient summed in a fixed order (the same bits run to run).

    Raises:
        ShapeError: ``normalized_shape`` not the input's trailing dims; a weight of another shape.
        DTypeError: a non-floating (or complex) tensor; an input that is not a tensor.
        DeviceError: tensors on different devices.
        ArgumentError: a negative or non-numeric ``eps``.
    """
    return dispatch.norm(RMS_NORM, input, None, normalized_shape, weight, None, eps, 1)


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` in one kernel: ``(input - mean) / sqrt(var + eps) * weight + bias``
    over the trailing ``normalized_shape`` dims (biased variance), in float32, rounded once.
    Arguments, dtypes, memory and errors as :func:`rms_norm`; autograd keeps the input and
    two float32 per row (mean and inverse standard deviation)."""
    return dispatch.norm(LAYER_NORM, input, None, normalized_shape, weight, bias, eps, 1)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None = None,
    *,
    alpha: float = 1,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + alpha * residual; y = rms_norm(h, weight.shape, weight, eps)`` in one pass over
    the rows: returns ``(y, h)``, ``h`` the new residual stream (``torch.result_type(x,
    residual)``, rounded as the eager add rounds it; y normalises that rounded ``h``, as the
    eager composition does). Reads x and residual once and writes y and h, where the eager
    composition also reads h back for the statistics and again for the output. The dims
    normalised: ``normalized_shape``, else the weight's shape, else the last dim. Its backward
    is one kernel: the gradient reaching ``h`` itself (the residual stream's) is added to the
    norm's, and x and residual get it (times ``alpha``); autograd keeps h and one float32 a
    row, not x and residual (as the eager add keeps neither). A residual that broadcasts
    with x (not of x's shape) takes torch's add, then the norm of its result. Errors as
    :func:`rms_norm`."""
    shape = normalized_shape if normalized_shape is not None else x.shape[-1:] if weight is None else weight.shape
    return dispatch.norm(ADD_RMS_NORM, x, residual, shape, weight, None, eps, alpha)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    alpha: float = 1,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + alpha * residual; y = layer_norm(h, ...)`` in one pass: ``(y, h)``, as
    :func:`add_rms_norm` (the dims normalised: ``normalized_shape``, else the weight's or the
    bias's shape, else the last dim)."""
    if normalized_shape is not None:
        shape = normalized_shape
    else:
        shape = x.shape[-1:] if weight is None and bias is None else (weight if weight is not None else bias).shape
    return dispatch.norm(ADD_LAYER_NORM, x, residual, shape, weight, bias, eps, alpha)
