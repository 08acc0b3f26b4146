"""Checking fused kernels against PyTorch: one tolerance table, one comparison.

Used by fusedkit's own tests and meant for yours when you register a kernel:
compute the registry's reference in float64 (exact int64 for integer results),
round nothing, and compare the kernel's output within the result dtype's bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import ElementwiseKernel, result_dtype
from .runtime.matmul import tf32_enabled

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "NORM_TOLERANCES",
    "tolerance",
    "reference_result",
    "assert_matches_reference",
    "poisoned",
    "MATMUL_REL_ERR",
    "matmul_rel_err",
    "assert_rel_err",
    "matmul_error_floor",
]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


#: Bounds per result dtype for one elementwise op computed in fp32 (fp64 for
#: float64) and rounded once on the store. bfloat16's rtol allows one ulp (2**-7)
#: because Triton's interpreter rounds fp32 -> bf16 by truncation; fp16 allows one
#: ulp (2**-10). Integers are exact.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
    torch.float32: Tolerance(atol=1e-5, rtol=1.3e-6),
    torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
    torch.int32: Tolerance(atol=0, rtol=0),
    torch.int64: Tolerance(atol=0, rtol=0),
}


#: Bounds per result dtype for a row normalisation (RMSNorm, LayerNorm) against a float64
#: reference: float32 statistics over the row, then one rounding of each output, whose
#: values reach several units (a weight of a few units times a normalised value): fp16 and
#: bf16 allow one ulp of the largest, fp32 a relative 1e-5 of it.
NORM_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=4e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=3e-2, rtol=1.6e-2),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float64: Tolerance(atol=1e-12, rtol=1e-12),
}


#: Bounds on ``||out - ref|| / ||ref||`` for a matmul against a float64 reference:
#: one rounding of the output plus fp32 accumulation; TF32 products (10-bit
#: mantissas) land near 3e-4, so fp32 allows 2e-3 when TF32 may be on.
MATMUL_REL_ERR: dict[torch.dtype, float] = {
    torch.float16: 5e-3,
    torch.bfloat16: 1.5e-2,
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}
MATMUL_REL_ERR_TF32 = 2e-3


def matmul_rel_err(dtype: torch.dtype) -> float:
    """The relative-error bound for a matmul result of ``dtype`` on this machine's settings."""
    if dtype == torch.float32 and tf32_enabled():
        return MATMUL_REL_ERR_TF32
    return MATMUL_REL_ERR[dtype]


def matmul_error_floor(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """``eps(dtype) * || |a| @ |b| + |bias| ||`` in float64: as ``assert_rel_err``'s floor,
    results an activation sends far below the size of their products (the SiLU or GELU of a
    very negative input) are held to an absolute error on that scale, where their relative
    error says nothing. (The H200 fuzz, 2026-12-03: float64's -0 against fp32's -2.9e-29
    for a GELU-tanh of -9.08, relative error 2.5e9; a float16 SiLU output of about 1e-9
    rounded to 0, relative error 1.) Typical results are unaffected: there ``||expected||``
    exceeds the floor."""
    wide = [None if t is None else t.detach().to("cpu", torch.float64).abs() for t in (a, b, bias)]
    scale = wide[0] @ wide[1] + (wide[2] if wide[2] is not None else 0)
    return torch.finfo(a.dtype).eps * scale.norm().item()


def assert_rel_err(actual: torch.Tensor, expected: torch.Tensor, bound: float, floor: float = 0.0) -> None:
    """``||actual - expected|| / max(||expected||, floor) <= bound``, computed in float64;
    NaN fails. ``floor``: see ``matmul_error_floor``."""
    got = actual.detach().to("cpu", torch.float64)
    ref = expected.detach().to("cpu", torch.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not got.isnan().any(), "NaN in the result"
    denom = max(ref.norm().item(), floor) or 1.0
    err = (got - ref).norm().item() / denom
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g}"


def tolerance(dtype: torch.dtype) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype}; known: {list(TOLERANCES)}") from None


def _widen(value, wide: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=wide)
    return value


def reference_result(kernel: ElementwiseKernel, operands, param=None) -> torch.Tensor:
    """The registry reference on CPU in float64 (int64 for integer results)."""
    dtype = result_dtype(tuple(operands))
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    args = tuple(_widen(v, wide) for v in operands)
    if kernel.param is not None:
        args += (kernel.param_default if param is None else param,)
    return kernel.reference(*args)


def assert_matches_reference(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, check_signed_zero: bool = True
) -> None:
    """``actual`` (any device) equals the wide ``expected`` within ``dtype``'s bounds.

    NaN must meet NaN, infinities must match, and with ``check_signed_zero`` a
    zero must carry the reference's sign (``relu(-0.0)`` is ``-0.0``).
    """
    dtype = dtype or actual.dtype
    tol = tolerance(dtype)
    got = actual.detach().to("cpu", expected.dtype)
    if dtype.is_floating_point and expected.is_floating_point():
        # Beyond the result dtype's range the result is what rounding gives: inf (fp32
        # silu(1e20) * 1e20 is inf in torch too, 1e40 in the float64 reference).
        big = expected.abs() > torch.finfo(dtype).max
        if big.any():
            expected = torch.where(big, expected.to(dtype).to(expected.dtype), expected)
    torch.testing.assert_close(
        got, expected.to(got.dtype).expand_as(got), atol=tol.atol, rtol=tol.rtol, equal_nan=True, check_dtype=False
    )
    if check_signed_zero and got.is_floating_point():
        zeros = expected.expand_as(got) == 0
        if zeros.any():
            assert torch.equal(torch.signbit(got[zeros]), torch.signbit(expected.expand_as(got)[zeros])), (
                "signed zeros differ from the reference"
            )


def poisoned(shape, dtype: torch.dtype, device, strides=None) -> torch.Tensor:
    """An output buffer filled with a value no kernel should leave behind:
    NaN for floats, the dtype's minimum for integers."""
    t = (
        torch.empty(shape, dtype=dtype, device=device)
        if strides is None
        else torch.empty_strided(shape, strides, dtype=dtype, device=device)
    )
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
    return t.fill_(fill)
