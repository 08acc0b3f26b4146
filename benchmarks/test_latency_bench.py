"""Small-tensor latency (issue 7): host time per call, fusedkit against torch.

Each timed round issues ``BATCH`` calls back to back and synchronises once, so
the round time / ``BATCH`` is the per-call cost that model code pays when it
launches small ops in a row. ``python -m fusedkit bench --latency`` prints the
same comparison as a table, with torch.compile and CUDA-graph replay beside it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

import fusedkit
from fusedkit.bench.latency import LATENCY_SIZES, LINEAR_SHAPES

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BATCH = 100 if ON_GPU else 2
SIZES = LATENCY_SIZES if ON_GPU else (2**10,)
SHAPES = LINEAR_SHAPES if ON_GPU else ((1, 64),)


def _batched(fn):
    def run():
        for _ in range(BATCH):
            fn()
        if ON_GPU:
            torch.cuda.synchronize()

    return run


def _bench(benchmark, fn, **info):
    benchmark.extra_info.update(
        info,
        calls_per_round=BATCH,
        torch=torch.__version__,
        triton=triton.__version__,
        backend=fusedkit.backend_for(DEVICE),
    )
    if ON_GPU:
        benchmark.extra_info["gpu"] = torch.cuda.get_device_name(DEVICE)
    else:
        benchmark.extra_info["note"] = "CPU path at tiny sizes; not GPU times"
    benchmark.pedantic(_batched(fn), rounds=20 if ON_GPU else 2, warmup_rounds=2 if ON_GPU else 1)
    benchmark.extra_info["us_per_call"] = benchmark.stats.stats.median / BATCH * 1e6


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("which", ["torch.add", "relu(x + y)", "fusedkit.add", "fusedkit.add_relu"])
def test_elementwise_latency(benchmark, which, dtype, n):
    x, y = (torch.randn(n, device=DEVICE).to(dtype) for _ in range(2))
    fn = {
        "torch.add": lambda: torch.add(x, y),
        "relu(x + y)": lambda: torch.relu(x + y),
        "fusedkit.add": lambda: fusedkit.add(x, y),
        "fusedkit.add_relu": lambda: fusedkit.add_relu(x, y),
    }[which]
    benchmark.group = f"per call: add_relu {str(dtype).removeprefix('torch.')} n={n}"
    _bench(benchmark, fn, case=which, n=n, dtype=str(dtype))


@pytest.mark.parametrize("m,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("which", ["fusedkit.linear_relu", "relu(F.linear)"])
def test_linear_relu_latency(benchmark, which, m, k):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    a, w, b = (torch.randn(*s, device=DEVICE).to(dtype) for s in ((m, k), (k, k), (k,)))
    fn = {
        "fusedkit.linear_relu": lambda: fusedkit.linear_relu(a, w, b),
        "relu(F.linear)": lambda: torch.relu(F.linear(a, w, b)),
    }[which]
    benchmark.group = f"per call: linear_relu {str(dtype).removeprefix('torch.')} {m}x{k}x{k}"
    _bench(benchmark, fn, case=which, m=m, k=k, n=k, dtype=str(dtype))
