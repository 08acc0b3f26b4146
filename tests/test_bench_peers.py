"""The benchmark's tutorial-style peer computes what the registry says (else its times mean nothing)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

import fusedkit
from fusedkit.bench import report as bench
from fusedkit.bench.peers import supports_tutorial, tutorial
from fusedkit.testing import assert_matches_reference, reference_result

PEER_KERNELS = [k for k in fusedkit.registry.kernels() if supports_tutorial(k, torch.float32)]


@pytest.mark.parametrize("layout", bench.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", PEER_KERNELS, ids=lambda k: k.name)
def test_tutorial_peer_matches_the_reference(spec, dtype, layout):
    ops = bench.make_operands(spec, layout, 4096, dtype, DEVICE, bias_cols=64)
    got = tutorial(spec, *ops, alpha=spec.param_default)
    assert got.is_contiguous() and got.shape == torch.broadcast_shapes(*(t.shape for t in ops))
    assert_matches_reference(got, reference_result(spec, ops, spec.param_default))


def test_peer_is_offered_for_every_binary_float_kernel():
    assert {k.name for k in PEER_KERNELS} >= {"add", "add_relu"}
    assert not supports_tutorial(fusedkit.registry.get("add"), torch.int32)
