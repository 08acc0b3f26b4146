"""Fused vs unfused vs torch.add for every registered elementwise kernel."""

from __future__ import annotations

import pytest
import torch
import triton

import fusedkit
from fusedkit.bench import report as bench
from fusedkit.bench.peers import supports_tutorial, tutorial

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
#: Across the 60 MiB L2 of the H200: launch-bound (2^12), L2-resident (2^16, 2^20), DRAM (2^24, 2^28).
SIZES = (2**12, 2**16, 2**20, 2**24, 2**28) if ON_GPU else (2**10,)
DTYPES = (torch.float32, torch.bfloat16)
KERNELS = list(fusedkit.registry.kernels())


_ROOFS: dict = {}


def copy_roof(dtype) -> float:
    """The copy bandwidth of this GPU (bytes read + written), measured once per dtype in this run."""
    if dtype not in _ROOFS:
        _ROOFS[dtype] = bench.copy_roof_gbps(dtype, DEVICE, max(SIZES))
    return _ROOFS[dtype]


def _timed(fn):
    if ON_GPU:

        def run():
            fn()
            torch.cuda.synchronize()

        return run
    return fn


def _record(benchmark, spec, ops, which):
    traffic = spec.bytes_fused(*ops) if which == "fused" else spec.bytes_unfused(*ops)
    info = benchmark.extra_info
    info.update(
        kernel=spec.name,
        which=which,
        shape=list(ops[0].shape),
        dtype=str(ops[0].dtype),
        bytes_read=traffic.read,
        bytes_written=traffic.written,
        torch=torch.__version__,
        triton=triton.__version__,
        backend=fusedkit.backend_for(DEVICE),
    )
    if ON_GPU:
        props = torch.cuda.get_device_properties(DEVICE)
        info.update(gpu=props.name, fits_l2=traffic.total <= props.L2_cache_size)
    else:
        info["note"] = "CPU: Triton interpreter at tiny sizes; not GPU times"


@pytest.mark.parametrize("layout", bench.LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", ["fused", "unfused", "compiled", "tutorial", "torch_add"])
@pytest.mark.parametrize("spec", KERNELS, ids=lambda k: k.name)
def test_elementwise(benchmark, spec, which, dtype, n, layout):
    ops = bench.make_operands(spec, layout, n, dtype, DEVICE)
    args = ops + ((spec.param_default,) if spec.param else ())
    if which == "compiled":
        if not ON_GPU:
            pytest.skip("torch.compile of the composition is a GPU peer")
        compiled = bench.compiled_peer(spec.reference)
        fn = lambda: compiled(*args)
    elif which == "tutorial":
        if not supports_tutorial(spec, dtype):
            pytest.skip(f"the tutorial-style peer takes binary float kernels with a parameter, not {spec.name}")
        # copies a broadcast or transposed operand first: the hidden copy it needs
        fn = lambda: tutorial(spec, ops[0], ops[1], spec.param_default)
    else:
        fn = {
            "fused": lambda: fusedkit.elementwise(spec, *ops),
            "unfused": lambda: spec.reference(*args),
            "torch_add": lambda: torch.add(ops[0], ops[-1]),
        }[which]
    _record(benchmark, spec, ops, which)
    # One table per op, dtype, size and layout: the peers side by side.
    benchmark.group = f"{spec.name} {str(dtype).removeprefix('torch.')} n={n} {layout}"
    if ON_GPU:
        us = 1e3 * triton.testing.do_bench(fn, return_mode="median")
        info = benchmark.extra_info
        info["do_bench_median_us"] = us
        info["gbps"] = (info["bytes_read"] + info["bytes_written"]) / us / 1e3
        info["copy_roof_gbps"] = copy_roof(dtype)
        info["roof_share"] = info["gbps"] / info["copy_roof_gbps"]
    benchmark.pedantic(_timed(fn), rounds=20 if ON_GPU else 3, warmup_rounds=3 if ON_GPU else 1)
