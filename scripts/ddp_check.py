"""Data-parallel training with fusedkit modules matches single-process training.

    torchrun --nproc_per_node=2 scripts/ddp_check.py [--steps 20]

Each rank trains a small MLP of ``fusedkit.nn.LinearReLU`` layers and a ResNet
basic block joined by ``fusedkit.add_relu`` under ``DistributedDataParallel``,
on its half of every batch. Rank 0 also trains copies of both models on the
whole batches in one process, without DDP: with a mean loss over equal halves,
DDP's averaged gradients are the whole-batch gradients, so after ``--steps``
SGD steps the parameters must agree within tolerance. On two or more GPUs it
uses NCCL (with NVLink multicast off) and one GPU per rank; otherwise gloo on
the CPU, where the kernels run in Triton's interpreter. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusedkit is imported
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import fusedkit  # noqa: E402

LR = 0.05


class Block(torch.nn.Module):
    """ResNet basic block; the residual join is one fused add + ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)

    def forward(self, x):
        return fusedkit.add_relu(self.conv2(torch.relu(self.conv1(x))), x)


def mlp(dims=(16, 32, 8)):
    return torch.nn.Sequential(*(fusedkit.nn.LinearReLU(i, o) for i, o in zip(dims, dims[1:])))


def train(model, batches, device, rank=0, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        part = batch.chunk(world)[rank].to(device)
        opt.zero_grad()
        model(part).square().mean().backward()
        opt.step()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    dist.init_process_group("nccl" if gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}") if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    dtype = torch.float32

    torch.manual_seed(0)  # same initial weights and data on every rank
    models = {"mlp": mlp(), "resnet_block": Block(4)}
    data = {"mlp": [torch.randn(8 * world, 16) for _ in range(args.steps)],
            "resnet_block": [torch.randn(2 * world, 4, 6, 6) for _ in range(args.steps)]}
    result = {"world": world, "backend": dist.get_backend(), "device": str(device), "steps": args.steps}
    for name, model in models.items():
        single = copy.deepcopy(model).to(device, dtype)
        ddp = DDP(model.to(device, dtype), device_ids=[rank] if gpus else None)
        train(ddp, data[name], device, rank, world)
        if rank == 0:
            train(single, data[name], device)
            diff = max((a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), single.parameters()))
            result[f"{name}_max_param_diff"] = diff
    if rank == 0:
        print(json.dumps(result))
    # Rank 0 trains the single-process copies too; tearing the group down while it is still
    # busy aborted rank 1 in gloo now and then ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
