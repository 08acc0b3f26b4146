"""The byte counter against the hardware: ``python -m fusedkit bench --traffic``.

:class:`fusedkit.MemoryCounterMode`'s model of each op's DRAM bytes, set beside what Nsight
Compute measures for the kernels that op launched, op by op, in one training step (forward
and backward) of a real block:

- ``bottleneck``: torchvision's ResNet-50 ``Bottleneck(256, 64)`` (bf16 autocast, channels
  last, 32 images of 56 x 56), its residual join put through ``add_relu`` by
  :func:`fusedkit.fuse`;
- ``swiglu``: :class:`fusedkit.nn.SwiGLU` at LLaMA-7B's widths on 2048 tokens (bf16).

The block's step runs once outside any range (compiling and tuning), then once under a dispatch
mode that runs every aten op in an NVTX range ``"<case>/<index>|<op>"`` and records the op's
modelled bytes (fusedkit's ops are one op each: a dispatch mode sees their registered ops);
``ncu --cache-control all`` (every kernel starts with cold caches,
clocks left alone) reads ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` per range.
An op reading more than :data:`MIN_BYTES` agrees when its measured DRAM reads are within
:data:`TOLERANCE` of the modelled reads. Reads, because with cold caches every byte a kernel
reads comes from DRAM inside its counters, while what it writes stays in the 60 MB L2 until the
flush before the next kernel writes it back, outside them (the elementwise ncu report measures
0 written bytes for a 4 MB result): a kernel's written bytes are the part of its result that
left L2 while it ran, shown beside the model, not judged.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedkit
from fusedkit.memory import op_name, op_traffic

from .models import autocast_for
from .ncu import METRICS, parse_ncu_csv

__all__ = ["CASES", "MIN_BYTES", "TOLERANCE", "compare", "format_traffic", "run_traffic"]

#: Ops reading fewer modelled bytes are listed, not judged (launch-sized traffic).
MIN_BYTES = 1 << 20
#: Agreement: measured DRAM reads within 10% of the modelled reads.
TOLERANCE = 0.10
CASES = ("bottleneck", "swiglu")
#: The target program's marker line before its JSON.
_MARK = "fusedkit-traffic:"


class _Ranges(TorchDispatchMode):
    """Runs each op inside an NVTX range ``"<case>/<index>|<op>"`` (on a GPU), recording its
    modelled bytes. Views and allocations launch no kernel: their ranges measure nothing."""

    def __init__(self, case: str, gpu: bool):
        super().__init__()
        self.case, self.gpu = case, gpu
        self.ops: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func, args)
        label = f"{self.case}/{len(self.ops)}|{name}"
        if not self.gpu:
            out = func(*args, **kwargs)
        else:
            torch.cuda.nvtx.range_push(label)
            try:
                out = func(*args, **kwargs)
                torch.cuda.synchronize()  # (ncu serialises kernels; this keeps each in its range)
            finally:
                torch.cuda.nvtx.range_pop()
        traffic = op_traffic(func, args, kwargs, out)
        self.ops.append({"range": label, "op": name, "read": traffic.read, "written": traffic.written})
        return out


def _build(case: str, device, small: bool):
    """``(model, input)`` of a case, the model's step being ``model(x)``'s forward and backward."""
    if case == "bottleneck":
        from torchvision.models.resnet import Bottleneck

        n, side = (2, 8) if small else (32, 56)
        model = Bottleneck(256, 64).to(device).to(memory_format=torch.channels_last)
        # (a block inside ResNet-50 gets its input in autocast's dtype, bf16 on the GPU: the
        # previous block's output; an fp32 input would make the residual add promote)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.randn(n, 256, side, side, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        with autocast_for(device):
            model = fusedkit.fuse(model, x)
        return model, x
    if case == "swiglu":
        tokens, width, hidden = (8, 32, 88) if small else (2048, 4096, 11008)
        return fusedkit.nn.SwiGLU(width, hidden).to(device), torch.randn(tokens, width, device=device)
    raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")


def _step(model, x):
    with autocast_for(x.device):
        out = model(x)
    out.float().square().mean().backward()


def target(cases: list[str], device=None, small: bool = False) -> dict[str, list[dict]]:
    """The program ncu runs: each case's step, warmed up, then under :class:`_Ranges`."""
    device = device or torch.device("cuda")
    gpu = device.type == "cuda"
    found = {}
    for case in cases:
        model, x = _build(case, device, small)
        _step(model, x)
        model.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        mode = _Ranges(case, gpu)
        with mode:
            _step(model, x)
        found[case] = mode.ops
    return found


def compare(model_ops: list[dict], measured: dict) -> list[dict]:
    """One row per op: its model, what ncu read for its range (``parse_ncu_csv``), the reads'
    relative error and whether it agrees (None: reads below :data:`MIN_BYTES`; False, with no
    error, for an op reading more whose range measured no kernel: nothing to set beside it)."""
    rows = []
    for op in model_ops:
        counters = measured.get(op["range"])
        row = dict(
            op,
            model=op["read"] + op["written"],
            kernels=0 if counters is None else len(counters.kernels),
            dram_read=None,
            dram_written=None,
            error=None,
            agrees=False if counters is None and op["read"] >= MIN_BYTES else None,
        )
        if counters is not None:
            row.update(dram_read=counters.read, dram_written=counters.written, kernel_names=counters.kernels[:3])
            if op["read"]:
                row["error"] = (counters.read - op["read"]) / op["read"]
            if op["read"] >= MIN_BYTES:
                row["agrees"] = abs(row["error"]) <= TOLERANCE
        rows.append(row)
    return rows


def run_traffic(cases=CASES, timeout: int = 1500) -> dict[str, list[dict]]:
    """Run :func:`target` under ncu; per case the rows of :func:`compare`."""
    cmd = [
        "ncu",
        "--clock-control",
        "none",
        "--cache-control",
        "all",
        "--nvtx",
        "--csv",
        "--metrics",
        ",".join(METRICS),
        sys.executable,
        "-m",
        "fusedkit.bench.traffic",
        ",".join(cases),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ncu failed ({proc.returncode}): {proc.stderr[-2000:]}")
    marked = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if not marked:
        raise RuntimeError(f"the target printed no result: {proc.stdout[-2000:]}")
    model = json.loads(marked[-1][len(_MARK) :])
    measured = parse_ncu_csv(proc.stdout)
    return {case: compare(ops, measured) for case, ops in model.items()}


def format_traffic(results: dict[str, list[dict]]) -> str:
    """The judged ops of each case (model above MIN_BYTES), then each case's summary line."""
    lines = [
        f"Modelled bytes (fusedkit.MemoryCounterMode) against Nsight Compute's DRAM bytes, per op, cold caches; "
        f"ops reading over {MIN_BYTES / 1e6:.1f} MB judged on their reads at {TOLERANCE:.0%} (writes: what left "
        "L2 during the kernel)"
    ]
    head = (
        f"{'case':<11} {'op':<34} {'model rd MB':>11} {'DRAM rd MB':>10} {'error':>7} {'model wr MB':>11} "
        f"{'DRAM wr MB':>10}  kernels"
    )
    lines += [head, "-" * len(head)]
    summary = []
    for case, rows in results.items():
        judged = [r for r in rows if r["agrees"] is not None]
        for r in judged:
            if r["dram_read"] is None:
                lines.append(
                    f"{case:<11} {r['op'][:34]:<34} {r['read'] / 1e6:>11.2f} {'-':>10} {'-':>7} "
                    f"{r['written'] / 1e6:>11.2f} {'-':>10}  0  NO KERNEL MEASURED"
                )
                continue
            lines.append(
                f"{case:<11} {r['op'][:34]:<34} {r['read'] / 1e6:>11.2f} {r['dram_read'] / 1e6:>10.2f} "
                f"{100 * r['error']:>6.1f}% {r['written'] / 1e6:>11.2f} {r['dram_written'] / 1e6:>10.2f}  "
                f"{r['kernels']}{'' if r['agrees'] else '  DIFFERS'}"
            )
        model_read = sum(r["read"] for r in rows)
        dram_read = sum(r["dram_read"] or 0 for r in rows)
        summary.append(
            f"{case}: {sum(r['agrees'] for r in judged)} of {len(judged)} ops reading over "
            f"{MIN_BYTES / 1e6:.1f} MB within {TOLERANCE:.0%}; the step's reads: model {model_read / 1e6:.1f} "
            f"MB, DRAM {dram_read / 1e6:.1f} MB ({len(rows)} ops)"
        )
    return "\n".join(lines + [""] + summary)


if __name__ == "__main__":
    print(_MARK + json.dumps(target(sys.argv[1].split(","))), flush=True)
