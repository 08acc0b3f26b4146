"""What every report shares: the operand layouts and dtypes, a case's name, the timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import triton

from fusedkit import registry

LAYOUTS = ("contiguous", "bias", "transposed")
#: Columns of a ``bias`` layout: a typical hidden size.
BIAS_COLS = 4096
#: do_bench budget in milliseconds (it repeats until this much time is spent).
WARMUP_MS, REP_MS = 25, 100
CPU_REPEATS = 5
DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def make_operands(
    kernel: registry.ElementwiseKernel, layout: str, n: int, dtype, device, bias_cols: int = BIAS_COLS
) -> tuple:
    """Random operands of ``kernel`` in ``layout`` with ``n`` result elements."""

    def rnd(*shape):
        return (
            torch.randn(shape, device=device, dtype=torch.float32).to(dtype)
            if dtype.is_floating_point
            else torch.randint(-100, 100, shape, device=device, dtype=dtype)
        )

    if layout == "contiguous":
        ops = [rnd(n) for _ in range(kernel.arity)]
    elif layout == "bias":
        cols = min(bias_cols, n)
        ops = [rnd(n // cols, cols)] + [rnd(cols) for _ in range(kernel.arity - 1)]
    elif layout == "transposed":
        side = 1 << (max(n.bit_length() - 1, 0) // 2)
        rows = n // side
        ops = [rnd(side, rows).t()] + [rnd(rows, side) for _ in range(kernel.arity - 1)]
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    return tuple(ops)


def case_name(kernel: str, layout: str, dtype, n: int) -> str:
    """A case's label, as NVTX ranges and reports spell it."""
    return f"{kernel}-{layout}-{str(dtype).removeprefix('torch.')}-{n}"


def timer(device) -> Callable[[Callable[[], object]], float]:
    """Median time of ``fn`` in microseconds."""
    if device.type == "cuda":
        return lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    def cpu(fn):
        fn()
        times = []
        for _ in range(CPU_REPEATS):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)

    return cpu
