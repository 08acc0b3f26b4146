"""The latency report's host table (``fusedkit.bench.host``) and its processes: what each
number is made of, without timing anything real."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fusedkit.bench import host, latency, processes


def test_host_pair_alternates_the_sides_and_keeps_each_ones_best_round(monkeypatch):
    calls = []
    clock = iter(range(10_000))
    monkeypatch.setattr(host.time, "perf_counter", lambda: next(clock))
    fused, eager = (lambda: calls.append("f")), (lambda: calls.append("e"))
    f_us, e_us = host.host_pair(fused, eager, torch.device("cpu"), calls=2, rounds=3)
    assert calls[2:] == ["f", "f", "e", "e"] * 3  # (after one warm-up call each)
    assert f_us == e_us == 1e6  # (each call one tick of the stand-in clock)
    calls.clear()
    host.host_pair(fused, eager, torch.device("cpu"), calls=1, rounds=2, eager_first=True)
    assert calls == ["e", "f", "e", "f", "e", "f"]


def test_a_round_is_the_median_of_its_calls_and_a_side_its_best_round(monkeypatch):
    # fused calls take 1, 9, 2 ticks in round one and 5, 5, 5 in round two: medians 2 and 5
    durations = iter([0, 1, 9, 2, 5, 5, 5])  # (a warm-up call first, untimed; eager's calls take 0)
    now = [0]

    def fused():
        now[0] += next(durations)

    monkeypatch.setattr(host.time, "perf_counter", lambda: now[0])
    f_us, e_us = host.host_pair(fused, lambda: None, torch.device("cpu"), calls=3, rounds=2)
    assert f_us == 2e6 and e_us == 0


def test_merge_latency_gives_medians_and_the_host_ratios_range():
    def run(scale):
        row = {"op": "add", "shape": "1024", "mode": "forward", "fusedkit host": 10.0 * scale, "eager host": 10.0}
        return {
            "environment": {"commit": "x"},
            "elementwise": [{"dtype": "bfloat16", "n": 1024, "torch.add": 5.0 * scale, "graph torch.add": None}],
            "linear": [],
            "norms": [],
            "host": [row],
            "host dtype": "bfloat16",
        }

    merged = latency.merge_latency([run(1.0), run(3.0), run(2.0)])
    assert "environment" not in merged and merged["processes"] == 3 and merged["host dtype"] == "bfloat16"
    assert merged["elementwise"] == [{"dtype": "bfloat16", "n": 1024, "torch.add": 10.0, "graph torch.add": None}]
    (row,) = merged["host"]
    assert row["fusedkit host"] == 20.0 and row["ratio range"] == [1.0, 3.0]
    assert "1.00-3.00" in latency.format_latency_table({**merged, "elementwise": []})


def test_run_children_numbers_each_process_and_names_those_that_failed(monkeypatch):
    seen = []

    def fake_run(cmd, check, env, stdout):
        index = int(env[processes.PROCESS_ENV])
        seen.append((index, cmd[cmd.index("bench") + 1 :]))
        if index != 1:  # (the second process fails: it writes nothing)
            with open(cmd[cmd.index("--json") + 1], "w") as f:
                json.dump({"index": index}, f)

    monkeypatch.setattr(processes.subprocess, "run", fake_run)
    payloads, failed = processes.run_children(["--latency"], 3, "latency", progress=False)
    assert [i for i, _ in seen] == [0, 1, 2] and all(argv[0] == "--latency" for _, argv in seen)
    assert payloads == [{"index": 0}, {"index": 2}] and list(failed) == ["process 2"]


def test_latency_with_processes_merges_the_childrens_reports(monkeypatch, capsys):
    from fusedkit.__main__ import main

    child = {
        "environment": {},
        "elementwise": [],
        "linear": [],
        "norms": [],
        "host": [{"op": "add", "shape": "1024", "mode": "forward", "fusedkit host": 4.0, "eager host": 8.0}],
        "host dtype": "bfloat16",
    }
    argvs, failed = [], {}

    def children(argv, n, label, progress):
        argvs.append(argv)
        return [child] * (n - len(failed)), failed

    monkeypatch.setattr(processes, "run_children", children)
    assert main(["bench", "--latency", "--processes", "2", "--dtypes", "bf16", "--no-compile", "--no-progress"]) == 0
    assert argvs == [["--latency", "--dtypes", "bf16", "--no-compile"]]
    out = capsys.readouterr().out
    assert "median of 2 processes" in out and "0.50-0.50" in out
    # sizes as the children read them (a number below 64 is an exponent there: 2**5 is 32 elements)
    main(["bench", "--latency", "--processes", "2", "--sizes", "5,1000", "--no-progress"])
    assert argvs[-1][argvs[-1].index("--sizes") + 1] == "2**5,1000"
    capsys.readouterr()
    # a process that did not finish: the others' numbers, the missing one named, and the report fails
    failed["process 2"] = "it wrote no results"
    assert main(["bench", "--latency", "--processes", "2", "--no-progress"]) == 1
    assert "1 finished; did not: {'process 2'" in capsys.readouterr().out


def test_merging_processes_whose_rows_differ_is_refused():
    row = {"op": "add", "shape": "1024", "mode": "forward", "fusedkit host": 1.0, "eager host": 1.0}
    runs = [{"host": [row]}, {"host": [dict(row, shape="2048")]}]
    with pytest.raises(ValueError, match="rows differ"):
        latency.merge_latency(runs)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_pin_holds_the_report_to_one_core(monkeypatch, capsys):
    from fusedkit.__main__ import main

    pinned, seen = [], {}
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(set(cores)))
    monkeypatch.setattr(latency, "run_latency", lambda *a, **k: {"elementwise": [], "linear": []})
    monkeypatch.setattr(latency, "format_latency_table", lambda result: "")
    from fusedkit.bench import report

    real = report.print_report
    monkeypatch.setattr(report, "print_report", lambda env, *a: seen.update(env) or real(env, *a))
    main(["bench", "--latency", "--pin", "--no-progress"])
    core = max(os.sched_getaffinity(0))
    threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    assert len(pinned) >= len(threads) and all(cores == {core} for cores in pinned)  # (every thread)
    assert seen["pinned_core"] == core
