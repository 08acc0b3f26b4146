"""DTensor sharding rules of fusedkit's ops (fusedkit.sharding), on one process; the
two-process training checks are tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

import fusedkit
from fusedkit import sharding

placement = pytest.importorskip("torch.distributed.tensor", reason="torch.distributed is not available in this build")
Replicate, Shard = placement.Replicate, placement.Shard


def test_pointwise_rules_shard_along_each_result_dim_and_replicate_broadcasts():
    # x (4, 6) + bias (6,): the bias has the column dim only
    options = sharding._pointwise((4, 6), [(4, 6), (6,)])
    assert options == [
        ([Replicate()], [Replicate(), Replicate()]),
        ([Shard(0)], [Shard(0), Replicate()]),
        ([Shard(1)], [Shard(1), Shard(0)]),
    ]
    # a size-1 dim broadcasts: replicated there
    assert sharding._pointwise((4, 6), [(4, 6), (1, 6)])[1] == ([Shard(0)], [Shard(0), Replicate()])
    # no operand has the dim: no sharded option for it
    assert sharding._pointwise((4, 6), [(1, 6), (6,)]) == [
        ([Replicate()], [Replicate(), Replicate()]),
        ([Shard(1)], [Shard(1), Shard(0)]),
    ]


def test_every_op_takes_a_tensor_first():
    # torch 2.11's DTensor looks for the device mesh in an op's first argument only: with the
    # kernel's name first, every tensor-parallel call failed there (torch 2.13 looks further)
    for name in ("elementwise", "elementwise_out", "elementwise_pair", "matmul"):
        first = getattr(torch.ops.fusedkit, name).default._schema.arguments[0]
        assert str(first.type) in ("Tensor", "List[Tensor]"), (name, first)


def test_plain_tensors_are_never_k_sharded():
    a, b = torch.randn(3, 4), torch.nn.Parameter(torch.randn(4, 5))
    assert not sharding.k_sharded(a, b)


def test_rules_are_registered_once_dtensor_is_imported():
    sharding.ensure_registered()
    from torch.distributed.tensor import DTensor

    known = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
    for op in (torch.ops.fusedkit.elementwise.default, torch.ops.fusedkit.matmul.default):
        assert known[op].static_argnum == 0  # the kernel name and the activation are in the cache key
    assert fusedkit.add_relu(torch.ones(2), -2.0).tolist() == [0.0, 0.0]  # plain tensors as before


def test_rules_register_with_dtensors_import_before_or_after_fusedkit():
    # A fresh process: fusedkit first does not import torch.distributed.tensor, and its later
    # import registers the rules (a compiled model may meet a DTensor before any eager call).
    import subprocess
    import sys

    code = (
        "import sys, importlib.util, fusedkit\n"
        "from fusedkit import sharding\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
        "importlib.util.find_spec('torch.distributed.tensor')\n"
        "assert not sharding._registered\n"
        "import torch.distributed.tensor\n"
        "assert sharding._registered and sharding._DTensor is torch.distributed.tensor.DTensor\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
