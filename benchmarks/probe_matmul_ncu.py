"""What cuBLASLt runs where fusedkit's matmul trails it, under Nsight Compute (GPU).

    python benchmarks/probe_matmul_ncu.py [dtype M N K] ...   (default: bf16 512 and 64, N = K = 4096;
                                                               dtype: bf16, fp16, fp32, tf32)

For each shape, one launch each of fusedkit's default kernel (autotuned), the TMA kernel
forced, ``torch._addmm_activation`` (cuBLASLt's fused epilogue) and a bare ``torch.mm``,
each inside an NVTX range, profiled with caches flushed before every kernel (as
``do_bench`` flushes them). Printed per kernel: its name (cuBLAS's names carry tile and
cluster shapes), grid, block, cluster, registers, dynamic shared memory, duration, DRAM
and L2 bytes, and SM / L2 throughput as a share of peak: whether the gap is the tile
count, L2 bandwidth (each 128 x 128 tile of M = 512 reads 2 MB of operands: 256 MB in
all, against 36 MB of distinct data) or something else.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys

import torch

#: Counters asked for; ncu refuses the whole run on an unknown name, so the optional
#: ones are dropped and the run repeated if it fails.
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "lts__t_bytes.sum", "launch__grid_size",
           "launch__block_size", "launch__registers_per_thread", "launch__shared_mem_per_block_dynamic",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed", "lts__throughput.avg.pct_of_peak_sustained_elapsed")
OPTIONAL_METRICS = ("launch__cluster_dim_x", "launch__cluster_dim_y",
                    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active")
DEFAULT_CASES = (("bf16", 512, 4096, 4096), ("bf16", 64, 4096, 4096))
#: "tf32": float32 with TF32 allowed (both sides); "fp32": with TF32 off (fusedkit's tf32x3).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}
_RANGE = re.compile(r'<default domain>:([^:"]+)')


def _cases(argv):
    if not argv:
        return DEFAULT_CASES
    return [(argv[i], int(argv[i + 1]), int(argv[i + 2]), int(argv[i + 3])) for i in range(0, len(argv), 4)]


def target(argv) -> None:
    """Run under ncu: warm up every case outside NVTX ranges, then once each inside one."""
    import fusedkit
    from fusedkit import _matmul as mm, _matmul_tma as tma
    from fusedkit.configs import settings

    for dt, m, n, k in _cases(argv):
        dtype = DTYPES[dt]
        torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)

        def tma_forced():
            with settings(FUSEDKIT_MATMUL_KERNEL="tma"):
                return fusedkit.matmul_relu(a, b, bias)

        runs = {"fusedkit": lambda: fusedkit.matmul_relu(a, b, bias), "fusedkit-tma": tma_forced,
                "cublaslt-epilogue": lambda: torch._addmm_activation(bias, a, b),
                "torch-mm": lambda: torch.mm(a, b)}
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            if name.startswith("fusedkit"):
                kernel = tma._matmul_tma_tuned if name.endswith("tma") else mm._matmul_tuned
                print(f"# {dt} {m}x{n}x{k} {name}: tuned {getattr(kernel, 'best_config', None)}", flush=True)
        torch.cuda.profiler.start()  # ncu profiles from here (--profile-from-start off): not tuning's launches
        for name, fn in runs.items():
            torch.cuda.nvtx.range_push(f"{dt} {m}x{n}x{k} {name}")
            fn()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        torch.cuda.profiler.stop()


def _ncu(metrics, argv):
    cmd = ["ncu", "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off", "--nvtx", "--csv",
           "--metrics", ",".join(metrics), sys.executable, __file__, "--target", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=500)


def main(argv) -> None:
    if not torch.cuda.is_available() or shutil.which("ncu") is None:
        print("needs a GPU and Nsight Compute (ncu)")
        return
    metrics = METRICS + OPTIONAL_METRICS
    proc = _ncu(metrics, argv)
    if proc.returncode != 0:
        print(f"ncu with the optional metrics failed ({proc.stderr.strip()[-300:]}); again without them")
        metrics = METRICS
        proc = _ncu(metrics, argv)
    for line in proc.stdout.splitlines():
        if line.startswith("#"):
            print(line)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return
    lines = [line for line in proc.stdout.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    col = {h: i for i, h in enumerate(rows[0])}
    nvtx_col = next(i for i, h in enumerate(rows[0]) if h.startswith("thread Domain"))
    kernels: dict[tuple, dict] = {}
    for row in rows[1:]:
        match = _RANGE.search(row[nvtx_col])
        if not match:
            continue
        key = (match.group(1), row[col["ID"]])
        entry = kernels.setdefault(key, {"name": row[col["Kernel Name"]]})
        entry[row[col["Metric Name"]]] = row[col["Metric Value"]]
    for (case, _), entry in kernels.items():
        print(f"{case}: {entry['name'][:160]}")
        print("    " + "  ".join(f"{m.split('.')[0].replace('launch__', '')}={entry.get(m, '-')}" for m in metrics))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--target"]:
        target(sys.argv[2:])
    else:
        main(sys.argv[1:])
