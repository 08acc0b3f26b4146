"""The measurement behind the elementwise rows of ``fusedkit/runtime/configs.py``: each op's
time at each tile size, by dtype, layout and size, on this machine's GPU.

    PYTHONPATH=. python benchmarks/tile_sweep.py                 # the defaults below
    PYTHONPATH=. python benchmarks/tile_sweep.py --kernels gelu_mul --sizes 20,28 --blocks 1024,4096

``--blocks`` are the contiguous (1-D) path's elements per program, ``--tiles`` the 2-D tile's
elements (a broadcast bias; ``MAX_BLOCK_C`` columns at most); ``--warps`` the warps per
program of both. Each configuration is patched into ``configs`` with fusedkit's caches cleared,
so every call plans its launch again. Times are ``do_bench`` medians in microseconds; each row
marks its fastest configuration with ``*`` and gives the current one's time over it.
On a CPU it runs in Triton's interpreter at the smallest size (a check of the script only).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import fusedkit
from fusedkit import elementwise, registry
from fusedkit.bench.cases import BIAS_COLS, DTYPE_NAMES, make_operands, timer
from fusedkit.runtime import configs
from fusedkit.runtime.elementwise import INTERPRETED

#: The layouts whose tile the sweep sets (a transposed operand takes ``TRANSPOSED_TILE``).
LAYOUTS = ("contiguous", "bias")


#: The tuning table's entries the sweep patches.
TABLE = ("BLOCK_1D", "BLOCK_1D_NARROW", "TILE_ELEMS_2D", "ELEMENTWISE_WARPS")


def _current_tile(layout: str, n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(elements, warps) of the tile the table in force gives ``layout`` at ``n`` elements."""
    rows, cols = (1, n) if layout == "contiguous" else (n // min(BIAS_COLS, n), min(BIAS_COLS, n))
    tile = configs.elementwise_tile(rows, cols, False, dtype.itemsize)
    return tile.block_r * tile.block_c, tile.num_warps


def _restore(table: dict) -> None:
    for entry, value in table.items():
        setattr(configs, entry, value)


def _configure(layout: str, size: int, warps: int) -> None:
    if layout == "contiguous":
        configs.BLOCK_1D = configs.BLOCK_1D_NARROW = size
    else:
        configs.TILE_ELEMS_2D = size
    configs.ELEMENTWISE_WARPS = warps
    fusedkit.clear_caches()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="add_relu,silu_mul,gelu_mul,gelu_tanh_mul,add_gelu")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--sizes", default="18,20,22,24,26,28", help="log2 of the elements")
    p.add_argument("--blocks", default="1024,2048,4096,8192")
    p.add_argument("--tiles", default="2048,4096,8192")
    p.add_argument("--warps", default="4,8")
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        p.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not INTERPRETED:  # (Triton picks the interpreter on import: start again)
        args_now = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, __file__, *args_now], dict(os.environ, TRITON_INTERPRET="1"))
    sizes = [int(s) for s in args.sizes.split(",")]
    if device.type != "cuda":
        sizes = [min(sizes)]
    warps = [int(w) for w in args.warps.split(",")]
    table = {name: getattr(configs, name) for name in TABLE}
    time_us = timer(device)
    print(f"{'kernel':<14}{'dtype':<10}{'layout':<11}{'n':>6}  tile/warps: us (* fastest)   current/fastest")
    try:
        for name, dtype_name, layout, log2 in itertools.product(
            args.kernels.split(","), args.dtypes.split(","), layouts, sizes
        ):
            kernel, dtype = registry.get(name), DTYPE_NAMES[dtype_name]
            now = _current_tile(layout, 1 << log2, dtype)
            operands = make_operands(kernel, layout, 1 << log2, dtype, device)
            tiles = [int(b) for b in (args.blocks if layout == "contiguous" else args.tiles).split(",")]
            times = {}
            for size, w in itertools.product(tiles, warps):
                _configure(layout, size, w)
                times[size, w] = time_us(lambda: elementwise(kernel, *operands))
            _restore(table)  # (the table in force again, for the next row's tile)
            best = min(times, key=times.get)
            now_us = times.get(now)
            cells = " ".join(f"{s}/{w}:{t:.1f}{'*' if (s, w) == best else ''}".ljust(16) for (s, w), t in times.items())
            ratio = f"{now_us / times[best]:.2f}" if now_us is not None else "-"
            print(f"{name:<14}{dtype_name:<10}{layout:<11}{'2^' + str(log2):>6}  {cells}   {ratio}", flush=True)
    finally:
        _restore(table)
        fusedkit.clear_caches()


if __name__ == "__main__":
    main()
