"""The program ``python -m fusedkit bench --ncu`` runs under Nsight Compute.

Arguments: kernels, dtypes, sizes, layouts (comma-separated, as for the bench).
Each case is warmed up outside any NVTX range, then run once inside
``"<kernel>-<layout>-<dtype>-<n>|fused"`` and once inside ``...|unfused``.
"""

from __future__ import annotations

import sys

import torch

from fusedkit import elementwise, registry

from .cases import DTYPE_NAMES, case_name, make_operands


def main(argv: list[str]) -> None:
    kernels, dtypes, sizes, layouts = argv
    device = torch.device("cuda")
    for name in kernels.split(","):
        spec = registry.get(name)
        for dt_name in dtypes.split(","):
            dtype = DTYPE_NAMES[dt_name]
            for n in (int(s) for s in sizes.split(",")):
                for layout in layouts.split(","):
                    ops = make_operands(spec, layout, n, dtype, device)
                    args = ops + ((spec.param_default,) if spec.param else ())
                    runs = {"fused": lambda: elementwise(spec, *ops), "unfused": lambda: spec.reference(*args)}
                    for fn in runs.values():  # warm-up: compile outside the measured ranges
                        fn()
                    torch.cuda.synchronize()
                    for which, fn in runs.items():
                        torch.cuda.nvtx.range_push(f"{case_name(spec.name, layout, dtype, n)}|{which}")
                        fn()
                        torch.cuda.synchronize()
                        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main(sys.argv[1:])
