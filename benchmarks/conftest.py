"""pytest-benchmark suite: ``pytest benchmarks/ --benchmark-only``.

On a GPU each timed call synchronises, warm-up rounds keep compilation out, and
every case also records the CUDA-event median of ``triton.testing.do_bench``.
On a CPU the kernels run in Triton's interpreter at tiny sizes so the harness
stays tested; ``extra_info["note"]`` says so.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


import pytest

import fusedkit


@pytest.fixture
def fk_settings():
    """Change fusedkit's settings for one case; the ones before are put back after it."""
    before = fusedkit.settings.current()
    yield fusedkit.settings.set
    fusedkit.settings.restore(before)
