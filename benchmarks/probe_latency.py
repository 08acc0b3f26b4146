"""Where a small fused call's host time goes (GPU): a breakdown of one call into
its layers, per call over a host loop, plus a cProfile of the whole call.

    python benchmarks/probe_latency.py [n]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import fusedkit
from fusedkit import _elementwise as ew
from fusedkit import _launch
from fusedkit import _matmul as mm
from fusedkit.latency import per_call_us
from fusedkit.registry import ADD_RELU

@triton.jit
def _copy_kernel(out_ptr, x_ptr, n, BLOCK: tl.constexpr):
    """A four-argument kernel: what a launch costs with few arguments to pack."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def _kept_entry(cache: _launch.CompiledCache) -> _launch.Entry:
    (entry,) = cache._entries.values()
    return entry


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    grid, args, meta = ew.launch_config(ADD_RELU, (x, y), 1, out)
    fusedkit.add_relu(x, y)
    key = ew._call_key(ADD_RELU, (x, y), 1)
    recipe = ew._RECIPES[key]
    fusedkit.add_relu(x, y)  # the second call keeps the compiled kernel
    entry = _kept_entry(recipe.compiled)
    index = x.device.index
    per_call = (out.data_ptr(), x.data_ptr(), y.data_ptr(), out.data_ptr(), *args[4:ew._PER_CALL_ARGS])
    block = 1024
    copy = _launch.CompiledCache()
    copy.put("copy", _copy_kernel[(triton.cdiv(n, block),)](out, x, n, BLOCK=block), (triton.cdiv(n, block), 1, 1),
             (block,))
    copy_entry = _kept_entry(copy)
    rows = [
        ("torch.add(x, y)", lambda: torch.add(x, y)),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("torch.relu(x + y)", lambda: torch.relu(x + y)),
        ("fusedkit.add_relu(x, y)  [fast path]", lambda: fusedkit.add_relu(x, y)),
        ("fusedkit.add_relu(x, y, out=out)  [full path]", lambda: fusedkit.add_relu(x, y, out=out)),
        ("  _call_key", lambda: ew._call_key(ADD_RELU, (x, y), 1)),
        ("  recipe.run", lambda: recipe.run((x, y), 1)),
        (f"  direct launch, {len(per_call) + len(entry.tail)} arguments", lambda: _launch.CompiledCache.run(
            entry, per_call, index)),
        ("  direct launch of a 4-argument copy kernel", lambda: _launch.CompiledCache.run(
            copy_entry, (out.data_ptr(), x.data_ptr(), n), index)),
        ("  the same through Triton's launcher object", lambda: copy_entry.compiled.run(
            copy_entry.grid[0], 1, 1, _launch._current_stream(index), copy_entry.function,
            copy_entry.packed_metadata, None, None, None, out.data_ptr(), x.data_ptr(), n, block)),
        ("  _validate", lambda: ew._validate(ADD_RELU, (x, y), 1, None)),
        ("  launch_config", lambda: ew.launch_config(ADD_RELU, (x, y), 1, out)),
        ("  kernel[grid](*args) prepared", lambda: ew._elementwise_kernel[grid](*args, **meta)),
    ]
    # linear + ReLU at decode size: M = 1, K = N = 1024, bf16
    a = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    fusedkit.linear_relu(a, w, b)
    fusedkit.linear_relu(a, w, b)
    wt = w.t()
    m_recipe = mm._RECIPES[mm._call_key(a, wt, b, "relu")]
    m_out = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)
    rows += [
        ("torch.relu(F.linear(a, w, b))  [M=1, 1024^2 bf16]", lambda: torch.relu(F.linear(a, w, b))),
        ("fusedkit.linear_relu(a, w, b)  [fast path]", lambda: fusedkit.linear_relu(a, w, b)),
        ("  matmul _call_key", lambda: mm._call_key(a, wt, b, "relu")),
        ("  matmul recipe.run", lambda: m_recipe.run(a, wt, b)),
        ("  launch_matmul with the plan", lambda: mm.launch_matmul(a, wt, b, "relu", m_out, None, m_recipe.plan)),
        ("  plan_matmul", lambda: mm.plan_matmul(a, wt, b, "relu", m_out)),
        ("  matmul _validate", lambda: mm._validate(a, wt, b, "relu", "matmul")),
    ]
    print(f"kept launches call Triton's C launch function directly: {bool(entry.head)}")
    for name, fn in rows:
        print(f"{name:52s} {per_call_us(fn, x.device):8.1f} us/call  (n={n})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        fusedkit.add_relu(x, y)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
