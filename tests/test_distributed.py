"""fusedkit under torch.distributed (scripts/distributed_check.py): DDP, FSDP2 and tensor
parallel training give the losses, gradients and parameters of the same model built from
torch modules; fusedkit's ops on DTensors follow their sharding rules; a
torch.distributed.checkpoint round trip restores the fused model. Two processes with gloo
on the CPU (the kernels in Triton's interpreter); NCCL on a GPU per rank, one rank where
the machine has one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # processes under torch.distributed (about 10 s on the CPU)

ROOT = Path(__file__).resolve().parents[1]
#: fp32 after 5 SGD steps: the parallel forms sum gradients in another order than one process.
TOLERANCE = 1e-5
#: The fp32 matmul on a GPU runs TF32 products (tf32x3 by default) against torch's fp32 ones.
GPU_TOLERANCE = 1e-3
#: Per case of scripts/distributed_check.py's check_rules: the result's placements and the
#: collectives the call runs: none but a row-parallel activation's reduction, and the gather
#: an ``out=`` placed otherwise than the result needs (nothing is gathered to compute).
RULES = {
    "linear_relu_colwise": (["S(1)"], {}),
    "linear_relu_rowwise": (["R"], {"all_reduce": 1}),
    "matmul_rowwise_partial": (["P(sum)"], {}),
    "add_relu_broadcast": (["S(1)"], {}),
    "silu_mul_rows": (["S(0)"], {}),
    "add_relu_out": (["S(0)"], {}),
    "add_relu_out_replicated": (["R"], {"all_gather_into_tensor": 1}),
    "add_rms_norm_rows": (["S(0)"], {}),
    "rms_norm_rows_weight_grad": (["P(sum)"], {}),
    # the MLP ops: (placements, collectives, the op's calls on one rank's shards)
    "gated_mlp_tensor_parallel": (["R"], {"all_reduce": 1}, 1),  # (the down bias after the reduction)
    "gated_mlp_tensor_parallel_partial": (["P(sum)"], {}, 1),
    "gated_mlp_rows": (["S(0)"], {}, 1),
    "mlp_tensor_parallel": (["R"], {"all_reduce": 1}, 1),
    "mlp_rows": (["S(0)"], {}, 1),
    "mlp_k_sharded": (["R"], {"all_reduce": 1}, 0),
    # (placements a local call would get wrong: rows that do not divide among the ranks, and a
    # gate placed otherwise than its up projection; the composition computes them)
    "mlp_rows_uneven": (["S(0)"], {}, 0),
    "gated_mlp_gate_and_up_placed_apart": (["P(sum)"], {}, 0),
}


@pytest.fixture(scope="module")
def result():
    try:
        import torch.distributed.run
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("torch.distributed (with FSDP2) is not available in this build")
    gpus = torch.cuda.device_count()
    ranks = min(2, gpus) if gpus else 2
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(ROOT / "scripts/distributed_check.py"),
            "--steps",
            "5",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["world"] == ranks and found["backend"] == ("nccl" if gpus else "gloo")
    return found


def tolerance(result) -> float:
    """This run's tolerance: NCCL ranks run on GPUs (TF32 products), gloo ones on the CPU."""
    return GPU_TOLERANCE if result["backend"] == "nccl" else TOLERANCE


@pytest.mark.parametrize("form", ["ddp", "fsdp", "tp"])
def test_parallel_training_matches_the_torch_model(result, form):
    tol = tolerance(result)
    for what in ("loss_diff", "first_grad_diff", "param_diff"):
        assert result[f"{form}_{what}"] < tol, (form, what, result[f"{form}_{what}"])


@pytest.mark.parametrize("case", ["tp_swiglu", "tp_compiled"])
def test_more_tensor_parallel_models(result, case):
    tol = tolerance(result)
    assert result[f"{case}_out_diff"] < tol and result[f"{case}_grad_diff"] < tol


def test_compiled_tensor_parallel_gathers_nothing(result):
    # A row-parallel LinearReLU reduces its partial sums in the graph too (it gathered the
    # operands when only eager calls took the split: 2 all_gathers in these graphs).
    # (one rank has nothing to reduce: the compiled graph drops the collective)
    found = result["tp_compiled_collectives"]
    assert found["all_gather_into_tensor"] == 0 and found["all_reduce"] >= (result["world"] > 1), found


def test_ddp_of_the_earlier_models(result):
    tol = tolerance(result)
    assert result["ddp_linear_relu_mlp_param_diff"] < tol and result["ddp_conv_block_param_diff"] < tol


@pytest.mark.parametrize("case", sorted(RULES))
def test_ops_on_dtensors_follow_their_rules(result, case):
    placements, diff, comms, local = result["rules"][case]
    want_placements, want_comms, *want_local = RULES[case]
    assert placements == want_placements and local == (want_local or [0])[0]
    assert diff < tolerance(result) * 10
    if result["world"] > 1:  # (a one-rank mesh may skip its collectives)
        assert comms == want_comms


def test_checkpoint_round_trip(result):
    assert result["checkpoint_param_diff"] == 0 and result["checkpoint_next_loss_diff"] == 0
