"""relu(a @ b + bias): fusedkit (each kernel) against cuBLASLt's fused epilogue,
eager addmm + relu, and torch.compile of the eager composition."""

from __future__ import annotations

import pytest
import torch
import triton

import fusedkit
from fusedkit.bench import report as bench

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SHAPES = bench.MATMUL_SHAPES if ON_GPU else bench.CPU_MATMUL_SHAPES
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32,)
WHICH = ["fusedkit_pointer", "fusedkit_tma", "cublaslt_epilogue", "addmm_relu", "compiled"]


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
def test_matmul_relu(fk_settings, benchmark, m, n, k, dtype, which):
    a, b, bias = (torch.randn(*s, device=DEVICE).to(dtype) for s in ((m, k), (k, n), (n,)))
    benchmark.group = f"matmul_relu {str(dtype).removeprefix('torch.')} {m}x{n}x{k}"
    if which.startswith("fusedkit_"):
        fk_settings(matmul_kernel=which.removeprefix("fusedkit_"))
        fn = lambda: fusedkit.matmul_relu(a, b, bias)
    elif which == "compiled":
        if not ON_GPU:
            pytest.skip("torch.compile is a GPU peer")
        compiled = torch.compile(lambda a, b, bias: torch.relu(torch.addmm(bias, a, b)))
        fn = lambda: compiled(a, b, bias)
    else:
        fn = {
            "cublaslt_epilogue": lambda: torch._addmm_activation(bias, a, b),
            "addmm_relu": lambda: torch.relu(torch.addmm(bias, a, b)),
        }[which]
    info = benchmark.extra_info
    info.update(
        case=which,
        m=m,
        n=n,
        k=k,
        dtype=str(dtype),
        torch=torch.__version__,
        triton=triton.__version__,
        autotune=fusedkit.settings.current().autotune,
    )
    if ON_GPU:
        us = 1e3 * triton.testing.do_bench(fn, return_mode="median")
        info.update(gpu=torch.cuda.get_device_name(DEVICE), do_bench_median_us=us, tflops=2 * m * n * k / us / 1e6)
    else:
        info["note"] = "CPU: Triton interpreter at tiny sizes; not GPU times"

    def timed():
        fn()
        if ON_GPU:
            torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=10 if ON_GPU else 2, warmup_rounds=2 if ON_GPU else 1)
