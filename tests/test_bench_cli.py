"""The README's main job, ``python -m fusedkit bench``, runs and writes its files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedkit

pytestmark = pytest.mark.slow  # each test runs a report in a new process

ROOT = Path(__file__).resolve().parents[1]


def run_ok(cmd: list, env: dict) -> subprocess.CompletedProcess:
    """``cmd`` run from the repository root as a user would, with ``env``; it must succeed (the
    tail of its stderr shown where it does not)."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_report_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI must turn it on itself
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    proc = run_ok(
        [
            sys.executable,
            "-m",
            "fusedkit",
            "bench",
            "--sizes",
            "1024",
            "--layouts",
            "contiguous,bias,transposed",
            "--dtypes",
            "fp32",
            "--no-compile",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
            "--plots",
            str(tmp_path / "plots"),
        ],
        env,
    )
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
    args = (
        ["--dtypes", "bf16", "--shapes", "256x256x128,1x512x256"] if torch.cuda.is_available() else ["--dtypes", "fp32"]
    )
    run_ok(
        [
            sys.executable,
            "-m",
            "fusedkit",
            "bench",
            "--matmul",
            *args,
            "--json",
            str(out_json),
            "--plots",
            str(tmp_path),
        ],
        env,
    )
    rows = json.loads(out_json.read_text())["matmul"]
    assert rows and all(r["fusedkit_us"] > 0 and r["cublaslt_epilogue_us"] > 0 for r in rows)
    assert (tmp_path / "matmul_tflops.png").exists()


def bench_cli(tmp_path, *args) -> tuple[str, dict]:
    """Run ``python -m fusedkit bench *args --json F`` as a user would; (stdout, the JSON)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI must turn it on itself
    out_json = tmp_path / "report.json"
    proc = run_ok(
        [sys.executable, "-m", "fusedkit", "bench", *args, "--json", str(out_json)],
        env,
    )
    return proc.stdout, json.loads(out_json.read_text())


def test_latency_report_runs(tmp_path):
    # On a GPU: one size and the torch.compile peer off, to keep the suite short.
    stdout, data = bench_cli(tmp_path, "--latency", "--dtypes", "fp32", "--sizes", "1024", "--no-compile")
    (row,) = data["elementwise"]
    assert row["n"] == 1024 and row["fusedkit.add_relu"] > 0 and row["torch.add"] > 0
    assert data["linear"] and "ratios to torch.add" in stdout
    # the host table: every public op, forward and forward + backward, against its eager composition
    host = {(r["op"], r["mode"]) for r in data["host"]}
    public = {"add", "add_relu", "silu_mul", "gelu_mul", "add_gelu", "rms_norm", "layer_norm", "add_rms_norm"}
    public |= {"add_layer_norm", "matmul", "matmul gelu", "linear_relu", "mlp", "gated_mlp"}
    assert host >= {(op, mode) for op in public for mode in ("forward", "fwd+bwd")}
    assert all(r["fusedkit host"] > 0 and r["eager host"] > 0 for r in data["host"])
    assert "rows at or below eager's host time" in stdout


def test_latency_report_without_sizes_takes_the_devices_defaults(monkeypatch, capsys):
    # (on the CPU it passed None on, and the report failed on len(None))
    import torch

    from fusedkit.__main__ import main
    from fusedkit.bench import latency, report

    seen = []
    monkeypatch.setattr(latency, "run_latency", lambda dtypes, device, sizes, *a, **k: seen.append(sizes) or {})
    monkeypatch.setattr(latency, "format_latency_table", lambda result: "")
    main(["bench", "--latency", "--no-progress"])
    assert seen == [latency.LATENCY_SIZES if torch.cuda.is_available() else report.CPU_SIZES]


def test_backward_report_runs(tmp_path):
    _, data = bench_cli(tmp_path, "--backward", "--dtypes", "fp32", "--sizes", "4096", "--no-compile")
    rows = {r["op"]: r for r in data["backward"]}
    assert set(rows) == {"add_relu", "silu_mul", "gelu_mul", "gelu_tanh_mul", "add_gelu"}
    row = rows["add_relu"]
    assert row["n"] == 4096 and row["bytes_backward"] == 3 * 4096 * 4
    # add_relu keeps only its output (x and y are not saved), as eager relu does
    assert row["fusedkit_saved_bytes"] == 4096 * 4 == row["eager_saved_bytes"]
    # a gate keeps its inputs only; the eager composition keeps its intermediate (silu(a)) too
    assert rows["silu_mul"]["fusedkit_saved_bytes"] == 0 < rows["silu_mul"]["eager_saved_bytes"]
    assert rows["silu_mul"]["bytes_backward"] == 5 * 4096 * 4
    assert all(r["fusedkit_us"] > 0 and r["torch_us"] > 0 for r in data["linear_relu_training"])


def test_norms_report_runs(tmp_path):
    # On the CPU: the report's CPU shape; on a GPU its whole set (the suite's GPU run times it).
    stdout, data = bench_cli(tmp_path, "--norms", "--dtypes", "fp32", "--no-compile")
    rows = {r["op"]: r for r in data["norms"]}
    assert set(rows) == {k.name for k in fusedkit.registry.row_kernels()}
    for r in rows.values():
        assert r["fusedkit_fwd_us"] > 0 and r["eager_fwd_bwd_us"] > 0 and r["fusedkit_fwd_gbps"] > 0
        assert r["fusedkit_err"] < 1e-4 and "fusedkit_error" not in r
    assert "forward + backward" in stdout


def test_benchmark_suite_runs_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("on a GPU the suite is timed for real: scripts/gpu_run.sh pybench runs it")
    # a fresh session: not an xdist worker of this one (pytest-benchmark disables itself there)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "--benchmark-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_tile_sweep_runs_and_restores_the_tuning_table():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script must turn it on itself
    env["PYTHONPATH"] = str(ROOT)
    proc = run_ok(
        [
            sys.executable,
            "benchmarks/tile_sweep.py",
            "--kernels",
            "silu_mul",
            "--dtypes",
            "bf16",
            "--sizes",
            "12",
            "--blocks",
            "1024,4096",
            "--tiles",
            "2048",
            "--warps",
            "4",
        ],
        env,
    )
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("silu_mul")]
    assert [r[2] for r in rows] == ["contiguous", "bias"], proc.stdout
    assert rows[0][4].startswith("1024/4:") and rows[0][5].startswith("4096/4:")  # both blocks timed
    assert sum(cell.endswith("*") for cell in rows[0]) == 1  # one fastest


def host_profile_cases() -> tuple[str, ...]:
    """The cases ``benchmarks/host_profile.py`` runs by default."""
    spec = importlib.util.spec_from_file_location("host_profile", ROOT / "benchmarks" / "host_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES


def test_host_profile_prints_each_case_against_eager():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = run_ok(
        [sys.executable, "benchmarks/host_profile.py", "--calls", "20", "--top", "2", "--rows", "256", "--n", "128"],
        env,
    )
    cases = host_profile_cases()
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[-len(cases) :]}
    assert set(rows) == set(cases) and "function_roundtrip" in cases, proc.stdout
    # (four times in us, then eager's wall over the fused one's)
    assert all(len(cells) == 5 and all(float(c) > 0 for c in cells[:4]) for cells in rows.values()), proc.stdout


def test_tile_sweep_leaves_the_tuning_table_and_no_plan_behind(capsys):
    import importlib.util

    from fusedkit.runtime import configs, layout
    from fusedkit.runtime.elementwise import INTERPRETED

    if not torch.cuda.is_available() and not INTERPRETED:
        pytest.skip("off a GPU the sweep restarts itself in the interpreter")
    spec = importlib.util.spec_from_file_location("tile_sweep", ROOT / "benchmarks" / "tile_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    table = (configs.BLOCK_1D, configs.BLOCK_1D_NARROW, configs.TILE_ELEMS_2D, configs.ELEMENTWISE_WARPS)
    sweep.main(
        [
            "--kernels",
            "add_relu",
            "--dtypes",
            "bf16",
            "--sizes",
            "12",
            "--blocks",
            "2048",
            "--tiles",
            "8192",
            "--warps",
            "2",
        ]
    )
    assert "add_relu" in capsys.readouterr().out
    assert (configs.BLOCK_1D, configs.BLOCK_1D_NARROW, configs.TILE_ELEMS_2D, configs.ELEMENTWISE_WARPS) == table
    assert layout.plan_elementwise.cache_info().currsize == 0  # (no plan made with a swept tile survives)
    with pytest.raises(SystemExit):  # a transposed operand's tile is not the sweep's
        sweep.main(["--layouts", "transposed"])


def test_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "fusedkit", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'frobnicate'" in proc.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--dtypes", "float8"], "unknown dtype 'float8'; choose from fp16, bf16, fp32, fp64"),
        (["--kernels", "addrelu"], "unknown kernel 'addrelu'; choose from"),
        (["--layouts", "diagonal"], "unknown layout 'diagonal'"),
        (["--sizes", "many"], "is not a size"),
        (["--matmul", "--shapes", "4096x4096"], "is not MxNxK"),
    ],
)
def test_bad_choices_are_usage_errors_before_anything_runs(args, words):
    proc = subprocess.run(
        [sys.executable, "-m", "fusedkit", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_version_and_torch_dtype_names():
    import fusedkit

    proc = subprocess.run([sys.executable, "-m", "fusedkit", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(f"fusedkit {fusedkit.__version__} ")
    from fusedkit.__main__ import build_parser

    args = build_parser().parse_args(["bench", "--dtypes", "float32,bf16", "--sizes", "10,4096"])
    assert args.dtypes == ["fp32", "bf16"] and args.sizes == [1024, 4096]


def test_the_ops_group_is_the_registry_entries_with_a_backward():
    from fusedkit import registry
    from fusedkit.__main__ import build_parser

    args = build_parser().parse_args(["bench", "--kernels", "silu_mul,ops,gelu_grad"])
    ops = [k.name for k in registry.kernels() if k.backward is not None]
    assert args.kernels == ["silu_mul", *[k for k in ops if k != "silu_mul"], "gelu_grad"]
    assert {"add", "add_relu", "silu_mul", "add_gelu"} <= set(ops) and "gelu_grad" not in ops


def test_plots_without_matplotlib_fail_before_the_run(tmp_path, monkeypatch, capsys):
    import importlib.util

    from fusedkit.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--plots", str(tmp_path / "p"), "--json", str(tmp_path / "r.json")])
    assert info.value.code == 2 and "--plots needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_results_name_the_checkout_commit(monkeypatch):
    from fusedkit.bench.report import _commit

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout (a copied tree names its commit with FUSEDKIT_COMMIT)")
    monkeypatch.delenv("FUSEDKIT_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert head and _commit().startswith(head)
    monkeypatch.setenv("FUSEDKIT_COMMIT", "abc123")
    assert _commit() == "abc123"


@pytest.fixture
def no_report(monkeypatch):
    """``main`` in-process with the reports replaced: a bad argument must stop it before they start."""
    from fusedkit.bench import advice

    def started(args):
        raise AssertionError("the report started")

    monkeypatch.setattr("fusedkit.bench.run_command", started)
    monkeypatch.setattr(advice, "run_advise_command", started)


@pytest.mark.parametrize(
    "args, words",
    [
        # issue 45 item 4: "2**70" ran 70 elements; "63" was 2**63 elements and crashed in the report
        (["bench", "--sizes", "2**70"], "argument --sizes: '2**70' is 2**70 elements; the exponent must be 0 to 40"),
        (
            ["bench", "--sizes", "10,63"],
            "argument --sizes: '63' is 2**63 elements (a number below 64 is a power of two)",
        ),
        (["bench", "--sizes", "1099511627777"], "argument --sizes: '1099511627777' is more than 2**40 elements"),
        (["bench", "--sizes", "\u00b2"], "argument --sizes: '\u00b2' is not a size"),  # isdigit() took it, int() not
        # sizes the layouts cannot make: the report ran 64 (992, 4096) elements labelled 70 (1000, 5000)
        (["bench", "--sizes", "70"], "--sizes 70 does not fill the transposed layout (8x8 makes 64 elements)"),
        (["bench", "--sizes", "1000", "--layouts", "transposed"], "--sizes 1000 does not fill the transposed layout"),
        (["bench", "--sizes", "5000", "--layouts", "bias"], "--sizes 5000 does not fill the bias layout (1x4096"),
        (["bench", "--bias-cols", "3000"], "does not fill the bias layout"),  # the default sizes
        # issue 45 item 12: ZeroDivisionError, and a tensor of negative dimension
        (["bench", "--bias-cols", "0"], "argument --bias-cols: '0' is not a positive integer"),
        (["bench", "--bias-cols", "-3"], "argument --bias-cols: '-3' is not a positive integer"),
        (["bench", "--matmul", "--shapes", "0x64x64"], "argument --shapes: '0x64x64' has a zero dimension"),
        (["bench", "--matmul", "--shapes", "2000000x2000000x1"], "has an operand of more than 2**40 elements"),
        (["bench", "--matmul", "--shapes", "8x8x\u00b2"], "argument --shapes: '8x8x\u00b2' is not MxNxK"),
        # issue 45 item 12: a missing directory failed after the whole report
        (["bench", "--json", "{tmp}/missing/r.json"], "argument --json: '{tmp}/missing/r.json': its directory"),
        (["bench", "--csv", "{tmp}/missing/r.csv"], "argument --csv: '{tmp}/missing/r.csv': its directory"),
        (["advise", "--json", "{tmp}/missing/r.json"], "argument --json: '{tmp}/missing/r.json': its directory"),
        (["bench", "--json", "{tmp}/file/r.json"], "its directory {tmp}/file is not a directory"),
        (["bench", "--json", "{tmp}"], "argument --json: '{tmp}' is a directory; name a file"),
        (["bench", "--json", ""], "argument --json: '' is empty; name a file"),
        (["bench", "--plots", "{tmp}/file"], "argument --plots: '{tmp}/file' is a file; name a directory"),
        (["bench", "--plots", "{tmp}/file/plots"], "argument --plots: {tmp}/file is a file; name a directory"),
        (["bench", "--json", "{tmp}/r", "--csv", "{tmp}/r"], "--json and --csv name the same file"),
    ],
)
def test_bad_values_are_usage_errors_before_any_report(args, words, tmp_path, capsys, no_report):
    from fusedkit.__main__ import main

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the usage, the error on one line
    assert info.value.code == 2 and "error: " in last and words.format(tmp=tmp_path) in last, err
    assert "Traceback" not in err


def test_an_unwritable_destination_is_refused_before_the_report(tmp_path, monkeypatch, capsys, no_report):
    from fusedkit.__main__ import main

    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # (as root, chmod would not refuse)
    with pytest.raises(SystemExit) as info:
        main(["bench", "--json", str(tmp_path / "r.json")])
    assert info.value.code == 2 and "cannot be written (permission denied)" in capsys.readouterr().err


def test_the_parser_takes_what_the_reports_can_run(tmp_path):
    from fusedkit import registry
    from fusedkit.__main__ import build_parser, check_bench
    from fusedkit.bench.cases import make_operands

    parser = build_parser()

    def parsed(*args):
        ns = parser.parse_args(["bench", *args])
        check_bench(parser, ns)  # no SystemExit
        return ns

    # exponents 0..40 (a size given twice runs once), counts from 64 up to 2**40
    assert parsed("--sizes", "0,2**3,40,64,1099511627776,20,2**20").sizes == [1, 8, 1 << 40, 64, 1 << 20]
    ns = parsed("--sizes", "1000,2000,256", "--bias-cols", "1000", "--layouts", "contiguous,bias")
    for n in ns.sizes:  # the bias layout makes exactly n elements: 1000 x 1, 1000 x 2, 256 x 1
        assert make_operands(registry.get("add"), "bias", n, torch.float32, "meta", 1000)[0].numel() == n
    assert parsed("--backward", "--sizes", "70").sizes == [70]  # contiguous sizes only: any count fits
    assert parsed("--latency", "--sizes", "1000").sizes == [1000]
    assert parsed("--matmul", "--shapes", "1x4096x4096").shapes == [(1, 4096, 4096)]
    assert parsed("--plots", str(tmp_path / "new" / "plots")).plots == str(tmp_path / "new" / "plots")
    assert parsed("--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv")).csv == str(tmp_path / "r.csv")
