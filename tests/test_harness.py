"""The test harness's own helpers (tests/conftest.py, tests/helpers.py)."""

from __future__ import annotations

import pytest
from conftest import passed_in_log
from helpers import one_at_a_time, slow_unless

import fusedkit


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


def test_one_at_a_time_keeps_each_axis_whole_against_the_representative():
    params = one_at_a_time([(a, b) for a in ("x", "y", "z") for b in (1, 2, 3)], ("x", 1))
    quick = [p.values for p in params if not p.marks]
    assert quick == [("x", 1), ("x", 2), ("x", 3), ("y", 1), ("z", 1)]
    assert all([m.name for m in p.marks] == ["slow"] for p in params if p.marks) and len(params) == 9
    assert [p.id for p in params[:2]] == ["x-1", "x-2"]
    with pytest.raises(ValueError, match="representative"):  # a misspelt representative
        one_at_a_time([("x", 1), ("y", 1)], ("w", 1))
    with pytest.raises(ValueError, match="no combination"):  # a test left to the slow run alone
        slow_unless(lambda *c: False, [("x", 1)])


def _quick_values(test) -> list[tuple]:
    (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
    return [p.values for p in mark.args[1] if not any(m.name == "slow" for m in p.marks)]


def test_the_quick_subset_runs_every_op_in_every_dtype():
    # The quick subset's one sweep of op x dtype (docs/design.md, "The test grid"); the
    # layout tests run their other axes with add_relu in float32 alone.
    from test_elementwise import test_contiguous

    quick = {(kernel.name, dtype) for kernel, dtype, _ in _quick_values(test_contiguous)}
    assert quick == {(k.name, d) for k in fusedkit.registry.kernels() for d in k.dtypes}
