"""The host side of the Hopper TMA matmul (:mod:`fusedkit.kernels.matmul_tma`).

TMA needs 16-byte-aligned bases and row strides and unit inner strides:
:func:`layout_ok` checks dtype, device and strides, the launcher the bases per call;
anything else runs the pointer kernel. :func:`descriptors` and :func:`encoded_args`
build the tensor descriptors (as objects for Triton's launch, or encoded for a kept
launch); :func:`launch_tma` tunes or launches.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernels.matmul_tma import matmul_tma_kernel
from . import launch
from .configs import COMPILER_OPTIONS, MATMUL_TMA_INTERPRETER_TILE, matmul_tma_configs, prune_tma_configs

__all__ = [
    "a_mmajor",
    "b_kmajor",
    "encoded_args",
    "layout_ok",
    "launch_tma",
    "tail_args",
    "transposed_product",
    "TMA_DTYPES",
]

#: Operand dtypes the TMA kernel takes (fp32 runs TF32 or IEEE as set; fp64 has no wgmma).
TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TMA_ALIGN_BYTES = 16


@functools.cache
def _has_tma(index: int) -> bool:
    """Hopper and datacenter Blackwell: TMA and the ~227 KiB of shared memory the configs assume."""
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


#: TMA coordinates and descriptor sizes are 32-bit.
TMA_MAX_DIM = 2**31 - 1


def _rows_ok(t: torch.Tensor) -> bool:
    """A (rows, cols) layout TMA can address: unit inner stride, a 16-byte row stride that
    steps past the row (no broadcast or overlapping rows), 32-bit sizes."""
    rows, cols = t.shape
    return (
        t.stride(1) == 1
        and t.stride(0) >= max(cols, 1)
        and rows <= TMA_MAX_DIM
        and cols <= TMA_MAX_DIM
        and (t.stride(0) * t.element_size()) % TMA_ALIGN_BYTES == 0
    )


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


def tail_args(a, b, bias, out, m_bucket: int, colsum=None, gate=None) -> tuple:
    """The kernel's runtime arguments after the six descriptors."""
    return (
        bias if bias is not None else out,
        colsum if colsum is not None else out,
        gate.bias2 if gate is not None and gate.bias2 is not None else out,
        a.shape[0],
        b.shape[1],
        a.shape[1],
        m_bucket,
        bias.stride(0) if bias is not None else 0,
    )


def layout_ok(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None, interpreted: bool, gate=None
) -> bool:
    """Whether dtype, device and strides let the TMA kernel run ``out = act(a @ b + bias)`` (and
    ``gate``'s gated variant: its ``b2`` is laid out as ``b``); the bases' 16-byte alignment is
    the caller's per-call check."""
    if a.dtype not in TMA_DTYPES:
        return False
    if not interpreted and (a.device.type != "cuda" or not _has_tma(a.device.index)):
        return False
    a_view = a.t() if a_mmajor(a) else a
    b_view = b.t() if b_kmajor(b) else b
    kept = tuple(t for t in (pre, None if gate is None else gate.pre2) if t is not None)
    return all(_rows_ok(t) for t in (a_view, b_view, out) + kept)


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def descriptors(a, b, out, pre, tile: dict, gate=None):
    """TMA descriptors of one launch for ``tile`` (block shapes follow the tile): a, b, c, pre,
    b2 and pre2 (b's and pre's without ``gate``)."""
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    store_n = bn // 2 if tile["SUBTILE"] else bn
    if a_mmajor(a):
        v = a.t()  # (K, M) row-major
        a_desc = TensorDescriptor(v, list(v.shape), list(v.stride()), [bk, bm])
    else:
        a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, bk])
    b_descs = []
    for t in (b, b if gate is None else gate.b2):
        if b_kmajor(t):
            w = t.t()  # (N, K) row-major: the nn.Linear weight itself
            b_descs.append(TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, bk]))
        else:
            b_descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [bk, bn]))
    c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, store_n])
    p = pre if pre is not None else out
    pre_desc = TensorDescriptor(p, list(p.shape), list(p.stride()), [bm, store_n])
    p2 = p if gate is None or gate.pre2 is None else gate.pre2
    pre2_desc = TensorDescriptor(p2, list(p2.shape), list(p2.stride()), [bm, store_n])
    return a_desc, b_descs[0], c_desc, pre_desc, b_descs[1], pre2_desc


def row_major(t: torch.Tensor, flip: bool) -> tuple:
    """(address, sizes, strides) of the row-major 2-D view a descriptor reads: ``t`` itself,
    or with ``flip`` its transpose (as ``descriptors`` builds, without making the view)."""
    (rows, cols), (s0, s1) = t.shape, t.stride()
    return (t.data_ptr(), (cols, rows), (s1, s0)) if flip else (t.data_ptr(), (rows, cols), (s0, s1))


def encoded_args(a, b, out, pre, layouts: tuple, gate=None) -> list:
    """The six descriptor parameters as Triton's C launcher takes them (see
    ``launch.tensor_map_args``): the same views as :func:`descriptors`, with the block
    shapes and swizzles the compiled kernel recorded (``layouts``), encoded once per
    address, shape and strides."""
    p = pre if pre is not None else out
    b2 = b if gate is None else gate.b2
    views = (
        row_major(a, a_mmajor(a)),
        row_major(b, b_kmajor(b)),
        row_major(out, False),
        row_major(p, False),
        row_major(b2, b_kmajor(b2)),
        row_major(p if gate is None or gate.pre2 is None else gate.pre2, False),
    )
    args = []
    for (address, shape, strides), layout in zip(views, layouts):
        args += launch.tensor_map_args(address, shape, strides, layout)
    return args


def _set_block_shapes(nargs):
    """Autotune pre-hook: give the descriptors the block shapes of the config being run."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    store_n = bn // 2 if nargs["SUBTILE"] else bn
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_MMAJOR"] else [bm, bk]
    nargs["b_desc"].block_shape = nargs["b2_desc"].block_shape = [bn, bk] if nargs["B_KMAJOR"] else [bk, bn]
    for name in ("c_desc", "pre_desc", "pre2_desc"):
        nargs[name].block_shape = [bm, store_n]


# INPUT_PRECISION in the key: a tile TF32 picked may not fit tf32x3's shared memory (on the
# H200 a TF32 tuning result reused with TF32 off raises OutOfResources).
# The dtype is in the key through bias_ptr and colsum_ptr, the tensor arguments.
matmul_tma_tuned = triton.autotune(
    configs=matmul_tma_configs(_set_block_shapes),
    # (GRAD_ACT: its pre tile takes shared memory, so a plain GEMM's tile may not fit it)
    key=["M_BUCKET", "N", "K", "A_MMAJOR", "B_KMAJOR", "INPUT_PRECISION", "GRAD_ACT", "PROLOGUE", "GATED"],
    prune_configs_by={"early_config_prune": prune_tma_configs},
    reset_to_zero=["colsum_ptr"],  # (as the pointer kernel's tuner: runtime.matmul)
)(matmul_tma_kernel)


def grid_for(M: int, N: int, tile: dict, sms: int) -> int:
    return min(sms, triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"]))


def launch_tma(
    a,
    b,
    bias,
    activation_code: int,
    out,
    pre,
    precision: str,
    upcast: bool,
    m_bucket: int,
    interpreted: bool,
    tuned: bool,
    fixed_tile: dict,
    fixed_options: dict,
    grad_act: bool = False,
    colsum=None,
    prologue_code: int = 0,
    gate=None,
):
    """Launch the TMA kernel; returns (what Triton returned, the tile used, the grid).
    ``grad_act``: the backward epilogue, ``pre`` read (``runtime.matmul.activation_grad``);
    ``gate``: the gated epilogue (``runtime.matmul.Gate``)."""
    M, N = a.shape[0], b.shape[1]
    sms = 4 if interpreted else num_sms(a.device.index)
    tail = tail_args(a, b, bias, out, m_bucket, colsum, gate)
    meta = dict(
        HAS_BIAS=bias is not None,
        ACTIVATION=activation_code,
        STORE_PRE=pre is not None and not grad_act,
        GRAD_ACT=grad_act,
        SUM_ROWS=colsum is not None,
        PROLOGUE=prologue_code,
        GATED=gate is not None,
        INPUT_PRECISION=precision,
        UPCAST_OPERANDS=upcast,
        NUM_SMS=sms,
    )
    majors = dict(A_MMAJOR=a_mmajor(a), B_KMAJOR=b_kmajor(b))
    if tuned and not interpreted:
        descs = descriptors(a, b, out, pre, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SUBTILE=False), gate)
        recorder = launch.GridRecorder(lambda m: (grid_for(M, N, m, sms),))
        compiled = matmul_tma_tuned[recorder](*descs, *tail, **meta, **majors, **COMPILER_OPTIONS)
        tile = {name: recorder.meta[name] for name in fixed_tile}
        return compiled, tile, grid_for(M, N, tile, sms)
    tile = MATMUL_TMA_INTERPRETER_TILE if interpreted else fixed_tile
    descs = descriptors(a, b, out, pre, tile, gate)
    grid = grid_for(M, N, tile, sms)
    options = {} if interpreted else fixed_options
    compiled = matmul_tma_kernel[(grid,)](*descs, *tail, **meta, **majors, **tile, **options, **COMPILER_OPTIONS)
    return compiled, tile, grid
