"""Matmul with a fused epilogue: ``act(a @ b + bias)`` in one kernel.

Bias and activation are applied to the fp32 accumulator while it is still in
registers, and the output is written once. Layers, by name:
- ``_matmul_kernel``: the ``@triton.jit`` kernel (compile-time switches for bias,
  activation and a stored pre-activation for backward);
- ``launch_matmul``: validates nothing, picks 32/64-bit offsets, autotunes, launches;
- ``_MatmulFunction``: autograd;
- ``matmul``, ``matmul_relu``, ``linear_relu``: the public functions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _jit, _launch, _matmul_tma, activations as act
from ._compat import is_interpreted
from ._elementwise import _profiling, backend_for, dispatch, elementwise, kept_launch, launch_elementwise
from ._layout import broadcast_shape
from ._library import dispatch_mode_active as _dispatch_mode_active
from ._library import functorch_active, tracing
from .configs import (
    CALL_CACHE_SIZE, MATMUL_FIXED_STAGES, MATMUL_FIXED_TILE, MATMUL_FIXED_WARPS, MATMUL_INTERPRETER_TILE,
    MATMUL_TMA_FIXED_OPTIONS, SPLIT_K_MIN_TILE, autotune_enabled, fp32_matmul_setting, matmul_configs,
    matmul_kernel_choice, matmul_kernel_setting, matmul_m_bucket, matmul_split_k_max, matmul_tma_fixed_tile,
    prune_matmul_configs, tf32_copies_b,
)
from .errors import ArgumentError, DeviceError, DTypeError, NotDifferentiableError, ShapeError
from .registry import ADD, ADD_RELU, RELU_GRAD

__all__ = ["matmul", "matmul_relu", "linear_relu", "MATMUL_DTYPES", "ACTIVATION_NAMES"]

_log = logging.getLogger("fusedkit")
MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ACTIVATION_NAMES = ("relu", "gelu", "gelu_tanh", "silu")
_INT32_MAX = 2**31 - 1
#: Activations whose derivative needs the pre-activation (ReLU's needs only the output).
_NEEDS_PRE = frozenset({"gelu", "gelu_tanh", "silu"})


@triton.jit
def _epilogue(acc, rows, cols, mask, c_ptr, bias_ptr, pre_ptr, N, stride_cm, stride_cn, stride_bias,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """Bias, the pre-activation (when kept) and the activation on the accumulator; one store."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
        acc = acc + _jit.widen(bias[None, :], ACC_DTYPE)
    c_offsets = rows[:, None] * stride_cm + cols[None, :] * stride_cn
    # ``_jit.convert``: bf16 rounded to nearest even in the interpreter too (compiled: a plain cast).
    if STORE_PRE:
        tl.store(pre_ptr + c_offsets, _jit.convert(acc, pre_ptr.dtype.element_ty), mask=mask)
    acc = act.apply_activation(acc, ACTIVATION)
    tl.store(c_ptr + c_offsets, _jit.convert(acc, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, ws_ptr, arrivals_ptr,
    M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr,
    ACC_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST_OPERANDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
):
    pid_m, pid_n = _jit.grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        rows = rows.to(tl.int64)
        cols = cols.to(tl.int64)
    # Row and column masks are constant along K, so A and B loads stay 16 bytes wide.
    # (Wrapping indices with ``% M`` instead, as Triton's tutorial does, breaks the
    # alignment its hints promise: a misaligned-address fault for fp16 with K = 33.)
    row_ok = (rows < M)[:, None]
    col_ok = (cols < N)[None, :]
    # Split-K: program (tile, s) sums K steps [k_lo, k_hi) of its tile.
    k_lo = 0
    k_hi = tl.cdiv(K, BLOCK_K)
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_hi, SPLIT_K)
        k_lo = tl.program_id(1) * per_split
        k_hi = tl.minimum(k_hi, k_lo + per_split)
        if INT64:
            k_lo = k_lo.to(tl.int64)
    k_offs = tl.arange(0, BLOCK_K)
    ks = k_lo * BLOCK_K + k_offs
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k in range(k_lo, k_hi):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok, other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok & (k_offs[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(k_offs[:, None] < k_left) & col_ok, other=0.0)
        if UPCAST_OPERANDS or (_jit.INTERPRETED and a.dtype == tl.bfloat16):
            # (the interpreter's own bf16 -> fp32 conversion flushes subnormals; widen is exact)
            a = _jit.widen(a, tl.float32)
            b = _jit.widen(b, tl.float32)
        if DOT:
            acc = _jit.dot(a, b, acc, INPUT_PRECISION, ACC_DTYPE)
        else:
            acc += _jit.outer_sum(a, b, ACC_DTYPE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = row_ok & col_ok
    if SPLIT_K == 1:
        _epilogue(acc, rows, cols, mask, c_ptr, bias_ptr, pre_ptr, N, stride_cm, stride_cn, stride_bias,
                  HAS_BIAS, ACTIVATION, STORE_PRE, ACC_DTYPE)
    else:
        # Each split writes its partial tile to the (SPLIT_K, M, N) workspace and counts
        # itself in; the last to arrive sums the partials in split order (so the result
        # does not depend on which split finished last), applies the epilogue and
        # resets the tile's counter to zero for the next launch on this stream.
        ws = ws_ptr + rows[:, None] * N + cols[None, :]
        tl.store(ws + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the count is released
        arrived = tl.atomic_add(arrivals_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(arrivals_ptr + tl.program_id(0), 0)
            _epilogue(total, rows, cols, mask, c_ptr, bias_ptr, pre_ptr, N, stride_cm, stride_cn, stride_bias,
                      HAS_BIAS, ACTIVATION, STORE_PRE, ACC_DTYPE)


_matmul_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
_matmul_tuned = triton.autotune(configs=matmul_configs(), key=["M_BUCKET", "N", "K", "stride_bk", "INPUT_PRECISION"],
                                prune_configs_by={"early_config_prune": prune_matmul_configs})(_matmul_even_k)
INTERPRETED = is_interpreted(_matmul_kernel)
_CONSTEXPR_NAMES = _launch.constexpr_names(_matmul_kernel)
_TMA_CONSTEXPR_NAMES = _launch.constexpr_names(_matmul_tma._matmul_tma_kernel)
#: Direct launches of eager matmuls (fusedkit._launch); TMA entries carry their tile.
_LAUNCHES = _launch.CompiledCache()
_TMA_LAUNCHES = _launch.CompiledCache()
_launch.register_cache(_LAUNCHES.clear)
_launch.register_cache(_TMA_LAUNCHES.clear)

_ACC_DTYPE = {torch.float16: tl.float32, torch.bfloat16: tl.float32, torch.float32: tl.float32,
              torch.float64: tl.float64}
#: Split-K workspaces and arrival counters by (device index, stream): kept, like cuBLAS's
#: workspace, so a repeated call allocates only its output; per stream, because two
#: launches sharing counters must not overlap (one stream runs its kernels in order).
#: The counters start at zero and every launch leaves them at zero.
_SPLIT_K_BUFFERS: dict = {}
_launch.register_cache(_SPLIT_K_BUFFERS.clear)


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
    """The ``tl.dot`` precision of a float32 matmul: "tf32" where PyTorch allows TF32,
    else ``FUSEDKIT_FP32_MATMUL`` ("tf32x3" unless set, or "ieee")."""
    return "tf32" if tf32_enabled() else fp32_matmul_setting()


def _max_offset(t: torch.Tensor) -> int:
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def launch_config(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  out: torch.Tensor, pre: torch.Tensor | None = None,
                  split_k: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[tuple, dict]:
    """Kernel arguments and compile-time switches (no tile) of ``act(a @ b + bias)``.

    ``split_k``: a workspace and arrival counters (``split_k_buffers``); without them
    tuning tries no split-K config. Works on meta tensors, so the code a call would
    compile can be inspected anywhere.
    """
    M, K = a.shape
    N = b.shape[1]
    code = act.ACTIVATIONS[activation]
    int64 = max(_max_offset(t) for t in (a, b, out, bias, pre) if t is not None) > _INT32_MAX
    precision = fp32_precision() if a.dtype == torch.float32 else "ieee"
    ws, arrivals = split_k if split_k is not None else (out, out)  # out: "no workspace" to the pruner
    args = (a, b, out, bias if bias is not None else out, pre if pre is not None else out, ws, arrivals,
            M, N, K, matmul_m_bucket(M),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            bias.stride(0) if bias is not None else 0)
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=code, STORE_PRE=pre is not None,
                ACC_DTYPE=_ACC_DTYPE[a.dtype], INPUT_PRECISION=precision, INT64=int64,
                # Triton's interpreter stores bf16 as raw uint16 and its tl.dot multiplies
                # those integers; products of exactly widened values are the same math.
                UPCAST_OPERANDS=INTERPRETED and a.dtype == torch.bfloat16)
    return args, meta


@dataclass(frozen=True)
class _Plan:
    """What a launch of ``act(a @ b + bias)`` needs besides the tensors: fixed for given
    shapes, strides, dtype, switches and settings, so an eager call signature keeps one."""

    ints: tuple  # the kernel's integer arguments
    meta: dict   # compile-time switches, no tile
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
    key = (index, dtype, 0 if index is None else _launch.stream_of(index))
    ws, arrivals = _SPLIT_K_BUFFERS.get(key, (None, None))
    tiles = triton.cdiv(m, SPLIT_K_MIN_TILE[0]) * triton.cdiv(n, SPLIT_K_MIN_TILE[1])
    if ws is None or ws.numel() < split * m * n or arrivals.numel() < tiles:
        # A grown pair replaces the old; kernels still queued on this stream with the old
        # pair run before anything that reuses its memory (the allocator is stream-ordered).
        ws = torch.empty(split * m * n, dtype=dtype, device=device)
        arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        _SPLIT_K_BUFFERS[key] = (ws, arrivals)
    return ws, arrivals


#: ``x + (-0.0)`` is ``x`` for every float (signed zeros and inf included; NaN stays NaN,
#: though the GPU may change its payload), so the add kernel with this scalar copies its
#: tensor operand into any layout ``out`` has.
_COPY_ADDEND = -0.0


def _kmajor_empty(b: torch.Tensor, device) -> torch.Tensor:
    """An uninitialised tensor of ``b``'s shape and dtype on ``device``, K-major (strides (1, K))."""
    return torch.empty_strided(b.shape, (1, b.shape[0]), dtype=b.dtype, device=device)


def kmajor_copy(b: torch.Tensor, launch=None) -> torch.Tensor:
    """``b`` (K, N) with the same values, laid out K-major (strides (1, K)): a copy through
    fusedkit's elementwise kernel, which reads ``b`` row-major and writes the transpose in
    square tiles. ``launch``: :func:`kmajor_copy_launch` of a ``b`` like this one, which skips
    Triton's own launch path. On the H200 a 4096^2 fp32 ``b`` takes 38.6 us (about 3.5 TB/s
    read + written) against 128.3 for ``b.t().contiguous()``."""
    if launch is not None:
        out = launch.run((b, _COPY_ADDEND), 1)
        if out is not None:
            return out
    return launch_elementwise(ADD, (b, _COPY_ADDEND), 1, _kmajor_empty(b, b.device))


_COPY_LAUNCHES: dict = {}
_launch.register_cache(_COPY_LAUNCHES.clear)


def kmajor_copy_launch(b: torch.Tensor):
    """The kept launch of :func:`kmajor_copy` for tensors with ``b``'s dtype, shape, strides and
    device (None where launches are not kept), made once per such signature. Its host-number
    operand keeps it out of the C++ launch table (``_native.register`` takes all-tensor
    launches only), which would otherwise serve a plain ``fusedkit.add`` of such tensors with
    this K-major layout."""
    key = (b.dtype, b.shape, b.stride(), b.device)
    launch = _COPY_LAUNCHES.get(key)
    if launch is None:
        launch = kept_launch(ADD, (b, _COPY_ADDEND), 1, _kmajor_empty(b, b.device))
        if launch is not None:
            if len(_COPY_LAUNCHES) >= CALL_CACHE_SIZE:
                _COPY_LAUNCHES.clear()
            _COPY_LAUNCHES[key] = launch
    return launch


def plan_matmul(a, b, bias, activation, out, pre=None) -> _Plan:
    tuned = autotune_enabled()
    m = a.shape[0]
    copy_b = (a.dtype == torch.float32 and fp32_precision() == "tf32"
              and _matmul_tma.transposed_product(a, b, "tf32") and tf32_copies_b(m))
    copy_launch = None
    if copy_b:  # plan for the K-major copy the launch makes (its layout; nothing copied here)
        copy_launch = kmajor_copy_launch(b)
        b = _kmajor_empty(b, "meta")
    args, meta = launch_config(a, b, bias, activation, out, pre)
    ws_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32  # the accumulator's
    split = _split_k_max(a, meta, tuned, b.shape[1], ws_dtype)
    transposed = _matmul_tma.transposed_product(a, b, meta["INPUT_PRECISION"])
    tma_ok = (matmul_kernel_choice(m, transposed, a.element_size() == 2) == "tma"
              and _matmul_tma.layout_ok(a, b, out, pre, INTERPRETED))
    prefix = (tuned, a.device.index, a.dtype, split, *args[7:], *meta.values())
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("matmul %s x %s %s, activation %s: %s kernel, %s, split-K up to %d%s", tuple(a.shape),
                   tuple(b.shape), a.dtype, activation, "TMA" if tma_ok else "pointer",
                   f"interpreter tile {MATMUL_INTERPRETER_TILE}" if INTERPRETED else
                   "autotuned tile" if tuned else f"fixed tile {MATMUL_FIXED_TILE}", split,
                   ", b copied K-major" if copy_b else "")
    return _Plan(args[7:], meta, tma_ok, tuned, split, ws_dtype, prefix, copy_b, copy_launch)


def launch_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  out: torch.Tensor, pre: torch.Tensor | None = None, plan: _Plan | None = None) -> torch.Tensor:
    """``out = act(a @ b + bias)`` for validated 2-D ``a`` (M, K), ``b`` (K, N), non-empty ``out``.

    ``pre``, when given, receives the pre-activation (for a backward pass). ``plan``:
    this call's ``plan_matmul``, when the caller kept it.
    """
    index = a.device.index
    if not INTERPRETED and index != _launch.current_device():
        with torch.cuda.device(a.device):
            return launch_matmul(a, b, bias, activation, out, pre, plan)
    plan = plan or plan_matmul(a, b, bias, activation, out, pre)
    if plan.copy_b:
        b = kmajor_copy(b, plan.copy_launch)
    M, K = a.shape
    N = b.shape[1]
    o = out.data_ptr()
    ws = arrivals = out  # no split-K: the kernel never reads these
    if plan.split_k > 1:
        ws, arrivals = split_k_buffers(a.device, plan.split_k, M, N, plan.ws_dtype)
    addresses = (a.data_ptr(), b.data_ptr(), o, o if bias is None else bias.data_ptr(),
                 o if pre is None else pre.data_ptr(), ws.data_ptr(), arrivals.data_ptr())
    aligned = tuple([p % _launch.ALIGNMENT == 0 for p in addresses])
    # TMA needs 16-byte-aligned bases of a, b, out (and pre) on top of the layout.
    use_tma = plan.tma_ok and aligned[0] and aligned[1] and aligned[2] and aligned[4]
    local = (use_tma, aligned)
    entry = plan.launches.get(local)  # pointer-kernel launches only (never under the interpreter)
    if entry is not None:
        _launch.CompiledCache.run(entry, addresses + plan.ints, index)
        return out
    args = (a, b, out, bias if bias is not None else out, pre if pre is not None else out, ws, arrivals) + plan.ints
    meta = plan.meta

    def grid(m):
        return (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]), m["SPLIT_K"])

    if INTERPRETED:
        with _launch.serialised():
            if use_tma:
                _launch_tma(a, b, bias, out, pre, meta, tuned=False)
                return out
            tile = MATMUL_INTERPRETER_TILE
            _matmul_kernel[grid(tile)](*args, **meta, **tile, EVEN_K=K % tile["BLOCK_K"] == 0)
        return out
    # Everything Triton specialises on: the integers exactly (they refine its
    # classes), pointer dtypes and alignment, the switches, the config source.
    key = plan.prefix + (use_tma,) + aligned
    if use_tma:
        entry = _TMA_LAUNCHES.get(key)
        # A kept launch whose launcher takes encoded descriptors (``entry.layouts``) gets
        # them encoded once per operand address (building them each call cost LinearReLU's
        # 4096^3 bf16 step 64 us of host time on the H200); a profiler's hooks get
        # Triton's own launch, which passes them the descriptor objects.
        if entry is not None and (entry.layouts is None or _launch.hooks_idle()):
            if entry.layouts is None:
                descs = _matmul_tma.descriptors(a, b, out, pre, tile=entry.extra)
            else:
                descs = _matmul_tma.encoded_args(a, b, out, pre, entry.layouts)
            tail = _matmul_tma.tail_args(a, b, bias, out, matmul_m_bucket(a.shape[0]))
            _launch.CompiledCache.run(entry, (*descs, *tail), index)
        else:
            _launch_tma(a, b, bias, out, pre, meta, plan.tuned, key)
        return out
    entry = _LAUNCHES.get(key)
    if entry is not None:
        plan.launches[local] = entry
        _launch.CompiledCache.run(entry, addresses + plan.ints, index)
        return out
    if plan.tuned:
        recorder = _launch.GridRecorder(grid)
        compiled = _matmul_tuned[recorder](*args, **meta)
        tile = {name: recorder.meta[name] for name in MATMUL_FIXED_TILE}
        _log.debug("matmul M=%d N=%d K=%d %s: the autotuner chose %s", M, N, K, a.dtype, tile)
    else:
        tile = MATMUL_FIXED_TILE
        compiled = _matmul_kernel[grid(tile)](*args, **meta, **tile, EVEN_K=K % tile["BLOCK_K"] == 0,
                                              num_stages=MATMUL_FIXED_STAGES, num_warps=MATMUL_FIXED_WARPS)
    constexprs = {**meta, **tile, "EVEN_K": K % tile["BLOCK_K"] == 0}
    _LAUNCHES.put(key, compiled, (*grid(tile), 1), tuple(constexprs[n] for n in _CONSTEXPR_NAMES))
    return out


def _launch_tma(a, b, bias, out, pre, meta, tuned: bool, key=None) -> None:
    """Launch through Triton's path (tuning or compiling as needed); keep the kernel for ``key``."""
    compiled, tile, grid = _matmul_tma.launch_tma(
        a, b, bias, meta["ACTIVATION"], out, pre, meta["INPUT_PRECISION"], meta["UPCAST_OPERANDS"],
        matmul_m_bucket(a.shape[0]),
        INTERPRETED, tuned, matmul_tma_fixed_tile(a.element_size()), MATMUL_TMA_FIXED_OPTIONS)
    if key is None:
        return
    values = {**meta, **tile, "A_MMAJOR": _matmul_tma.a_mmajor(a), "B_KMAJOR": _matmul_tma.b_kmajor(b),
              "NUM_SMS": _matmul_tma.num_sms(a.device.index)}
    _TMA_LAUNCHES.put(key, compiled, (grid, 1, 1), tuple(values[n] for n in _TMA_CONSTEXPR_NAMES), extra=tile)


def _torch_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
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
    return _torch_activation(y, activation)


def _activation_grad(grad: torch.Tensor, saved: torch.Tensor, activation: str | None) -> torch.Tensor:
    """dL/d(pre-activation) from dL/d(output); ``saved`` is the output for ReLU, else the pre-activation."""
    if activation is None:
        return grad
    if activation == "relu":
        return elementwise(RELU_GRAD, grad, saved)  # torch's threshold_backward: NaN passes
    wide = torch.promote_types(saved.dtype, torch.float32)  # fp32 math for half types, fp64 kept
    x = saved.to(wide)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(x * act.SQRT_1_2.value))
        pdf = torch.exp(-0.5 * x * x) * (0.5 * act.SQRT_2_OVER_PI.value)  # 1/sqrt(2 pi)
        d = cdf + x * pdf
    elif activation == "gelu_tanh":
        z = act.SQRT_2_OVER_PI.value * (x + act.GELU_TANH_CUBIC.value * x ** 3)
        t = torch.tanh(z)
        dz = act.SQRT_2_OVER_PI.value * (1 + 3 * act.GELU_TANH_CUBIC.value * x * x)
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dz
    else:  # silu
        s = torch.sigmoid(x)
        d = s * (1 + x * (1 - s))
    return (grad.to(wide) * d).to(grad.dtype)


def _validate(a, b, bias, activation, name: str):
    for arg, value in (("a", a), ("b", b)):
        if not isinstance(value, torch.Tensor):
            raise DTypeError(f"{name}(): argument '{arg}' must be a Tensor, got {type(value).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise DTypeError(f"{name}(): bias must be a Tensor or None, got {type(bias).__name__}")
    if activation not in (None, *ACTIVATION_NAMES):
        raise ArgumentError(f"{name}(): unknown activation {activation!r}; choose from None, "
                         f"{', '.join(repr(x) for x in ACTIVATION_NAMES)}")
    for arg, value in (("a", a), ("b", b), ("bias", bias)):
        if value is not None and value.dtype not in MATMUL_DTYPES:
            raise DTypeError(f"{name}(): argument '{arg}' has dtype {value.dtype}; supported: "
                             f"{', '.join(str(d) for d in MATMUL_DTYPES)}")
    if b.dtype != a.dtype or (bias is not None and bias.dtype != a.dtype):
        raise DTypeError(f"{name}(): a, b and bias must share a dtype; got a {a.dtype}, b {b.dtype}"
                         + (f", bias {bias.dtype}" if bias is not None else ""))
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


def _forward(a2: torch.Tensor, b: torch.Tensor, bias, activation, store_pre: bool):
    M, N = a2.shape[0], b.shape[1]
    out = torch.empty((M, N), dtype=a2.dtype, device=a2.device)
    pre = torch.empty_like(out) if store_pre else None
    if out.numel() == 0:
        return out, pre
    if a2.shape[1] == 0:  # K == 0: the product is zeros
        z = torch.zeros_like(out) + (bias if bias is not None else 0)
        if pre is not None:
            pre.copy_(z)
        out.copy_(_torch_activation(z, activation))
        return out, pre
    launch_matmul(a2, b, bias, activation, out, pre)
    return out, pre


@torch.library.custom_op("fusedkit::matmul", mutates_args=())
def matmul_op(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              store_pre: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``act(a @ b + bias)`` and, when ``store_pre``, the pre-activation (else an empty tensor)."""
    out, pre = _forward(a, b, bias, activation, store_pre)
    return out, pre if pre is not None else out.new_empty(0)


@matmul_op.register_fake
def _(a, b, bias, activation, store_pre):
    out = a.new_empty((a.shape[0], b.shape[1]))
    return out, a.new_empty(out.shape if store_pre else (0,))


def _setup_context(ctx, inputs, output):
    a, b, bias, activation, store_pre = inputs
    out, pre = output
    ctx.activation = activation
    ctx.has_bias = bias is not None
    # ReLU's backward needs only the output; GELU/SiLU need the pre-activation,
    # saved in the input dtype (never an fp32 copy); no activation needs neither.
    saved = pre if activation in _NEEDS_PRE else out if activation == "relu" else None
    ctx.save_for_backward(a, b, saved)


def _backward(ctx, grad_out, _grad_pre):
    a2, b, saved = ctx.saved_tensors
    g = _activation_grad(grad_out, saved, ctx.activation).contiguous()
    grad_a = grad_b = grad_bias = None
    # Through the public entry: a repeated backward takes its eager fast path (a kept plan).
    if ctx.needs_input_grad[0]:
        grad_a = matmul(g, b.t())
    if ctx.needs_input_grad[1]:
        grad_b = matmul(a2.t(), g)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        # PyTorch sums half types with an fp32 accumulator and rounds once, as nn.Linear's own
        # bias gradient does (an fp32 sum and a cast were a second kernel and launch).
        grad_bias = g.sum(0)
    return grad_a, grad_b, grad_bias, None, None


matmul_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerMatmul(torch.autograd.Function):
    """An eager matmul that needs a gradient: the registered op's autograd (same saved
    tensors, same backward) without the dispatcher and its host time. Only ``out`` is an output; the pre-activation, when kept, is saved as an intermediate."""

    @staticmethod
    def forward(ctx, a2, b, bias, activation, store_pre, recipe=None):
        if store_pre:
            out, pre = _forward(a2, b, bias, activation, store_pre)
        elif recipe is not None:  # a repeated signature's kept plan
            out, pre = recipe.launch(a2, b, bias), None
        else:  # grad is off in here: a repeated call takes the eager fast path
            out, pre = matmul(a2, b, bias, activation), None
        _setup_context(ctx, (a2, b, bias, activation, store_pre), (out, pre))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled() and ctx.activation in _NEEDS_PRE:
            # The saved pre-activation carries no graph, so a second derivative would
            # silently miss its term.
            raise NotDifferentiableError(f"matmul(): double backward through activation={ctx.activation!r} is not "
                                      "supported (None and 'relu' are)")
        return (*_backward(ctx, grad_out, None), None)


class _FuncMatmul(torch.autograd.Function):
    """A 2-D matmul under a ``torch.func`` transform: the registered op's saved tensors and
    backward, with the ``setup_context`` and vmap rule the transforms need. Returns
    ``(out, pre)`` as the op does (``pre`` empty unless kept)."""

    @staticmethod
    def forward(a2, b, bias, activation, store_pre):
        if functorch_active():  # a transform below this one (vmap inside grad): its rule runs next
            return _FuncMatmul.apply(a2, b, bias, activation, store_pre)
        out, pre = _forward(a2, b, bias, activation, store_pre)
        return out, pre if pre is not None else out.new_empty(0)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, grad_out, grad_pre):
        return _backward(ctx, grad_out, grad_pre)

    @staticmethod
    def vmap(info, in_dims, a2, b, bias, activation, store_pre):
        a_dim, b_dim, bias_dim = in_dims[:3]
        if b_dim is None and bias_dim is None:
            # Only ``a`` is batched: the batch joins its rows, one launch.
            a3 = a2.movedim(a_dim, 0)
            batch, m = a3.shape[0], a3.shape[1]
            out, pre = _FuncMatmul.apply(a3.reshape(batch * m, a3.shape[2]), b, bias, activation, store_pre)
            out = out.view(batch, m, out.shape[1])
            return (out, pre.view(batch, m, -1) if store_pre else pre), (0, 0 if store_pre else None)
        parts = []
        for i in range(info.batch_size):
            pick = [t if d is None else t.select(d, i) for t, d in ((a2, a_dim), (b, b_dim), (bias, bias_dim))]
            parts.append(_FuncMatmul.apply(*pick, activation, store_pre))
        out = torch.stack([p[0] for p in parts])
        pre = torch.stack([p[1] for p in parts]) if store_pre else parts[0][1]
        return (out, pre), (0, 0 if store_pre else None)


def _needs_grad(a, b, bias) -> bool:
    """Whether autograd must record this call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, bias))


def _apply(a2, b, bias, activation):
    """One 2-D matmul on the best path for the tensors' device.

    Eager calls launch directly (through :class:`_EagerMatmul` when autograd must record
    them); tracing goes through the registered op.
    """
    if backend_for(a2.device) == "torch":
        return matmul_reference(a2, b, bias, activation)
    needs_grad = _needs_grad(a2, b, bias)
    if functorch_active() and not torch.compiler.is_compiling():
        return _FuncMatmul.apply(a2, b, bias, activation, activation in _NEEDS_PRE)[0]
    if tracing((a2, b, bias), None):
        return matmul_op(a2, b, bias, activation, needs_grad and activation in _NEEDS_PRE)[0]
    if needs_grad:
        return _EagerMatmul.apply(a2, b, bias, activation, activation in _NEEDS_PRE)
    return _forward(a2, b, bias, activation, store_pre=False)[0]


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """``act(a @ b + bias)`` in one kernel: bias and activation run on the accumulator.

    Args:
        a: (..., M, K), or (K,) for a (N,) result as ``torch.matmul`` gives. Leading dims are
            flattened, without a copy when the strides allow.
        b: (K, N), any strides (an ``nn.Linear`` weight's ``.t()`` is read as is).
        bias: optional (N,).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu".

    Returns:
        (..., M, N) in the inputs' dtype: float16, bfloat16, float32 (TF32 when
        PyTorch's matmul setting allows it, see ``tf32_enabled``; else three TF32 products
        each, with fp32-sized errors, or fp32 multiply-adds with ``FUSEDKIT_FP32_MATMUL=ieee``)
        or float64.
        Accumulates in fp32 (fp64 for float64). Differentiable in a, b and bias.

    Raises:
        ShapeError: ``a`` with fewer than 2 dims, ``b`` not 2-D, mismatched K, or a bias not (N,).
        DTypeError: a non-tensor, an unsupported dtype, or operands of different dtypes.
        DeviceError: operands on different devices.
        ArgumentError: an unknown activation.

    Each is raised before any launch. Under ``torch.autocast`` the operands are cast to
    the autocast dtype first, as ``F.linear`` casts them (float64 stays float64). Under
    ``torch.profiler`` each call is a ``fusedkit::matmul`` range.
    """
    if not torch.compiler.is_compiling() and _profiling():
        with torch.profiler.record_function("fusedkit::matmul"):
            return _matmul(a, b, bias, activation)
    return _matmul(a, b, bias, activation)


def _matmul(a, b, bias, activation):
    if isinstance(a, torch.Tensor) and a.device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(a.device.type):
        a, b, bias = _autocast(a.device.type, a, b, bias)
    key = _call_key(a, b, bias, activation)
    if key is not None:
        recipe = _RECIPES.get(key)
        if recipe is not None:
            return recipe.run(a, b, bias)
    _validate(a, b, bias, activation, "matmul")
    if not torch.compiler.is_compiling():
        a, b, bias = _resolve_neg(a), _resolve_neg(b), _resolve_neg(bias)
    lead = a.shape[:-1]
    a2 = a.reshape(lead.numel(), a.shape[-1])  # a view whenever the strides allow
    out = _apply(a2, b, bias, activation)
    if key is not None:
        _remember(key, a2, b, bias, activation, lead, out)
    return _with_lead(out, lead)


#: Device types whose autocast state ``matmul`` follows.
_AUTOCAST_DEVICES = ("cuda", "cpu")


def _autocast(device_type: str, *tensors):
    """The tensors as autocast's lower-precision policy (``F.linear``'s) casts them: floating
    tensors other than float64 to the autocast dtype; anything else as it is."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def _with_lead(out: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """The (M, N) result under ``a``'s leading dims. A 2-D ``a`` gets the result itself, not
    a view of it: an autograd Function's forward returning a view would make the caller's
    in-place ops on it fail."""
    return out if len(lead) == 1 else out.view(*lead, out.shape[1])  # lead () for a 1-D a: (N,)


def _resolve_neg(t: torch.Tensor | None) -> torch.Tensor | None:
    """A lazily negated view (``z.conj().imag``) holds the un-negated values in memory."""
    return t.resolve_neg() if t is not None and t.is_neg() else t


# --- The eager fast path (as for the elementwise ops; see docs/design.md) ---------------
# A matmul call whose signature (tensor types, dtypes, devices, shapes, strides, the
# activation, and the settings the plan reads) was validated before reuses its
# validation and launch plan; per call it allocates the result and launches.

_RECIPES: dict = {}
_launch.register_cache(_RECIPES.clear)


def _call_key(a, b, bias, activation) -> tuple | None:
    if (torch.compiler.is_compiling() or _dispatch_mode_active() or functorch_active()
            or not (activation is None or type(activation) is str)):
        return None
    key = [activation, autotune_enabled(), matmul_kernel_setting()]
    requires_grad = False
    for t in (a, b, bias):
        if t is None:
            key.append(None)
            continue
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None  # other types: the full path validates (or traces) them
        if t.is_neg():
            return None
        requires_grad = requires_grad or t.requires_grad
        key += (t.dtype, t.device, t.shape, t.stride())
    key.append(requires_grad and torch.is_grad_enabled())  # as _needs_grad: recorded by autograd or not
    if a.dtype == torch.float32:  # the precision settings matter to fp32 only (and cost ~1 us to read)
        key.append(fp32_precision())
    return tuple(key)


@dataclass(frozen=True)
class _Recipe:
    """The prepared eager launch of one validated matmul call signature."""

    m: int
    k: int
    n: int
    lead: torch.Size
    dtype: torch.dtype
    device: torch.device
    activation: str | None
    plan: _Plan
    #: Autograd records the call: it runs through :class:`_EagerMatmul` (whose forward
    #: launches with this plan unless the pre-activation is kept), without the full path's
    #: validation and checks (they cost LinearReLU's forward with autograd 135 us of host
    #: time against 44 without, 4096^3 bf16 on the H200).
    grad: bool

    def run(self, a, b, bias) -> torch.Tensor:
        a2 = a if a.dim() == 2 else a.reshape(self.m, self.k)
        if self.grad:
            store_pre = self.activation in _NEEDS_PRE
            out = _EagerMatmul.apply(a2, b, bias, self.activation, store_pre, None if store_pre else self)
        else:
            out = self.launch(a2, b, bias)
        return _with_lead(out, self.lead)

    def launch(self, a2, b, bias) -> torch.Tensor:
        """The (M, N) result of a 2-D call, launched with the kept plan."""
        out = torch.empty((self.m, self.n), dtype=self.dtype, device=self.device)
        launch_matmul(a2, b, bias, self.activation, out, None, self.plan)
        return out


def _remember(key, a2, b, bias, activation, lead, out) -> None:
    """Keep the plan of a validated eager call whose signature ``key`` can repeat; ``out`` is
    the (M, N) result it launched into (a recipe allocates its like)."""
    m, k = a2.shape
    n = b.shape[1]
    if backend_for(a2.device) == "torch" or m * n * k == 0 or not _launch.enabled():
        return  # the PyTorch path, or an empty product: nothing to launch
    if len(_RECIPES) >= CALL_CACHE_SIZE:
        _RECIPES.clear()
    _RECIPES[key] = _Recipe(m, k, n, lead, a2.dtype, a2.device, activation,
                            plan_matmul(a2, b, bias, activation, out), _needs_grad(a2, b, bias))


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
    if x.device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(x.device.type):
        x, weight, bias = _autocast(x.device.type, x, weight, bias)
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
            raise ShapeError(f"linear_relu(): a bias of shape {tuple(bias.shape)} does not broadcast to the "
                             f"product's shape {product}, as F.linear requires")
    y = matmul(x, weight[:, None]).squeeze(-1) if weight.dim() == 1 else matmul(x, weight.t())
    if bias is None:
        return dispatch(ADD_RELU, (y, 0), 1, None)
    out = dispatch(ADD_RELU, (y, bias), 1, None)
    return out if out.shape == y.shape else out.reshape(y.shape)
