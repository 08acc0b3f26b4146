"""The test harness's own helpers (tests/conftest.py)."""

from __future__ import annotations

from conftest import passed_in_log


def test_skip_passed_reads_both_log_formats():
    # The GPU script's continuation (FUSEDKIT_SKIP_PASSED) must read pytest -v lines with and
    # without xdist, parametrisation ids with spaces included, and nothing else.
    log = [
        "tests/test_a.py::test_x[add-(torch.int64, torch.float32)] PASSED     [  3%]",
        "[gw2] [ 40%] PASSED tests/test_b.py::test_y[1]",
        "tests/test_a.py::test_z FAILED [ 50%]",
        "tests/test_a.py::test_w SKIPPED (needs a GPU) [ 60%]",
        "=== 2 passed, 1 failed ===",
    ]
    assert passed_in_log(log) == {
        "tests/test_a.py::test_x[add-(torch.int64, torch.float32)]",
        "tests/test_b.py::test_y[1]",
    }
