"""The byte counter against Nsight Compute, op by op (fusedkit.bench.traffic): the ranges and
modelled bytes its target records, and how it judges measured counters. The ncu run itself
is a GPU report (python -m fusedkit bench --traffic)."""

from __future__ import annotations

import torch

from fusedkit.bench import traffic
from fusedkit.bench.ncu import RangeCounters


def test_the_target_records_every_op_with_its_model():
    ops = traffic.target(["swiglu"], device=torch.device("cpu"), small=True)["swiglu"]
    names = [op["op"] for op in ops]
    # the gate and its fused backward are one op each; the projections are matmuls
    assert names.count("fusedkit.silu_mul") == 1 and names.count("fusedkit.silu_mul_grad") == 1
    assert any(n.startswith("aten.mm") or n.startswith("aten.addmm") for n in names)
    assert [op["range"] for op in ops] == [f"swiglu/{i}|{n}" for i, n in enumerate(names)]
    gate = next(op for op in ops if op["op"] == "fusedkit.silu_mul")
    assert (gate["read"], gate["written"]) == (2 * 8 * 88 * 4, 8 * 88 * 4)  # a, b read; out written (fp32)
    grad = next(op for op in ops if op["op"] == "fusedkit.silu_mul_grad")
    assert (grad["read"], grad["written"]) == (3 * 8 * 88 * 4, 2 * 8 * 88 * 4)


def test_compare_judges_ops_above_the_floor_at_ten_percent():
    mb = traffic.MIN_BYTES
    ops = [
        {"range": "c/0|big", "op": "big", "read": 2 * mb, "written": mb},
        {"range": "c/1|off", "op": "off", "read": 2 * mb, "written": mb},
        {"range": "c/2|small", "op": "small", "read": 100, "written": 100},
        {"range": "c/3|view", "op": "view", "read": 0, "written": 0},
    ]
    # writes are not judged: what a kernel writes may stay in L2 past its counters
    measured = {
        "c/0|big": RangeCounters("c/0|big", ["k"], read=int(2.1 * mb), written=0),
        "c/1|off": RangeCounters("c/1|off", ["k", "k2"], read=int(2.3 * mb), written=mb),
        "c/2|small": RangeCounters("c/2|small", ["k"], read=5000, written=0),
    }
    ops.append({"range": "c/4|lost", "op": "lost", "read": 2 * mb, "written": 0})  # its kernel not measured
    rows = {r["op"]: r for r in traffic.compare(ops, measured)}
    assert rows["lost"]["agrees"] is False and rows["lost"]["error"] is None
    assert rows["big"]["agrees"] is True and abs(rows["big"]["error"] - 0.05) < 1e-3
    assert rows["off"]["agrees"] is False and rows["off"]["kernels"] == 2
    assert rows["small"]["agrees"] is None and rows["view"]["agrees"] is None and rows["view"]["kernels"] == 0
    table = traffic.format_traffic({"c": list(rows.values())})
    assert "DIFFERS" in table and "1 of 3 ops reading over" in table and "NO KERNEL MEASURED" in table


def test_the_report_needs_a_gpu_and_ncu():
    import subprocess
    import sys
    from pathlib import Path

    from fusedkit.bench.ncu import ncu_available

    if torch.cuda.is_available() and ncu_available():
        import pytest

        pytest.skip("with a GPU and ncu the report runs: scripts/results.sh traffic")
    proc = subprocess.run(
        [sys.executable, "-m", "fusedkit", "bench", "--traffic"],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "needs a CUDA GPU and Nsight Compute" in proc.stdout
