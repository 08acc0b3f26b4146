"""Measured DRAM traffic: run fused and unfused cases under Nsight Compute and
set the hardware counters beside the byte model.

``python -m fusedkit bench --ncu`` re-runs :mod:`fusedkit._ncu_target` under
``ncu --clock-control none --cache-control all`` (clocks left alone; caches
flushed before each kernel, so every kernel starts cold) and reads, for every
kernel launched inside an NVTX range ``"<case>|fused"`` or ``"<case>|unfused"``,
``dram__bytes_read.sum`` and ``dram__bytes_write.sum``. Warm-up launches run
outside any range and are ignored.

Cold caches make every kernel read its inputs from DRAM, so they check the byte model
at any size but cannot show what happens below the L2 size in a steady loop. Cases
whose fused bytes fit in L2 are therefore measured a second time with
``--cache-control none``: the warm-up launches leave the inputs in L2, and the unfused
intermediate is written and re-read there, so the counters show how little reaches DRAM.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
#: Fused reads within this share of the model count as agreeing (the issue's 2%).
READ_TOLERANCE = 0.02
#: Unfused/fused total-bytes ratio within this share of the model's agrees (5%).
RATIO_TOLERANCE = 0.05
#: ``ncu --cache-control`` values: flush and invalidate caches before each kernel, or not.
CACHE_COLD, CACHE_WARM = "all", "none"
_RANGE = re.compile(r'<default domain>:([^:"]+)')


@dataclass
class RangeCounters:
    """Counters summed over the kernels launched inside one NVTX range."""

    name: str
    kernels: list[str] = field(default_factory=list)
    read: int = 0
    written: int = 0
    ns: int = 0


def _number(text: str) -> int:
    return int(float(text.replace(",", "")))


def parse_ncu_csv(text: str) -> dict[str, RangeCounters]:
    """``ncu --csv --nvtx`` output (one row per kernel and metric) -> counters per NVTX range.

    Kernels launched outside any NVTX range (warm-up, input set-up) are dropped.
    """
    lines = [line for line in text.splitlines() if line.startswith('"')]
    reader = csv.reader(io.StringIO("\n".join(lines)))
    header = next(reader)
    col = {h: i for i, h in enumerate(header)}
    nvtx_col = next(i for i, h in enumerate(header) if h.startswith("thread Domain"))
    ranges: dict[str, RangeCounters] = {}
    seen: set[tuple[str, str]] = set()
    for row in reader:
        match = _RANGE.search(row[nvtx_col])
        if not match:
            continue
        name = match.group(1)
        counters = ranges.setdefault(name, RangeCounters(name))
        launch = row[col["ID"]]
        if (name, launch) not in seen:
            seen.add((name, launch))
            counters.kernels.append(row[col["Kernel Name"]].split("/")[-1])
        metric, value = row[col["Metric Name"]], _number(row[col["Metric Value"]])
        if metric == "dram__bytes_read.sum":
            counters.read += value
        elif metric == "dram__bytes_write.sum":
            counters.written += value
        elif metric == "gpu__time_duration.sum":
            counters.ns += value
    return ranges


def ncu_available() -> bool:
    return shutil.which("ncu") is not None


def measure(target_args: list[str], cache_control: str = CACHE_COLD, timeout: int = 1800) -> dict[str, RangeCounters]:
    """Run ``python -m fusedkit._ncu_target *target_args`` under ncu and parse its counters."""
    if cache_control not in (CACHE_COLD, CACHE_WARM):
        raise ValueError(f"cache_control must be {CACHE_COLD!r} or {CACHE_WARM!r}, not {cache_control!r}")
    cmd = [
        "ncu",
        "--clock-control",
        "none",
        "--cache-control",
        cache_control,
        "--nvtx",
        "--csv",
        "--metrics",
        ",".join(METRICS),
        sys.executable,
        "-m",
        "fusedkit._ncu_target",
        *target_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ncu failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return parse_ncu_csv(proc.stdout)


def verdict(model_fused, model_unfused, fused: RangeCounters, unfused: RangeCounters, fits_l2: bool) -> str:
    """How the counters compare with the model (``registry.Traffic`` values), in words."""
    read_err = abs(fused.read - model_fused.read) / model_fused.read if model_fused.read else 0.0
    if fits_l2:
        # Cold reads still check the model; writes and the unfused ratio do not: what a
        # kernel leaves in L2 is written back by the flush before the next, outside its counters.
        return f"fits in L2: cold read err {100 * read_err:.2f}%; the saving is L2 traffic and launches, not DRAM bytes"
    model_ratio = model_unfused.total / model_fused.total if model_fused.total else 1.0
    measured_ratio = (unfused.read + unfused.written) / max(1, fused.read + fused.written)
    ok = read_err <= READ_TOLERANCE and abs(measured_ratio - model_ratio) <= RATIO_TOLERANCE * model_ratio
    return (
        f"{'agrees' if ok else 'DIFFERS'}: read err {100 * read_err:.2f}%, unfused/fused "
        f"{measured_ratio:.3f} vs model {model_ratio:.3f}"
    )


def warm_verdict(model_fused, model_unfused, fused: RangeCounters, unfused: RangeCounters) -> str:
    """A case that fits in L2, measured with warm caches (``CACHE_WARM``): what share of
    each model's bytes reached DRAM."""

    def share(c: RangeCounters, model) -> float:
        return 100 * (c.read + c.written) / model.total if model.total else 0.0

    return (
        f"fits in L2: warm, DRAM saw {share(fused, model_fused):.1f}% of the fused model's bytes and "
        f"{share(unfused, model_unfused):.1f}% of the unfused model's: the saving is L2 traffic and "
        "launches, not DRAM bytes"
    )
