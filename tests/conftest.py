"""Test set-up: on a machine without a GPU, run the real Triton kernels in the
interpreter. The variable must be set before fusedkit (and so Triton's
decorators) is imported, which is why it happens here, at collection."""

from __future__ import annotations

import os
import re

import torch

# FUSEDKIT_TEST_CPU_BACKEND=torch leaves the interpreter off, so CPU tensors take the PyTorch path.
if not torch.cuda.is_available() and os.environ.get("FUSEDKIT_TEST_CPU_BACKEND") != "torch":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's notice; keeps its default
# On a GPU every new matmul shape would be tuned over all configs (8 compiles each);
# the suite runs the fixed config and test_matmul.py::test_autotuned_path covers tuning.
os.environ.setdefault("FUSEDKIT_AUTOTUNE", "0")

import pytest

import fusedkit

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fk_settings():
    """Change fusedkit's settings for one test, ``fk_settings(autotune=True)``; the ones
    before are put back after it."""
    before = fusedkit.settings.current()
    yield fusedkit.settings.set
    fusedkit.settings.restore(before)


def pytest_report_header(config):
    return (
        f"fusedkit {fusedkit.__version__}: device {DEVICE}, backend {fusedkit.backend_for(DEVICE)}, "
        f"torch {torch.__version__}, triton {__import__('triton').__version__}"
    )


def passed_in_log(lines) -> set[str]:
    """Node ids a ``pytest -v`` log reports as PASSED, with or without pytest-xdist."""
    passed = set()
    for line in lines:
        # "tests/x.py::test[id] PASSED [ 3%]", or with xdist "[gw1] [ 3%] PASSED tests/x.py::test[id]"
        found = re.match(r"(\S+::.*?) PASSED\b", line) or re.search(r"PASSED (\S+::.*?)\s*$", line)
        if found:
            passed.add(found.group(1))
    return passed


def pytest_collection_modifyitems(config, items):
    """``FUSEDKIT_SKIP_PASSED=log``: leave out the tests a previous ``pytest -v`` log reports
    as PASSED, so a GPU run cut off by its time limit continues where it stopped."""
    log = os.environ.get("FUSEDKIT_SKIP_PASSED")
    if not log or not os.path.exists(log):
        return
    with open(log, encoding="utf-8", errors="replace") as f:
        passed = passed_in_log(f)
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in passed])
    items[:] = [item for item in items if item.nodeid not in passed]
