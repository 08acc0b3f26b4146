"""Real models (pytest-benchmark): one training step of each model in
``fusedkit.bench.models``, stock eager against the model with fusedkit in it; on a CPU the
tiny sizes, in Triton's interpreter. ``python -m fusedkit bench --models`` is the full
report (inference, memory, losses, the compiled peer)."""

from __future__ import annotations

import pytest
import torch

from fusedkit.bench import models

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


@pytest.mark.parametrize("variant", ["eager", "fusedkit"])
@pytest.mark.parametrize("name", list(models.MODELS))
def test_training_step(benchmark, name, variant):
    case = models.MODELS[name]
    reason = models.unavailable(case)
    if reason is not None:
        pytest.skip(reason)
    benchmark.group = f"{name} training step"
    step, check = models.training_step(case, variant, DEVICE, small=not ON_GPU)

    def run():
        step()
        if ON_GPU:
            torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=10 if ON_GPU else 2, warmup_rounds=2 if ON_GPU else 1)
    check()
