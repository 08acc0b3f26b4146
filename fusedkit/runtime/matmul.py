"""The host side of the matmul with a fused epilogue, ``act(a @ b + bias)``.

Read top to bottom:
- :func:`fp32_precision`: how a float32 product runs (PyTorch's TF32 flag, then
  ``fusedkit.settings``);
- :func:`launch_config` and :func:`plan_matmul`: arguments, compile-time switches and the
  kernel choice (the tiled pointer kernel or the Hopper TMA kernel,
  :mod:`fusedkit.runtime.configs` says why), 32- or 64-bit offsets, split-K;
- :func:`launch_matmul`: launches a kept kernel for validated 2-D operands, or goes on to
  :func:`_first_launch`, which autotunes or compiles and keeps it (:func:`_launch_tma_kernel`
  for the TMA kernel);
- :func:`validate` and :func:`forward`: a call's checks, and its (M, N) result (and
  pre-activation) for a 2-D ``a``;
- kept calls: :func:`call_key`, :data:`KEPT`, :class:`KeptMatmul` and :func:`run`, as
  for the elementwise ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import settings
from ..errors import ArgumentError, DeviceError, DTypeError, ShapeError
from ..kernels import activations
from ..kernels.matmul import matmul_kernel
from ..kernels.matmul_tma import matmul_tma_kernel
from ..registry import ElementwiseKernel
from . import launch, matmul_tma
from .configs import (
    COMPILER_OPTIONS,
    GATED_GEMM_MAX_M,
    MATMUL_FIXED_STAGES,
    MATMUL_FIXED_TILE,
    MATMUL_FIXED_WARPS,
    MATMUL_INTERPRETER_TILE,
    MATMUL_TMA_FIXED_OPTIONS,
    MATMUL_TMA_INTERPRETER_TILE,
    SPLIT_K_MIN_TILE,
    matmul_configs,
    matmul_kernel_choice,
    matmul_m_bucket,
    matmul_min_block_m,
    matmul_split_k_max,
    matmul_tma_fixed_tile,
    prune_matmul_configs,
    tf32_copies_b,
)
from .elementwise import backend_for, kept_launch, launch_elementwise

__all__ = [
    "ACTIVATION_NAMES",
    "GATED_GEMM_MAX_M",
    "Gate",
    "KEPT",
    "activation_grad",
    "KeptMatmul",
    "MATMUL_DTYPES",
    "NATIVE",
    "NATIVE_TRIES",
    "NEEDS_PRE",
    "PLANS",
    "Plan",
    "call_key",
    "forward",
    "fp32_precision",
    "kmajor_copy",
    "kmajor_copy_launch",
    "launch_config",
    "launch_matmul",
    "matmul_reference",
    "plan_matmul",
    "remember",
    "resolve_neg",
    "run",
    "split_k_buffers",
    "tf32_enabled",
    "table_launch",
    "torch_activation",
    "validate",
    "with_lead",
]

_log = logging.getLogger("fusedkit")
MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ACTIVATION_NAMES = ("relu", "gelu", "gelu_tanh", "silu")
_INT32_MAX = 2**31 - 1
#: Activations whose derivative needs the pre-activation (ReLU's needs only the output).
NEEDS_PRE = frozenset({"gelu", "gelu_tanh", "silu"})


_matmul_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(matmul_kernel)
matmul_tuned = triton.autotune(
    configs=matmul_configs(),
    # (the prologue and the backward epilogue in the key: each its own tuning, not the plain GEMM's)
    key=["M_BUCKET", "N", "K", "stride_bk", "INPUT_PRECISION", "GRAD_ACT", "PROLOGUE", "GATED"],
    prune_configs_by={"early_config_prune": prune_matmul_configs},
    # Each config tried writes the column sums' partials of its own tile rows: zeroed before
    # every run, so the chosen one's launch leaves no other config's rows behind (the output
    # stands for them where there are none, and is written whole by every run).
    reset_to_zero=["colsum_ptr"],
)(_matmul_even_k)
INTERPRETED = launch.INTERPRETED
_CONSTEXPR_NAMES = launch.constexpr_names(matmul_kernel)
_TMA_CONSTEXPR_NAMES = launch.constexpr_names(matmul_tma_kernel)
#: Direct launches of eager matmuls (fusedkit.runtime.launch); TMA entries carry their tile.
LAUNCHES = launch.CompiledCache()
TMA_LAUNCHES = launch.CompiledCache()
launch.register_cache(LAUNCHES.clear)
launch.register_cache(TMA_LAUNCHES.clear)

_ACC_DTYPE = {
    torch.float16: tl.float32,
    torch.bfloat16: tl.float32,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
#: Split-K workspaces and arrival counters by (device index, stream): kept, like cuBLAS's
#: workspace, so a repeated call allocates only its output; per stream, because two
#: launches sharing counters must not overlap (one stream runs its kernels in order).
#: The counters start at zero and every launch leaves them at zero.
SPLIT_K_BUFFERS: dict = {}
launch.register_cache(SPLIT_K_BUFFERS.clear)


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may use TF32, by PyTorch's setting.

    Newer PyTorch spells it ``fp32_precision`` and raises on reading the old
    ``allow_tf32`` once the new one was set; setting the old flag updates the new one.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def fp32_precision() -> str:
    """The ``tl.dot`` precision of a float32 matmul: "tf32" where PyTorch allows TF32, else
    ``fusedkit.settings``' ``fp32_precision`` ("tf32x3" or "ieee")."""
    return "tf32" if tf32_enabled() else settings.current().fp32_precision


def _max_offset(t: torch.Tensor) -> int:
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


class Gate(NamedTuple):
    """The gated epilogue's second operand (``act(a @ b + bias) * (a @ b2 + bias2)``, a gated
    MLP's gate and up projections in one GEMM): ``b2`` (K, N) with ``b``'s strides, its bias
    (with ``bias``'s stride) or None, and where the up projection is kept for a backward (laid
    out as the output; the gate goes to ``pre``) or None."""

    b2: torch.Tensor
    bias2: torch.Tensor | None = None
    pre2: torch.Tensor | None = None


def launch_config(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out: torch.Tensor,
    pre: torch.Tensor | None = None,
    split_k: tuple[torch.Tensor, torch.Tensor] | None = None,
    grad_act: bool = False,
    colsum: torch.Tensor | None = None,
    prologue: str | None = None,
    gate: Gate | None = None,
) -> tuple[tuple, dict]:
    """Kernel arguments and compile-time switches (no tile) of ``act(a @ b + bias)``, or with
    ``grad_act`` of the backward epilogue's ``(a @ b) * act'(pre)`` (``pre`` read, no bias),
    its column sums' partials into ``colsum`` when given (:func:`activation_grad`); ``prologue``:
    an activation applied to ``a``'s tiles as they load (the product is ``act(a) @ b``);
    ``gate``: the gated epilogue (:class:`Gate`).

    ``split_k``: a workspace and arrival counters (``split_k_buffers``); without them
    tuning tries no split-K config. Works on meta tensors, so the code a call would
    compile can be inspected anywhere.
    """
    M, K = a.shape
    N = b.shape[1]
    code = activations.ACTIVATIONS[activation]
    b2, bias2, pre2 = gate if gate is not None else (None, None, None)
    int64 = max(_max_offset(t) for t in (a, b, out, bias, pre, b2, bias2, pre2) if t is not None) > _INT32_MAX
    precision = fp32_precision() if a.dtype == torch.float32 else "ieee"
    ws, arrivals = split_k if split_k is not None else (out, out)  # out: "no workspace" to the pruner
    args = (
        a,
        b,
        out,
        bias if bias is not None else out,
        pre if pre is not None else out,
        ws,
        arrivals,
        colsum if colsum is not None else out,
        b2 if b2 is not None else b,
        bias2 if bias2 is not None else out,
        pre2 if pre2 is not None else out,
        M,
        N,
        K,
        matmul_m_bucket(M),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        bias.stride(0) if bias is not None else 0,
    )
    meta = dict(
        HAS_BIAS=bias is not None,
        ACTIVATION=code,
        STORE_PRE=pre is not None and not grad_act,
        GRAD_ACT=grad_act,
        SUM_ROWS=colsum is not None,
        PROLOGUE=activations.ACTIVATIONS[prologue],
        GATED=gate is not None,
        ACC_DTYPE=_ACC_DTYPE[a.dtype],
        INPUT_PRECISION=precision,
        INT64=int64,
        # Triton's interpreter stores bf16 as raw uint16 and its tl.dot multiplies
        # those integers; products of exactly widened values are the same math.
        UPCAST_OPERANDS=INTERPRETED and a.dtype == torch.bfloat16,
    )
    return args, meta


@dataclass(frozen=True)
class Plan:
    """What a launch of ``act(a @ b + bias)`` needs besides the tensors: fixed for given
    shapes, strides, dtype, switches and settings, so an eager call signature keeps one."""

    ints: tuple  # the kernel's integer arguments
    meta: dict  # compile-time switches, no tile
    tma_ok: bool  # the TMA kernel is chosen and the layout allows it (base alignment aside)
    tuned: bool
    split_k: int  # the widest split-K the pointer kernel may launch with (1: none, no workspace)
    ws_dtype: torch.dtype
    prefix: tuple  # the launch-cache key, less pointer alignment and the kernel choice
    #: fp32 on TF32 with row-major a and b, from ``MATMUL_TF32_COPY_MIN_M`` rows: the launch
    #: runs on a K-major copy of b (``kmajor_copy``), and the plan is that copy's.
    copy_b: bool
    copy_launch: object = None  # its kept launch (``kmajor_copy_launch``), where kept
    #: Kept launches by (kernel choice, pointer alignment): found once in the shared
    #: cache, so a repeated call skips hashing the ~35-item key.
    launches: dict = field(default_factory=dict, compare=False)


def _split_k_max(a, meta, tuned: bool, n: int, ws_dtype: torch.dtype) -> int:
    """The widest split the pointer kernel may run with for this call (1: no workspace)."""
    if INTERPRETED:
        return MATMUL_INTERPRETER_TILE["SPLIT_K"]
    if not tuned:
        return MATMUL_FIXED_TILE["SPLIT_K"]
    m = a.shape[0]
    return matmul_split_k_max(matmul_m_bucket(m), meta["INPUT_PRECISION"], a.dtype, m, n, ws_dtype.itemsize)


def split_k_buffers(device: torch.device, split: int, m: int, n: int, dtype: torch.dtype):
    """This stream's split-K workspace (at least ``split * m * n`` accumulators of ``dtype``)
    and arrival counters (one per tile of the smallest split-K tile), grown as needed."""
    index = device.index if device.type == "cuda" else None
    key = (index, dtype, 0 if index is None else launch.stream_of(index))
    ws, arrivals = SPLIT_K_BUFFERS.get(key, (None, None))
    tiles = triton.cdiv(m, SPLIT_K_MIN_TILE[0]) * triton.cdiv(n, SPLIT_K_MIN_TILE[1])
    if ws is None or ws.numel() < split * m * n or arrivals.numel() < tiles:
        # A grown pair replaces the old; kernels still queued on this stream with the old
        # pair run before anything that reuses its memory (the allocator is stream-ordered).
        ws = torch.empty(split * m * n, dtype=dtype, device=device)
        arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        SPLIT_K_BUFFERS[key] = (ws, arrivals)
    return ws, arrivals


#: The copy :func:`kmajor_copy` runs: fusedkit's elementwise kernel with the identity as its
#: math (an unregistered entry), so it reads ``b`` in its layout and writes any other.
_COPY = ElementwiseKernel(
    name="kmajor_copy",
    math=activations.identity,
    reference=torch.clone,
    arg_names=("x",),
    param=None,
    formula="x",
    unfused=("torch.Tensor.contiguous",),
)


def _kmajor_empty(b: torch.Tensor, device) -> torch.Tensor:
    """An uninitialised tensor of ``b``'s shape and dtype on ``device``, K-major (strides (1, K))."""
    return torch.empty_strided(b.shape, (1, b.shape[0]), dtype=b.dtype, device=device)


def kmajor_copy(b: torch.Tensor, kept=None) -> torch.Tensor:
    """``b`` (K, N) with the same values, laid out K-major (strides (1, K)): a copy through
    fusedkit's elementwise kernel, which reads ``b`` row-major and writes the transpose in
    square tiles. ``kept``: :func:`kmajor_copy_launch` of a ``b`` like this one, which skips
    Triton's own launch path. On the H200 a 4096^2 fp32 ``b`` copies three times as fast as
    through ``b.t().contiguous()`` (docs/matmul.md has the copy's time)."""
    if kept is not None:
        out = kept.run((b,), None)
        if out is not None:
            return out
    return launch_elementwise(_COPY, (b,), None, _kmajor_empty(b, b.device))


_COPY_LAUNCHES = launch.CallCache()


def kmajor_copy_launch(b: torch.Tensor):
    """The kept launch of :func:`kmajor_copy` for tensors with ``b``'s dtype, shape, strides and
    device (None where launches are not kept), made once per such signature."""
    key = (b.dtype, b.shape, b.stride(), b.device)
    kept = _COPY_LAUNCHES.get(key)
    if kept is None:
        kept = kept_launch(_COPY, (b,), None, _kmajor_empty(b, b.device))
        if kept is not None:
            _COPY_LAUNCHES.keep(key, kept)
    return kept


#: The first integer argument of the pointer kernel (those before it are pointers).
_POINTERS = launch.pointer_count(matmul_kernel)


def plan_matmul(
    a, b, bias, activation, out, pre=None, grad_act: bool = False, colsum=None, prologue=None, gate=None
) -> Plan:
    tuned = settings.current().autotune
    m = a.shape[0]
    copy_b = (
        gate is None
        and a.dtype == torch.float32
        and fp32_precision() == "tf32"
        and matmul_tma.transposed_product(a, b, "tf32")
        and tf32_copies_b(m)
    )
    copy_launch = None
    if copy_b:  # plan for the K-major copy the launch makes (its layout; nothing copied here)
        copy_launch = kmajor_copy_launch(b)
        b = _kmajor_empty(b, "meta")
    args, meta = launch_config(a, b, bias, activation, out, pre, None, grad_act, colsum, prologue, gate)
    ws_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32  # the accumulator's
    split = 1 if gate is not None else _split_k_max(a, meta, tuned, b.shape[1], ws_dtype)
    transposed = matmul_tma.transposed_product(a, b, meta["INPUT_PRECISION"])
    tma_ok = (
        matmul_kernel_choice(m, transposed, a.element_size() == 2) == "tma"
        and not (gate is not None and transposed)
        and matmul_tma.layout_ok(a, b, out, pre, INTERPRETED, gate)
    )
    prefix = (tuned, a.device.index, a.dtype, split, *args[_POINTERS:], *meta.values())
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug(
            "matmul %s x %s %s, activation %s: %s kernel, %s, split-K up to %d%s",
            tuple(a.shape),
            tuple(b.shape),
            a.dtype,
            activation,
            "TMA" if tma_ok else "pointer",
            f"interpreter tile {MATMUL_INTERPRETER_TILE}"
            if INTERPRETED
            else "autotuned tile"
            if tuned
            else f"fixed tile {MATMUL_FIXED_TILE}",
            split,
            ", b copied K-major" if copy_b else "",
        )
    return Plan(args[_POINTERS:], meta, tma_ok, tuned, split, ws_dtype, prefix, copy_b, copy_launch)


#: Plans of launches made without one (an MLP's GEMMs, the backward's): by everything
#: :func:`plan_matmul` reads, so a repeated launch skips planning (its key costs about a
#: quarter of what planning did on the CPU machine; docs/design.md, "Matmul calls").
PLANS = launch.CallCache()


def _layout(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride())


def _kept_plan(a, b, bias, activation, out, pre, grad_act, colsum, prologue, gate) -> Plan:
    key = (
        a.dtype,
        a.device,
        _layout(a),
        _layout(b),
        _layout(bias),
        _layout(out),
        _layout(pre),
        _layout(colsum),
        activation,
        grad_act,
        prologue,
        None if gate is None else tuple(_layout(t) for t in gate),
        settings.current(),  # (a new object on every change of the settings)
        a.dtype == torch.float32 and tf32_enabled(),
    )
    plan = PLANS.get(key)
    if plan is None:
        plan = plan_matmul(a, b, bias, activation, out, pre, grad_act, colsum, prologue, gate)
        PLANS.keep(key, plan)
    return plan


def launch_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    out: torch.Tensor,
    pre: torch.Tensor | None = None,
    plan: Plan | None = None,
    grad_act: bool = False,
    colsum: torch.Tensor | None = None,
    prologue: str | None = None,
    gate: Gate | None = None,
) -> torch.Tensor:
    """``out = act(a @ b + bias)`` for validated 2-D ``a`` (M, K), ``b`` (K, N), non-empty ``out``.

    ``pre``, when given, receives the pre-activation (for a backward pass); with ``grad_act``
    it is read instead, and ``out = (a @ b) * act'(pre)`` (:func:`activation_grad`). ``prologue``:
    ``out = act(prologue(a) @ b + bias)``, the activation ``prologue`` applied to ``a`` as it loads. ``gate``:
    ``out = act(a @ b + bias) * (a @ gate.b2 + gate.bias2)`` (:class:`Gate`). ``plan``: this call's
    ``plan_matmul``, when the caller kept it.

    The body is the kept launch of a repeated call: the plan's pointer kernel, launched
    directly once the plan keeps it for these pointers' alignment. The TMA kernel's launches
    go on to :func:`_launch_tma_kernel`, any other to :func:`_first_launch`.
    """
    index = a.device.index
    if not INTERPRETED and index != launch.current_device():
        with torch.cuda.device(a.device):
            return launch_matmul(a, b, bias, activation, out, pre, plan, grad_act, colsum, prologue, gate)
    if plan is None:
        plan = _kept_plan(a, b, bias, activation, out, pre, grad_act, colsum, prologue, gate)
    if plan.copy_b:
        b = kmajor_copy(b, plan.copy_launch)
    ws = arrivals = out  # no split-K: the kernel never reads these
    if plan.split_k > 1:
        ws, arrivals = split_k_buffers(a.device, plan.split_k, a.shape[0], b.shape[1], plan.ws_dtype)
    o, b_address = out.data_ptr(), b.data_ptr()
    addresses = (
        a.data_ptr(),
        b_address,
        o,
        o if bias is None else bias.data_ptr(),
        o if pre is None else pre.data_ptr(),
        ws.data_ptr(),
        arrivals.data_ptr(),
        o if colsum is None else colsum.data_ptr(),
        b_address if gate is None else gate.b2.data_ptr(),
        o if gate is None or gate.bias2 is None else gate.bias2.data_ptr(),
        o if gate is None or gate.pre2 is None else gate.pre2.data_ptr(),
    )
    aligned = tuple([p % launch.ALIGNMENT == 0 for p in addresses])
    # TMA needs 16-byte-aligned bases of a, b, out (and pre, b2, pre2) on top of the layout.
    use_tma = plan.tma_ok and aligned[0] and aligned[1] and aligned[2] and aligned[4] and aligned[8] and aligned[10]
    entry = plan.launches.get((use_tma, aligned))  # pointer-kernel launches only (never under the interpreter)
    if entry is not None:
        launch.CompiledCache.run(entry, addresses + plan.ints, index)
    elif use_tma:
        _launch_tma_kernel(a, b, bias, out, pre, plan, aligned, colsum, gate)
    else:
        _first_launch(a, b, bias, out, pre, plan, (ws, arrivals), addresses, aligned, colsum, gate)
    return out


def _first_launch(
    a, b, bias, out, pre, plan: Plan, split_k: tuple, addresses: tuple, aligned: tuple, colsum=None, gate=None
) -> None:
    """A pointer-kernel launch that ``plan`` has not kept: in the interpreter; the kernel kept in
    the shared cache under this launch's key (another plan's, or one cleared), which the plan
    then keeps; else through Triton's launch, which compiles or autotunes, the compiled kernel
    kept under the key for the next call."""
    M, K = a.shape
    N = b.shape[1]
    b2, bias2, pre2 = gate if gate is not None else (b, None, None)
    args = (
        (a, b, out, bias if bias is not None else out, pre if pre is not None else out, *split_k)
        + (colsum if colsum is not None else out, b2)
        + tuple(t if t is not None else out for t in (bias2, pre2))
        + plan.ints
    )
    meta = plan.meta

    def grid(m):
        return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]), m["SPLIT_K"])

    if INTERPRETED:
        tile = MATMUL_INTERPRETER_TILE
        with launch.serialised():
            matmul_kernel[grid(tile)](*args, **meta, **tile, EVEN_K=K % tile["BLOCK_K"] == 0, **COMPILER_OPTIONS)
        return
    # Everything Triton specialises on: the integers exactly (they refine its
    # classes), pointer dtypes and alignment, the switches, the config source.
    key = plan.prefix + (False,) + aligned
    entry = LAUNCHES.get(key)
    if entry is not None:
        plan.launches[(False, aligned)] = entry
        launch.CompiledCache.run(entry, addresses + plan.ints, a.device.index)
        return
    if plan.tuned:
        recorder = launch.GridRecorder(grid)
        compiled = matmul_tuned[recorder](*args, **meta, **COMPILER_OPTIONS)
        tile = {name: recorder.meta[name] for name in MATMUL_FIXED_TILE}
        _log.debug("matmul M=%d N=%d K=%d %s: the autotuner chose %s", M, N, K, a.dtype, tile)
    else:
        tile = MATMUL_FIXED_TILE
        compiled = matmul_kernel[grid(tile)](
            *args,
            **meta,
            **tile,
            EVEN_K=K % tile["BLOCK_K"] == 0,
            num_stages=MATMUL_FIXED_STAGES,
            num_warps=MATMUL_FIXED_WARPS,
            **COMPILER_OPTIONS,
        )
    constexprs = {**meta, **tile, "EVEN_K": K % tile["BLOCK_K"] == 0}
    LAUNCHES.put(key, compiled, (*grid(tile), 1), tuple(constexprs[n] for n in _CONSTEXPR_NAMES))


def _launch_tma_kernel(a, b, bias, out, pre, plan: Plan, aligned: tuple, colsum=None, gate=None) -> None:
    """A TMA-kernel launch: its kept launches take tensor descriptors, built for each call's
    operands, so they run here rather than from ``plan.launches``; the first launch of a key
    (and any launch under the interpreter) goes through Triton's path."""
    if INTERPRETED:
        with launch.serialised():
            _launch_tma(a, b, bias, out, pre, plan.meta, tuned=False, colsum=colsum, gate=gate)
        return
    key = plan.prefix + (True,) + aligned  # as :func:`_first_launch` keys the pointer kernel
    entry = TMA_LAUNCHES.get(key)
    # A kept launch whose launcher takes encoded descriptors (``entry.layouts``) gets
    # them encoded once per operand address (building them each call doubled a repeated
    # call's host time: docs/design.md, "Matmul calls"); a profiler's hooks get
    # Triton's own launch, which passes them the descriptor objects.
    if entry is not None and (entry.layouts is None or launch.hooks_idle()):
        if entry.layouts is None:
            descs = matmul_tma.descriptors(a, b, out, pre, entry.extra, gate)
        else:
            descs = matmul_tma.encoded_args(a, b, out, pre, entry.layouts, gate)
        tail = matmul_tma.tail_args(a, b, bias, out, matmul_m_bucket(a.shape[0]), colsum, gate)
        launch.CompiledCache.run(entry, (*descs, *tail), a.device.index)
    else:
        _launch_tma(a, b, bias, out, pre, plan.meta, plan.tuned, key, colsum, gate)


def _launch_tma(a, b, bias, out, pre, meta, tuned: bool, key=None, colsum=None, gate=None) -> None:
    """Launch through Triton's path (tuning or compiling as needed); keep the kernel for ``key``."""
    compiled, tile, grid = matmul_tma.launch_tma(
        a,
        b,
        bias,
        meta["ACTIVATION"],
        out,
        pre,
        meta["INPUT_PRECISION"],
        meta["UPCAST_OPERANDS"],
        matmul_m_bucket(a.shape[0]),
        INTERPRETED,
        tuned,
        matmul_tma_fixed_tile(a.element_size(), meta["GATED"]),
        MATMUL_TMA_FIXED_OPTIONS,
        meta["GRAD_ACT"],
        colsum,
        meta["PROLOGUE"],
        gate,
    )
    if key is None:
        return
    values = {
        **meta,
        **tile,
        "A_MMAJOR": matmul_tma.a_mmajor(a),
        "B_KMAJOR": matmul_tma.b_kmajor(b),
        "NUM_SMS": matmul_tma.num_sms(a.device.index),
    }
    TMA_LAUNCHES.put(key, compiled, (grid, 1, 1), tuple(values[n] for n in _TMA_CONSTEXPR_NAMES), extra=tile)


def torch_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


def matmul_reference(a, b, bias=None, activation=None) -> torch.Tensor:
    """The unfused PyTorch composition: ``act(a @ b + bias)``."""
    y = torch.matmul(a, b)
    if bias is not None:
        y = y + bias
    return torch_activation(y, activation)


def validate(a, b, bias, activation, name: str) -> None:
    """Check a matmul's arguments as :func:`fusedkit.matmul` documents; raises before any launch."""
    for arg, value in (("a", a), ("b", b)):
        if not isinstance(value, torch.Tensor):
            raise DTypeError(f"{name}(): argument '{arg}' must be a Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise DTypeError(f"{name}(): bias must be a Tensor or None, got {type(bias).__name__}")
    if activation not in (None, *ACTIVATION_NAMES):
        raise ArgumentError(
            f"{name}(): unknown activation {activation!r}; choose from None, "
            f"{', '.join(repr(x) for x in ACTIVATION_NAMES)}"
        )
    for arg, value in (("a", a), ("b", b), ("bias", bias)):
        if value is not None and value.dtype not in MATMUL_DTYPES:
            raise DTypeError(
                f"{name}(): argument '{arg}' has dtype {value.dtype}; supported: "
                f"{', '.join(str(d) for d in MATMUL_DTYPES)}"
            )
    if b.dtype != a.dtype or (bias is not None and bias.dtype != a.dtype):
        raise DTypeError(
            f"{name}(): a, b and bias must share a dtype; got a {a.dtype}, b {b.dtype}"
            + (f", bias {bias.dtype}" if bias is not None else "")
        )
    for arg, value in (("b", b), ("bias", bias)):
        if value is not None and value.device != a.device:
            raise DeviceError(f"{name}(): argument '{arg}' is on {value.device}, but 'a' is on {a.device}")
    if a.dim() < 1:
        raise ShapeError(f"{name}(): a must have at least 1 dim (..., K), got a 0-d tensor")
    if b.dim() != 2:
        raise ShapeError(f"{name}(): b must be 2-D (K, N), got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ShapeError(f"{name}(): a{tuple(a.shape)} @ b{tuple(b.shape)}: K differs ({a.shape[-1]} vs {b.shape[0]})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ShapeError(f"{name}(): bias must have shape ({b.shape[1]},), got {tuple(bias.shape)}")


def forward(a2: torch.Tensor, b: torch.Tensor, bias, activation, store_pre: bool, prologue: str | None = None):
    """``(out, pre)`` of a validated 2-D ``a2`` (M, K): the (M, N) result, and the pre-activation
    when ``store_pre`` (else None). ``prologue``: the product is ``prologue(a2) @ b``."""
    M, N = a2.shape[0], b.shape[1]
    out = torch.empty((M, N), dtype=a2.dtype, device=a2.device)
    pre = torch.empty_like(out) if store_pre else None
    if out.numel() == 0:
        return out, pre
    if a2.shape[1] == 0:  # K == 0: the product is zeros
        z = torch.zeros_like(out) + (bias if bias is not None else 0)
        if pre is not None:
            pre.copy_(z)
        out.copy_(torch_activation(z, activation))
        return out, pre
    launch_matmul(a2, b, bias, activation, out, pre, prologue=prologue)
    return out, pre


def _colsum_block_m(g2) -> int:
    """The fewest rows the launch's tile may have: the column sums' partials get a row for each
    tile row of that height, so whatever tile the launch runs (the tuner chooses it after they
    are allocated) has its rows; those it leaves stay zero."""
    if INTERPRETED:
        return min(MATMUL_INTERPRETER_TILE["BLOCK_M"], MATMUL_TMA_INTERPRETER_TILE["BLOCK_M"])
    if not settings.current().autotune:
        return min(MATMUL_FIXED_TILE["BLOCK_M"], matmul_tma_fixed_tile(g2.element_size())["BLOCK_M"])
    precision = fp32_precision() if g2.dtype == torch.float32 else "ieee"
    pointer = matmul_min_block_m(matmul_m_bucket(g2.shape[0]), precision, g2.dtype)
    return min(pointer, min(c.kwargs["BLOCK_M"] for c in matmul_tma.matmul_tma_tuned.configs))


def activation_grad(g2, b, pre, activation: str, bias_grad: bool):
    """The backward epilogue's GEMM for validated 2-D ``g2`` (M, K), ``b`` (K, N), ``pre`` (M, N)
    of ``b``'s dtype: ``(dpre, dbias)`` with ``dpre = (g2 @ b) * act'(pre)`` and, with
    ``bias_grad``, ``dbias = dpre.sum(0)`` (float32 column sums of the tiles, summed in tile
    order, in ``pre``'s dtype), else None. In an MLP's backward ``g2 @ b`` is ``dy @ W2``, the
    gradient reaching the activation, and ``pre`` the activation's input (for ReLU its output
    serves: ``relu'(pre)`` is ``relu(pre) > 0``)."""
    M, N = pre.shape
    # (the pointer kernel reads pre at the output's offsets: the MLP's pre is its own
    # contiguous result, so this copies only a caller's strided view)
    pre = pre if pre.is_contiguous() else pre.contiguous()
    dpre = torch.empty((M, N), dtype=pre.dtype, device=pre.device)
    if dpre.numel() == 0 or g2.shape[1] == 0:
        dpre.zero_()
        return dpre, (torch.zeros(N, dtype=pre.dtype, device=pre.device) if bias_grad else None)
    colsum = None
    if bias_grad:  # (in the accumulator's dtype; rows past the launch tile's count stay zero)
        rows = triton.cdiv(M, _colsum_block_m(g2))
        acc = torch.float64 if pre.dtype == torch.float64 else torch.float32
        colsum = torch.zeros((rows, N), dtype=acc, device=pre.device)
    launch_matmul(g2, b, None, activation, dpre, pre, grad_act=True, colsum=colsum)
    return dpre, (None if colsum is None else colsum.sum(0).to(pre.dtype))


# --- Kept calls (as for the elementwise ops; see docs/design.md) -----------------------
# A matmul call whose signature (tensor types, dtypes, devices, shapes, strides, the
# activation, whether autograd records it, and the settings the plan reads) was validated
# before reuses its validation and launch plan; per call it allocates the result and launches.

#: The C++ launch table's copies of kept calls, by signature (``fusedkit.autograd.native_matmul``:
#: ``(table, handle)``), or how many times making one found nothing to copy yet (a kernel not
#: yet kept for aligned pointers); tried again up to ``NATIVE_TRIES`` times. Emptied with KEPT.
NATIVE: dict = {}
NATIVE_TRIES = 3
KEPT = launch.CallCache(on_clear=NATIVE.clear)


def call_key(a, b, bias, activation) -> tuple | None:
    """The signature of an eager matmul call; None when it cannot be kept (a tensor subclass,
    a lazily negated view, a non-tensor: the full path validates or traces those)."""
    if not (activation is None or type(activation) is str):
        return None
    # The settings object changes identity with every change (``fusedkit.settings``).
    key = [activation, settings.current()]
    requires_grad = False
    for t in (a, b, bias):
        if t is None:
            key.append(None)
            continue
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        if t.is_neg():
            return None
        requires_grad = requires_grad or t.requires_grad
        key += (t.dtype, t.device, t.shape, t.stride())
    key.append(requires_grad and torch.is_grad_enabled())  # recorded by autograd or not
    if a.dtype == torch.float32:  # PyTorch's TF32 flag matters to fp32 only (and is slow to read)
        key.append(tf32_enabled())
    return tuple(key)


@dataclass(frozen=True)
class KeptMatmul:
    """The prepared eager launch of one validated matmul call signature."""

    m: int
    k: int
    n: int
    lead: torch.Size
    dtype: torch.dtype
    device: torch.device
    activation: str | None
    plan: Plan
    #: Autograd records the call (the dispatcher runs it through fusedkit.autograd, whose
    #: forward launches with this plan), without the full path's validation (it more than
    #: doubled LinearReLU's host time with autograd: docs/design.md, "Matmul calls").
    grad: bool

    def a2(self, a) -> torch.Tensor:
        """``a`` as the 2-D (M, K) operand."""
        return a if a.dim() == 2 else a.reshape(self.m, self.k)

    def run(self, a, b, bias) -> torch.Tensor:
        """The result, leading dims included, of a call autograd does not record."""
        return with_lead(self.launch(self.a2(a), b, bias), self.lead)

    def launch(self, a2, b, bias) -> torch.Tensor:
        """The (M, N) result of a 2-D call, launched with the kept plan."""
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        launch_matmul(a2, b, bias, self.activation, out, None, self.plan)
        return out

    def launch_pre(self, a2, b, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, pre)`` of a 2-D call whose plan stores the pre-activation: a recorded call
        whose activation's derivative needs it (``NEEDS_PRE``), as :func:`remember` plans it."""
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        pre = torch.empty_like(out)
        launch_matmul(a2, b, bias, self.activation, out, pre, self.plan)
        return out, pre


def table_launch(plan: Plan, a2, b, bias) -> tuple | None:
    """``(entry, tma, scalars)`` of the compiled kernel ``plan`` launches for aligned pointers
    (``launch.Entry``; whether it is the TMA kernel; its integer arguments after the pointers),
    as the C++ table repeats it (``native.matmul_recipe``); None where none is kept yet or the
    launch needs more than its operands (a K-major copy of ``b``, split-K's workspace)."""
    aligned = (True,) * 11
    if plan.copy_b:
        return None
    if plan.tma_ok:
        entry = TMA_LAUNCHES.get(plan.prefix + (True,) + aligned)
        scalars = matmul_tma.tail_args(a2, b, bias, a2, matmul_m_bucket(a2.shape[0]))[3:]
        return None if entry is None else (entry, True, scalars)
    entry = None if plan.split_k > 1 else LAUNCHES.get(plan.prefix + (False,) + aligned)
    return None if entry is None else (entry, False, plan.ints)


def remember(key, a2, b, bias, activation, lead, out, grad: bool) -> None:
    """Keep the plan of a validated eager call whose signature ``key`` can repeat; ``out`` is
    the (M, N) result it launched into (a kept call allocates its like)."""
    m, k = a2.shape
    n = b.shape[1]
    if backend_for(a2.device) == "torch" or m * n * k == 0 or not launch.enabled():
        return  # the PyTorch path, or an empty product: nothing to launch
    # A recorded call that keeps its pre-activation launches with it (laid out as out is,
    # which stands for it in the plan: a plan reads layouts, not addresses).
    store_pre = grad and activation in NEEDS_PRE
    KEPT.keep(
        key,
        KeptMatmul(
            m,
            k,
            n,
            lead,
            a2.dtype,
            a2.device,
            activation,
            plan_matmul(a2, b, bias, activation, out, out if store_pre else None),
            grad,
        ),
    )


def run(a2, b, bias, activation) -> torch.Tensor:
    """The (M, N) result of a validated 2-D eager call that autograd does not record: its
    kept plan when the signature was seen, else launched and kept."""
    key = call_key(a2, b, bias, activation)
    if key is not None:
        kept = KEPT.get(key)
        if kept is not None:
            return kept.launch(a2, b, bias)
    out = forward(a2, b, bias, activation, store_pre=False)[0]
    if key is not None:
        remember(key, a2, b, bias, activation, a2.shape[:-1], out, grad=False)
    return out


def with_lead(out: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """The (M, N) result under ``a``'s leading dims. A 2-D ``a`` gets the result itself, not
    a view of it: an autograd Function's forward returning a view would make the caller's
    in-place ops on it fail."""
    return out if len(lead) == 1 else out.view(*lead, out.shape[1])  # lead () for a 1-D a: (N,)


def resolve_neg(t: torch.Tensor | None) -> torch.Tensor | None:
    """A lazily negated view (``z.conj().imag``) holds the un-negated values in memory."""
    return t.resolve_neg() if t is not None and t.is_neg() else t
