"""Compile fusedkit's kernels for a GPU target on any machine, GPU or not.

Triton can lower a kernel for ``sm_90`` without a GPU; tests use this to check
the generated IR (for instance that offsets are 64-bit exactly when needed).
Must run in a process where ``TRITON_INTERPRET`` is off.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import activations
from ..kernels.elementwise import elementwise_kernel
from ..kernels.matmul import matmul_kernel
from ..kernels.matmul_tma import matmul_tma_kernel
from ..kernels.norm import norm_backward_kernel, norm_forward_kernel
from ..registry import ElementwiseKernel
from .configs import COMPILER_OPTIONS
from .elementwise import launch_config
from .matmul import launch_config as matmul_config
from .norm import backward_launch, forward_launch
from .triton_api import ASTSource, GPUTarget, make_backend

#: Hopper (H100, H200): compute capability 9.0, 32-thread warps.
HOPPER = GPUTarget("cuda", 90, 32)

_TRITON_TYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
}
#: Divisibility that Triton's launcher specialises pointers and integers on.
ALIGNMENT = 16
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, float):
        return "fp32"
    return "i32" if _I32_MIN <= value <= _I32_MAX else "i64"


def _compile(kernel, args, meta: dict, num_warps: int, target: GPUTarget, num_stages: int | None = None):
    names = kernel.arg_names
    signature = {name: _arg_type(value) for name, value in zip(names, args)}
    signature.update({name: "constexpr" for name in meta})
    # What the JIT would specialise at launch: 16-byte aligned pointers (meta tensors
    # report address 0) and integers divisible by 16, except the kernel's do_not_specialize
    # arguments.
    fixed = {p.name for p in kernel.params if p.do_not_specialize}
    backend = make_backend(target)
    attrs = {
        (i,): backend.parse_attr("D")
        for i, (name, value) in enumerate(zip(names, args))
        if name not in fixed
        and (
            (isinstance(value, torch.Tensor) and value.data_ptr() % ALIGNMENT == 0)
            or (isinstance(value, int) and not isinstance(value, bool) and value % ALIGNMENT == 0)
        )
    }
    # Integers equal to 1 are compile-time constants at launch too (unless not specialised).
    constexprs = dict(meta)
    for name, value in zip(names, args):
        if name not in fixed and isinstance(value, int) and not isinstance(value, bool) and value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
            attrs.pop((names.index(name),), None)
    options = {"num_warps": num_warps, **COMPILER_OPTIONS}
    if num_stages is not None:
        options["num_stages"] = num_stages
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options)


def compile_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias,
    activation,
    out: torch.Tensor,
    tile: dict,
    num_warps: int = 4,
    num_stages: int = 3,
    target: GPUTarget = HOPPER,
):
    """Compile the matmul launch for ``out = act(a @ b + bias)`` with one tile config (meta tensors work)."""
    args, meta = matmul_config(a, b, bias, activation, out)
    meta = {**meta, "SPLIT_K": 1, **tile, "EVEN_K": a.shape[1] % tile["BLOCK_K"] == 0}  # SPLIT_K: the kernel's default
    return _compile(matmul_kernel, args, meta, num_warps, target, num_stages)


def compile_matmul_tma(
    dtype: torch.dtype,
    tile: dict,
    num_warps: int,
    num_stages: int,
    *,
    a_mmajor: bool = False,
    b_kmajor: bool = True,
    has_bias: bool = True,
    activation: str | None = "relu",
    store_pre: bool = False,
    precision: str | None = None,
    target: GPUTarget = HOPPER,
    grad_act: bool = False,
    prologue: str | None = None,
    gated: bool = False,
):
    """Compile the TMA matmul kernel for one config (sizes are runtime values; descriptors
    carry only dtype and block shape in the signature). ``precision``: the ``tl.dot``
    precision (default "tf32" for float32, else "ieee"). ``grad_act``: the backward epilogue
    (pre read, the column sums stored); ``prologue``: an activation on A's tiles as they load;
    ``gated``: the gated epilogue (``activation(a @ b + bias) * (a @ b2 + bias2)``)."""
    ty = _TRITON_TYPE[dtype]
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    store_n = bn // 2 if tile["SUBTILE"] else bn
    a_block = [bk, bm] if a_mmajor else [bm, bk]
    b_block = [bn, bk] if b_kmajor else [bk, bn]
    signature = {
        "a_desc": f"tensordesc<{ty}{a_block}>",
        "b_desc": f"tensordesc<{ty}{b_block}>",
        "c_desc": f"tensordesc<{ty}[{bm}, {store_n}]>",
        "pre_desc": f"tensordesc<{ty}[{bm}, {store_n}]>",
        "b2_desc": f"tensordesc<{ty}{b_block}>",
        "pre2_desc": f"tensordesc<{ty}[{bm}, {store_n}]>",
        "bias_ptr": "*" + ty,
        "colsum_ptr": "*fp32" if grad_act else "*" + ty,
        "bias2_ptr": "*" + ty,
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "M_BUCKET": "i32",
        "stride_bias": "i32",
    }
    constexprs = dict(
        HAS_BIAS=has_bias,
        ACTIVATION=activations.ACTIVATIONS[activation],
        STORE_PRE=store_pre,
        GRAD_ACT=grad_act,
        SUM_ROWS=grad_act,
        PROLOGUE=activations.ACTIVATIONS[prologue],
        GATED=gated,
        A_MMAJOR=a_mmajor,
        B_KMAJOR=b_kmajor,
        INPUT_PRECISION=precision or ("tf32" if dtype == torch.float32 else "ieee"),
        UPCAST_OPERANDS=False,
        NUM_SMS=132,
        **tile,
    )
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(matmul_tma_kernel, signature, constexprs=constexprs, attrs={})
    return triton.compile(
        source, target=target, options={"num_warps": num_warps, "num_stages": num_stages, **COMPILER_OPTIONS}
    )


def compile_elementwise(
    kernel: ElementwiseKernel,
    operands: tuple,
    out: torch.Tensor,
    param=1,
    target: GPUTarget = HOPPER,
    out2: torch.Tensor | None = None,
):
    """Compile the launch ``elementwise(kernel, *operands, out=out)`` would make (``out2``: a
    two-output kernel's second result, as ``run_pair`` passes it).

    ``operands`` and ``out`` may be meta tensors (``device="meta"``), so sizes past
    2**31 elements cost no memory. Returns Triton's compiled kernel; its ``asm``
    dict holds the ``ttir``, ``ttgir``, ``llir`` and ``ptx``.
    """
    _, args, meta = launch_config(kernel, operands, param if kernel.param else None, out, out2=out2)
    num_warps = meta.pop("num_warps")
    for name in COMPILER_OPTIONS:  # given to _compile as options, not constants
        meta.pop(name)
    return _compile(elementwise_kernel, args, meta, num_warps, target)


def compile_norm(x2: torch.Tensor, residual2, weight, bias, rms: bool, backward: bool = False, target=HOPPER):
    """Compile the forward (or backward) launch of a normalisation of the rows of 2-D ``x2``
    (``residual2``: add + norm), as :mod:`fusedkit.runtime.norm` makes it; meta tensors work."""
    rows, n = x2.shape

    def like(dtype=None):
        return torch.empty((rows, n), dtype=dtype or x2.dtype, device=x2.device)

    stats = torch.empty(rows, dtype=torch.float32, device=x2.device)
    if backward:
        parts = torch.empty((4, n), dtype=torch.float32, device=x2.device)
        _, args, meta = backward_launch(
            like(),
            like(),
            weight,
            None if rms else stats,
            stats,
            like() if residual2 is not None else None,
            like(),
            parts if weight is not None else None,
            parts if bias is not None else None,
            rms,
            16,
        )
        kernel = norm_backward_kernel
    else:
        h = like() if residual2 is not None else None
        _, args, meta = forward_launch(
            x2, residual2, weight, bias, like(), h, None if rms else stats, stats, 1e-5, 1.0, rms
        )
        kernel = norm_forward_kernel
    num_warps = meta.pop("num_warps")
    return _compile(kernel, args, meta, num_warps, target)
