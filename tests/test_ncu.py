"""Nsight Compute support: the counters parser on a real H200 capture, the
verdict against the model, and --ncu without ncu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedkit import registry
from fusedkit.bench import ncu

ROOT = Path(__file__).resolve().parents[1]
#: A real capture (H200, add_relu at 2^26 fp32 in three layouts, fused and unfused, NVTX ranges),
#: kept as the parser's fixture.
CAPTURE = ROOT / "tests/data/ncu_h200_add_relu_2e26.csv"


def test_parse_real_capture():
    ranges = ncu.parse_ncu_csv(CAPTURE.read_text())
    # Kernels outside NVTX ranges (torch.randn filling the inputs) are dropped.
    assert set(ranges) == {
        "fused add_relu",
        "unfused add_relu",
        "fused add_relu bias",
        "unfused add_relu bias",
        "fused add_relu transposed",
        "unfused add_relu transposed",
    }
    fused, unfused = ranges["fused add_relu"], ranges["unfused add_relu"]
    assert fused.kernels == ["_elementwise_kernel"] and len(unfused.kernels) == 2
    assert (fused.read, fused.written) == (536_882_944, 246_177_024)
    assert unfused.read == 536_883_200 + 268_477_696


def test_verdict_on_the_capture_agrees_with_the_model():
    n = 1 << 26
    x = torch.empty(n, device="meta")
    spec = registry.get("add_relu")
    ranges = ncu.parse_ncu_csv(CAPTURE.read_text())
    words = ncu.verdict(
        spec.bytes_fused(x, x),
        spec.bytes_unfused(x, x),
        ranges["fused add_relu"],
        ranges["unfused add_relu"],
        fits_l2=False,
    )
    assert words.startswith("agrees"), words
    tiny = ncu.RangeCounters("t", read=1, written=1)
    assert ncu.verdict(spec.bytes_fused(x, x), spec.bytes_unfused(x, x), tiny, tiny, fits_l2=False).startswith("DIFF")
    assert "L2" in ncu.verdict(spec.bytes_fused(x, x), spec.bytes_unfused(x, x), tiny, tiny, fits_l2=True)


@pytest.mark.slow  # runs the report in a new process
@pytest.mark.skipif(ncu.ncu_available() and torch.cuda.is_available(), reason="ncu present: the GPU script runs it")
def test_ncu_flag_without_ncu_says_so():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusedkit",
            "bench",
            "--ncu",
            "--sizes",
            "1024",
            "--layouts",
            "contiguous",
            "--dtypes",
            "fp32",
            "--kernels",
            "add_relu",
            "--no-compile",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "measured traffic skipped" in proc.stdout


def test_parse_the_reports_own_range_names():
    """The names `python -m fusedkit bench --ncu` writes: "<case>|fused" and "<case>|unfused"."""
    from fusedkit.bench.cases import case_name

    case = case_name("add_relu", "contiguous", torch.float32, 1024)
    head = (
        '"ID","Process ID","Process Name","Host Name","thread Domain:Push/Pop_Range:PL_Type:PL_Value",'
        '"Id:Domain","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    )
    rows = [head]
    for launch, (which, kernel, read, wrote) in enumerate(
        [
            ("fused", "_elementwise_kernel", 8192, 4096),
            ("unfused", "add_kernel", 8192, 4096),
            ("unfused", "relu_kernel", 4096, 4096),
        ]
    ):
        for metric, value in (("dram__bytes_read.sum", read), ("dram__bytes_write.sum", wrote)):
            rows.append(
                f'"{launch}","1","python","h","1  "<default domain>:{case}|{which}:none" ","",'
                f'"{kernel}","{metric}","byte","{value:,}"'
            )
    rows.append('"9","1","python","h","","","warmup_kernel","dram__bytes_read.sum","byte","1"')
    ranges = ncu.parse_ncu_csv("\n".join(rows))
    assert set(ranges) == {f"{case}|fused", f"{case}|unfused"}
    assert (ranges[f"{case}|fused"].read, ranges[f"{case}|fused"].written) == (8192, 4096)
    assert ranges[f"{case}|unfused"].kernels == ["add_kernel", "relu_kernel"]
    assert ranges[f"{case}|unfused"].read == 12288


def test_measure_passes_the_cache_control(monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(
            cmd,
            0,
            stdout='"ID","thread Domain:x","Kernel Name","Metric Name","Metric Unit","Metric Value"\n',
            stderr="",
        )

    monkeypatch.setattr(ncu.subprocess, "run", fake_run)
    assert ncu.measure(["add"]) == {} and ncu.measure(["add"], cache_control=ncu.CACHE_WARM) == {}
    assert [c[c.index("--cache-control") + 1] for c in seen] == ["all", "none"]
    with pytest.raises(ValueError, match="cache_control"):
        ncu.measure(["add"], cache_control="normal")


def test_cases_that_fit_in_l2_are_measured_again_warm(monkeypatch, capsys):
    """`bench --ncu`: every size cold (the model check), the sizes with a case inside L2
    warm as well, and those cases' verdict comes from the warm counters."""
    from fusedkit.bench import report as bench

    small, large = 1 << 12, 1 << 24
    rows = [bench.Row("add_relu", "contiguous", "float32", n, str(n), 0, 0, 1.0, 1.0, 1.0) for n in (small, large)]
    calls = []

    def fake_measure(args, cache_control=ncu.CACHE_COLD):
        calls.append((args[2], cache_control))
        out = {}
        for n in map(int, args[2].split(",")):
            name = bench.case_name("add_relu", "contiguous", torch.float32, n)
            cold = cache_control == ncu.CACHE_COLD
            out[f"{name}|fused"] = ncu.RangeCounters("f", read=8 * n if cold else 0, written=4 * n if cold else 64)
            out[f"{name}|unfused"] = ncu.RangeCounters("u", read=12 * n if cold else 0, written=8 * n if cold else 128)
        return out

    monkeypatch.setattr(ncu, "ncu_available", lambda: True)
    monkeypatch.setattr(ncu, "measure", fake_measure)
    out = bench.run_ncu(
        rows,
        [registry.get("add_relu")],
        [torch.float32],
        [small, large],
        ["contiguous"],
        torch.device("cuda"),
        {"l2_bytes": 1 << 20},
    )
    assert calls == [(f"{small},{large}", "all"), (str(small), "none")]
    by_n = {t["case"].rsplit("-", 1)[1]: t for t in out}
    assert by_n[str(large)]["verdict"].startswith("agrees") and "ncu_warm_fused_total" not in by_n[str(large)]
    warm = by_n[str(small)]
    assert warm["ncu_warm_fused_total"] == 64 and warm["ncu_warm_unfused_total"] == 128
    assert warm["verdict"].startswith("fits in L2: warm, DRAM saw 0.1% of the fused model's bytes")
    assert warm["verdict_cold"].startswith("fits in L2: cold read err 0.00%")
    assert "--cache-control none" in capsys.readouterr().out
