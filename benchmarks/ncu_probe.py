"""A stand-alone set of kernels to read DRAM bytes from under Nsight Compute (the
report's own ``python -m fusedkit bench --ncu`` covers the registry):

    ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum \
        python benchmarks/ncu_probe.py [log2 n]

Each case runs once, after the inputs are made; NVTX ranges name the cases.
"""

from __future__ import annotations

import sys

import torch

import fusedkit


def main():
    n = 1 << (int(sys.argv[1]) if len(sys.argv) > 1 else 26)
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    cols = 4096
    m, bias = x.view(n // cols, cols), torch.randn(cols, device="cuda")
    side = 1 << 13
    xt = x[: side * (n // side)].view(side, n // side).t()
    yt = torch.randn(n // side, side, device="cuda")
    cases = {
        "fused add_relu": lambda: fusedkit.add_relu(x, y),
        "unfused add_relu": lambda: torch.relu(torch.add(x, y)),
        "fused add_relu bias": lambda: fusedkit.add_relu(m, bias),
        "unfused add_relu bias": lambda: torch.relu(torch.add(m, bias)),
        "fused add_relu transposed": lambda: fusedkit.add_relu(xt, yt),
        "unfused add_relu transposed": lambda: torch.relu(torch.add(xt, yt)),
    }
    for name, fn in cases.items():
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
