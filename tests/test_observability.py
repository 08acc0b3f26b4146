"""What a user sees of fusedkit's calls: torch.profiler ranges and the logger's launch plans."""

from __future__ import annotations

import logging

import torch
from conftest import DEVICE
from helpers import rand

import fusedkit


def test_eager_calls_are_profiler_ranges():
    x = rand((32, 16), torch.float32, DEVICE)
    w = rand((16, 8), torch.float32, DEVICE)
    fusedkit.add_relu(x, x)  # a signature seen before takes the fast path: profiled all the same
    with torch.profiler.profile() as prof:
        fusedkit.add_relu(x, x)
        fusedkit.add(x, 1.5, out=torch.empty_like(x))
        fusedkit.matmul(x, w, None, "relu")
    names = {e.name for e in prof.events()}
    assert {"fusedkit::add_relu", "fusedkit::add", "fusedkit::matmul"} <= names
    with torch.profiler.profile() as prof:
        y = fusedkit.add_relu(x.clone().requires_grad_(), x)
        y.sum().backward()  # the backward's relu_grad kernel too
    assert "fusedkit::relu_grad" in {e.name for e in prof.events()}


def test_debug_log_names_the_launch_plan(caplog):
    x = rand((37, 29), torch.bfloat16, DEVICE)
    with caplog.at_level(logging.DEBUG, logger="fusedkit"):
        fusedkit.add_relu(x, x.t().contiguous().t())
        fusedkit.matmul(rand((9, 33), torch.float32, DEVICE), rand((33, 5), torch.float32, DEVICE), None, "gelu")
    text = caplog.text
    if fusedkit.backend_for(DEVICE) == "torch":
        assert "matmul" not in text  # the PyTorch path plans no launch
        return
    assert "add_relu: shape (37, 29) torch.bfloat16" in text and "programs of" in text
    assert "matmul (9, 33) x (33, 5) torch.float32, activation gelu" in text
    with caplog.at_level(logging.INFO, logger="fusedkit"):
        caplog.clear()
        fusedkit.add_relu(rand((41,), torch.float32, DEVICE), 1.0)
    assert caplog.text == ""


def test_clear_caches_forgets_kept_plans_and_launches():
    from fusedkit.runtime import elementwise as ew
    from fusedkit.runtime import matmul as mm

    x = rand((19,), torch.float32, DEVICE)
    a, b = rand((6, 8), torch.float32, DEVICE), rand((8, 5), torch.float32, DEVICE)
    for _ in range(2):  # the second call of a signature keeps its recipe
        fusedkit.add_relu(x, x)
        fusedkit.matmul(a, b)
    kept = len(ew.KEPT) + len(mm.KEPT) + ew.plan_elementwise.cache_info().currsize
    assert kept > 0 or fusedkit.backend_for(DEVICE) == "torch"
    fusedkit.clear_caches()
    assert len(ew.KEPT) == len(mm.KEPT) == ew.plan_elementwise.cache_info().currsize == 0
    torch.testing.assert_close(fusedkit.add_relu(x, x), torch.relu(x + x))  # and calls still work
