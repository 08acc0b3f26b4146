"""The README's main job, ``python -m fusedkit bench``, runs and writes its files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_bench_report_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI must turn it on itself
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "fusedkit", "bench", "--sizes", "1024", "--layouts", "contiguous,bias,transposed",
         "--dtypes", "fp32", "--no-compile", "--json", str(out_json), "--csv", str(out_csv),
         "--plots", str(tmp_path / "plots")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_gpu = torch.cuda.is_available()
    assert ("NOT GPU times" in proc.stdout) != on_gpu
    data = json.loads(out_json.read_text())
    assert data["environment"]["backend"] == ("triton" if on_gpu else "interpreter")
    rows = data["rows"]
    assert {(r["kernel"], r["layout"]) for r in rows} >= {("add_relu", "transposed"), ("add", "bias")}
    relu = next(r for r in rows if r["kernel"] == "add_relu" and r["layout"] == "contiguous")
    assert relu["bytes_unfused"] * 3 == relu["bytes_fused"] * 5
    assert len(out_csv.read_text().splitlines()) == len(rows) + 1
    for png in ("elementwise_gbps.png", "elementwise_bytes.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_report_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out_json = tmp_path / "m.json"
    # On a GPU: two small shapes, so the test checks the harness, not the tuning sweep.
    args = ["--dtypes", "bf16", "--shapes", "256x256x128,1x512x256"] if torch.cuda.is_available() \
        else ["--dtypes", "fp32"]
    proc = subprocess.run([sys.executable, "-m", "fusedkit", "bench", "--matmul", *args, "--json", str(out_json),
                           "--plots", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out_json.read_text())["matmul"]
    assert rows and all(r["fusedkit_us"] > 0 and r["cublaslt_epilogue_us"] > 0 for r in rows)
    assert (tmp_path / "matmul_tflops.png").exists()


def bench_cli(tmp_path, *args) -> tuple[str, dict]:
    """Run ``python -m fusedkit bench *args --json F`` as a user would; (stdout, the JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI must turn it on itself
    out_json = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "fusedkit", "bench", *args, "--json", str(out_json)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out_json.read_text())


def test_latency_report_runs(tmp_path):
    # On a GPU: one size and the torch.compile peer off, to keep the suite short.
    stdout, data = bench_cli(tmp_path, "--latency", "--dtypes", "fp32", "--sizes", "1024", "--no-compile")
    (row,) = data["elementwise"]
    assert row["n"] == 1024 and row["fusedkit.add_relu"] > 0 and row["torch.add"] > 0
    assert data["linear"] and "ratios to torch.add" in stdout


def test_backward_report_runs(tmp_path):
    _, data = bench_cli(tmp_path, "--backward", "--dtypes", "fp32", "--sizes", "4096", "--no-compile")
    (row,) = data["backward"]
    assert row["n"] == 4096 and row["bytes_backward"] == 3 * 4096 * 4
    # add_relu keeps only its output (x and y are not saved), as eager relu does
    assert row["fusedkit_saved_bytes"] == 4096 * 4 == row["eager_saved_bytes"]
    assert all(r["fusedkit_us"] > 0 and r["torch_us"] > 0 for r in data["linear_relu_training"])


def test_benchmark_suite_runs_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the suite is timed for real: scripts/gpu_run.sh pybench runs it")
    # a fresh session: not an xdist worker of this one (pytest-benchmark disables itself there)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "benchmarks", "--benchmark-only", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "fusedkit", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_matmul_report_tf32_flag(tmp_path):
    # --tf32 turns TF32 on for both sides, and the environment line says what fp32 ran as.
    _, on = bench_cli(tmp_path, "--matmul", "--dtypes", "fp32", "--shapes", "16x32x16", "--tf32")
    _, off = bench_cli(tmp_path, "--matmul", "--dtypes", "fp32", "--shapes", "16x32x16")
    assert on["environment"]["fp32_matmul"] == "tf32"
    assert off["environment"]["fp32_matmul"] == "tf32x3"
    assert on["matmul"][0]["fusedkit_us"] > 0
