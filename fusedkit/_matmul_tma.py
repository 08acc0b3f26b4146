"""The Hopper matmul: persistent programs fed by the tensor-memory accelerator.

A second data-movement algorithm for the same ``act(a @ b + bias)`` as
``_matmul._matmul_kernel`` (whose epilogue it shares):
- operands arrive through TMA tensor descriptors (``triton.tools.tensor_descriptor``):
  one bulk copy per tile instead of per-thread address arithmetic, with
  out-of-range rows, columns and the K tail zero-filled by the hardware, so the
  loop carries no masks;
- ``NUM_SMS`` persistent programs walk the output tiles in grouped order, so the
  next tile's loads overlap this tile's epilogue;
- ``b`` is read in the layout it has: (K, N) row-major, or an ``nn.Linear``
  weight (N, K) row-major through ``b = weight.t()`` (``B_KMAJOR``), transposed
  in shared memory for the tensor cores, never copied; likewise ``a`` (M, K)
  row-major, or column-major (``A_MMAJOR``: ``x.t()`` of a row-major ``x``, as in
  the weight gradient ``x.t() @ grad`` of a backward pass);
- float32 on TF32 tensor cores (TF32 or tf32x3) with row-major ``a`` and ``b``
  computes the transposed product ``(b^T a^T)^T``, ``b^T`` rounded to TF32 in
  registers: TRANSPOSED_PRODUCT below.

TRANSPOSED_PRODUCT: TF32 ``wgmma`` reads its shared-memory operands K-major only, and a
row-major ``b`` is N-major, so Triton transposes it on a shared-memory store each K step.
As the register operand of ``b^T a^T`` it may have any layout: at M = K = N = 4096, TF32,
128 x 128 x 32 tiles, 3 stages, 8 warps, it runs 257.0 TFLOP/s against 71.0 for ``a @ b``
(H200, torch 2.11, triton 3.6), and rounding ``b`` to nearest in registers also halves the
max error / max |ref|.

TMA needs 16-byte-aligned bases and row strides and unit inner strides;
:func:`layout_ok` checks dtype, device and strides, the launcher the bases per call;
anything else runs the pointer kernel.
Layers: ``_matmul_tma_kernel``; ``layout_ok`` and ``launch_tma`` (the launcher);
the public functions live in ``_matmul``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _jit, _launch, activations as act
from .configs import MATMUL_TMA_INTERPRETER_TILE, matmul_tma_configs, prune_tma_configs

__all__ = ["a_mmajor", "b_kmajor", "encoded_args", "layout_ok", "launch_tma", "tail_args", "transposed_product",
           "TMA_DTYPES"]

#: Operand dtypes the TMA kernel takes (fp32 runs TF32 or IEEE as set; fp64 has no wgmma).
TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TMA_ALIGN_BYTES = 16


@triton.jit
def _store_tile(desc, acc, off_m, off_n, BLOCK_N: tl.constexpr, SUBTILE: tl.constexpr):
    """Store a (BLOCK_M, BLOCK_N) tile; SUBTILE stores it as two halves (less shared memory)."""
    dtype = desc.dtype
    if SUBTILE:
        halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        desc.store([off_m, off_n], left.to(dtype))
        desc.store([off_m, off_n + BLOCK_N // 2], right.to(dtype))
    else:
        desc.store([off_m, off_n], acc.to(dtype))


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, pre_desc, bias_ptr,
    M, N, K, M_BUCKET, stride_bias,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, A_MMAJOR: tl.constexpr,
    B_KMAJOR: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr, NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    # TF32 tensor cores read a shared-memory operand only K-major; a row-major b (N-major)
    # gets there through a transposing shared store. The transposed product b^T a^T instead
    # takes b^T from registers (any layout): see TRANSPOSED_PRODUCT.
    # (``transposed_product`` asks the same on the host.)
    TRANSPOSE: tl.constexpr = (a_desc.dtype == tl.float32 and INPUT_PRECISION != "ieee"
                               and not A_MMAJOR and not B_KMAJOR)
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _jit.grouped_tile(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if TRANSPOSE:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_MMAJOR:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            if UPCAST_OPERANDS:  # the interpreter's bf16 dot (see _matmul.launch_config)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if TRANSPOSE:
                bt = b.T
                if INPUT_PRECISION == "tf32":  # rounded in registers, so wgmma reads it there
                    bt = _jit.tf32_big(bt)
                acc = _jit.dot(bt, a.T, acc, INPUT_PRECISION, tl.float32)
            else:
                acc = _jit.dot(a, b, acc, INPUT_PRECISION, tl.float32)
        if TRANSPOSE:
            acc = acc.T
        # Epilogue on the accumulator, as in the pointer kernel.
        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(bias_ptr + cols * stride_bias, mask=cols < N, other=0.0)
            acc = acc + bias[None, :].to(tl.float32)
        if STORE_PRE:
            _store_tile(pre_desc, acc, off_m, off_n, BLOCK_N, SUBTILE)
        acc = act.apply_activation(acc, ACTIVATION)
        _store_tile(c_desc, acc, off_m, off_n, BLOCK_N, SUBTILE)


@functools.lru_cache(maxsize=None)
def _has_tma(index: int) -> bool:
    """Hopper and datacenter Blackwell: TMA and the ~227 KiB of shared memory the configs assume."""
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


#: TMA coordinates and descriptor sizes are 32-bit.
TMA_MAX_DIM = 2**31 - 1


def _rows_ok(t: torch.Tensor) -> bool:
    """A (rows, cols) layout TMA can address: unit inner stride, a 16-byte row stride that
    steps past the row (no broadcast or overlapping rows), 32-bit sizes."""
    rows, cols = t.shape
    return (t.stride(1) == 1 and t.stride(0) >= max(cols, 1) and rows <= TMA_MAX_DIM and cols <= TMA_MAX_DIM
            and (t.stride(0) * t.element_size()) % TMA_ALIGN_BYTES == 0)


def a_mmajor(a: torch.Tensor) -> bool:
    """Whether ``a`` (M, K) is the transpose of a row-major (K, M): column-major in memory."""
    return a.stride(0) == 1 and a.stride(1) != 1


def b_kmajor(b: torch.Tensor) -> bool:
    """Whether ``b`` (K, N) is an ``nn.Linear`` weight's transpose: (N, K) row-major in memory."""
    return b.stride(0) == 1 and b.stride(1) != 1


def transposed_product(a: torch.Tensor, b: torch.Tensor, precision: str) -> bool:
    """Whether the kernel computes ``(b^T a^T)^T`` (its ``TRANSPOSE``, the same test):
    float32 on TF32 tensor cores with row-major ``a`` and ``b``."""
    return a.dtype == torch.float32 and precision != "ieee" and not a_mmajor(a) and not b_kmajor(b)


def tail_args(a, b, bias, out, m_bucket: int) -> tuple:
    """The kernel's runtime arguments after the four descriptors."""
    return (bias if bias is not None else out, a.shape[0], b.shape[1], a.shape[1], m_bucket,
            bias.stride(0) if bias is not None else 0)


def layout_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None,
              interpreted: bool) -> bool:
    """Whether dtype, device and strides let the TMA kernel run ``out = act(a @ b + bias)``;
    the bases' 16-byte alignment is the caller's per-call check."""
    if a.dtype not in TMA_DTYPES:
        return False
    if not interpreted and (a.device.type != "cuda" or not _has_tma(a.device.index)):
        return False
    a_view = a.t() if a_mmajor(a) else a
    b_view = b.t() if b_kmajor(b) else b
    return all(_rows_ok(t) for t in (a_view, b_view, out) + ((pre,) if pre is not None else ()))


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def descriptors(a, b, out, pre, tile: dict):
    """TMA descriptors of one launch for ``tile`` (block shapes follow the tile)."""
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    store_n = bn // 2 if tile["SUBTILE"] else bn
    if a_mmajor(a):
        v = a.t()  # (K, M) row-major
        a_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), [bk, bm])
    else:
        a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, bk])
    if b_kmajor(b):
        w = b.t()  # (N, K) row-major: the nn.Linear weight itself
        b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk])
    else:
        b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [bk, bn])
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, store_n])
    p = pre if pre is not None else out
    pre_desc = TensorDescriptor(p, list(p.shape), list(p.stride()), [bm, store_n])
    return a_desc, b_desc, c_desc, pre_desc


def _row_major(t: torch.Tensor, flip: bool) -> tuple:
    """(address, sizes, strides) of the row-major 2-D view a descriptor reads: ``t`` itself,
    or with ``flip`` its transpose (as ``descriptors`` builds, without making the view)."""
    (rows, cols), (s0, s1) = t.shape, t.stride()
    return (t.data_ptr(), (cols, rows), (s1, s0)) if flip else (t.data_ptr(), (rows, cols), (s0, s1))


def encoded_args(a, b, out, pre, layouts: tuple) -> list:
    """The four descriptor parameters as Triton's C launcher takes them (see
    ``_launch.tensor_map_args``): the same views as :func:`descriptors`, with the block
    shapes and swizzles the compiled kernel recorded (``layouts``), encoded once per
    address, shape and strides."""
    views = (_row_major(a, a_mmajor(a)), _row_major(b, b_kmajor(b)), _row_major(out, False),
             _row_major(pre if pre is not None else out, False))
    args = []
    for (address, shape, strides), layout in zip(views, layouts):
        args += _launch.tensor_map_args(address, shape, strides, layout)
    return args


def _set_block_shapes(nargs):
    """Autotune pre-hook: give the descriptors the block shapes of the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    store_n = bn // 2 if nargs["SUBTILE"] else bn
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_MMAJOR"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_KMAJOR"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, store_n]
    nargs["pre_desc"].block_shape = [bm, store_n]


# INPUT_PRECISION in the key: a tile TF32 picked may not fit tf32x3's shared memory (on the
# H200 a TF32 tuning result reused with TF32 off raises OutOfResources).
# The dtype is in the key through bias_ptr, the only tensor argument.
_matmul_tma_tuned = triton.autotune(configs=matmul_tma_configs(_set_block_shapes),
                                    key=["M_BUCKET", "N", "K", "A_MMAJOR", "B_KMAJOR", "INPUT_PRECISION"],
                                    prune_configs_by={"early_config_prune": prune_tma_configs})(
    _matmul_tma_kernel)


def grid_for(M: int, N: int, tile: dict, sms: int) -> int:
    return min(sms, triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"]))


def launch_tma(a, b, bias, activation_code: int, out, pre, precision: str, upcast: bool, m_bucket: int,
               interpreted: bool, tuned: bool, fixed_tile: dict, fixed_options: dict):
    """Launch the TMA kernel; returns (what Triton returned, the tile used, the grid)."""
    M, N = a.shape[0], b.shape[1]
    sms = 4 if interpreted else num_sms(a.device.index)
    tail = tail_args(a, b, bias, out, m_bucket)
    meta = dict(HAS_BIAS=bias is not None, ACTIVATION=activation_code, STORE_PRE=pre is not None,
                INPUT_PRECISION=precision, UPCAST_OPERANDS=upcast, NUM_SMS=sms)
    majors = dict(A_MMAJOR=a_mmajor(a), B_KMAJOR=b_kmajor(b))
    if tuned and not interpreted:
        descs = descriptors(a, b, out, pre, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SUBTILE=False))
        recorder = _launch.GridRecorder(lambda m: (grid_for(M, N, m, sms),))
        compiled = _matmul_tma_tuned[recorder](*descs, *tail, **meta, **majors)
        tile = {name: recorder.meta[name] for name in fixed_tile}
        return compiled, tile, grid_for(M, N, tile, sms)
    tile = MATMUL_TMA_INTERPRETER_TILE if interpreted else fixed_tile
    descs = descriptors(a, b, out, pre, tile)
    grid = grid_for(M, N, tile, sms)
    options = {} if interpreted else fixed_options
    compiled = _matmul_tma_kernel[(grid,)](*descs, *tail, **meta, **majors, **tile, **options)
    return compiled, tile, grid
