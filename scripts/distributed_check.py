"""fusedkit's modules under torch.distributed train as the same model built from torch modules.

    torchrun --nproc_per_node=2 scripts/distributed_check.py [--steps 5] [--checkpoint DIR]

Every rank builds the same model twice from one seed: with fusedkit's modules (``LinearReLU``,
``AddReLU``, ``fusedkit.add_relu``) and with torch's (``nn.Linear`` + ReLU, ``relu(x + y)``),
whose state dicts have the same keys. Each parallel form trains the fused model for
``--steps`` SGD steps and compares its losses, first gradients and final parameters with the
torch model trained in one process on the whole batches:

- ``ddp``: ``DistributedDataParallel`` over an MLP of ``LinearReLU`` layers and a ResNet basic
  block joined by ``fusedkit.add_relu``; each rank trains on its share of every batch.
- ``fsdp``: FSDP2 (``fully_shard`` on each block, then the model), each rank its share.
- ``tp``: tensor parallel over the ranks (``ColwiseParallel`` up-projections,
  ``RowwiseParallel`` down-projections: one ``nn.Linear``, one ``LinearReLU``, whose ReLU
  runs after the reduction), every rank on the whole batch; DTensor weights and activations
  reach fusedkit's ops, which run on their shards (``fusedkit.sharding``); the same model
  compiled whole (``torch.compile(fullgraph=True)``); and a ``SwiGLU`` (gate and up
  column-parallel, down row-parallel).
- ``checkpoint``: the FSDP2 model's state saved with ``torch.distributed.checkpoint``, loaded
  into a fresh fused model sharded the same way, and one more step from each.

On as many GPUs as ranks it uses NCCL (NVLink multicast off), one GPU per rank; otherwise gloo
on the CPU, with the kernels in Triton's interpreter. Prints one JSON line: the largest
differences per form.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile

import torch

_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
if not _gpus:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fusedkit is imported
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import fusedkit  # noqa: E402

LR = 0.05
DIM, HIDDEN = 16, 32


class Block(nn.Module):
    """``relu(down(act(up(x))) + x)``: fused (``LinearReLU`` up, an ``AddReLU`` join) or torch's;
    ``down_relu``: the down-projection is a ``LinearReLU`` (torch: Linear + ReLU) too."""

    def __init__(self, fused: bool, down_relu: bool):
        super().__init__()
        linear_relu = fusedkit.nn.LinearReLU if fused else nn.Linear
        self.fused, self.down_relu = fused, down_relu
        self.up = linear_relu(DIM, HIDDEN)
        self.down = (linear_relu if down_relu else nn.Linear)(HIDDEN, DIM)
        self.join = fusedkit.nn.AddReLU() if fused else None

    def forward(self, x):
        h = self.up(x) if self.fused else torch.relu(self.up(x))
        h = self.down(h)
        if self.down_relu and not self.fused:
            h = torch.relu(h)
        return self.join(h, x) if self.fused else torch.relu(h + x)


class MLP(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.blocks = nn.ModuleList([Block(fused, down_relu=False), Block(fused, down_relu=True)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ConvBlock(nn.Module):
    """ResNet basic block; the residual join is one fused add + ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)

    def forward(self, x):
        return fusedkit.add_relu(self.conv2(torch.relu(self.conv1(x))), x)


def linear_relu_mlp(dims=(16, 32, 8)):
    return nn.Sequential(*(fusedkit.nn.LinearReLU(i, o) for i, o in zip(dims, dims[1:])))


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one whole tensor (a DTensor's gathered)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(xs, ys) -> float:
    return max(((local(a).detach() - local(b).detach()).abs().max().item() for a, b in zip(xs, ys)), default=0.0)


def mean_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def train(model, batches, device, rank=0, world=1, shard=True):
    """SGD steps on ``model``: each rank's share of every batch (``shard``) or all of it.
    Returns the losses of the whole batches (averaged over ranks) and the first step's gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for batch in batches:
        part = (batch.chunk(world)[rank] if shard else batch).to(device)
        opt.zero_grad()
        loss = mean_loss(model(part))
        loss.backward()
        if first_grads is None:
            first_grads = [local(p.grad).clone() for p in model.parameters()]
        value = loss.detach().clone()
        if shard and world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
        opt.step()
    return losses, first_grads


def reference(model, batches, device):
    """The torch model trained in one process on the whole batches."""
    return train(model, batches, device, shard=False)


def compare(name, result, fused_model, fused_run, torch_model, torch_run):
    (f_losses, f_grads), (t_losses, t_grads) = fused_run, torch_run
    result[f"{name}_loss_diff"] = max(abs(a - b) for a, b in zip(f_losses, t_losses))
    result[f"{name}_first_grad_diff"] = max_diff(f_grads, t_grads)
    result[f"{name}_param_diff"] = max_diff(list(fused_model.parameters()), list(torch_model.parameters()))


def add_relu_into(x, y, out):
    """``fusedkit.add_relu(x, y, out=out)``, which must return ``out`` itself."""
    got = fusedkit.add_relu(x, y, out=out)
    if got is not out:
        raise AssertionError("add_relu(out=) returned another tensor")
    return got


def _rms_weight_grad(h, w):
    w = w.clone().requires_grad_()
    return torch.autograd.grad(torch.nn.functional.rms_norm(h, (HIDDEN,), w, 1e-6), w, torch.ones_like(h))[0]


def check_rules(mesh, device) -> dict:
    """Each rule on one call: ``{case: [result placements, largest difference from torch,
    {collective: count}]}`` (the collectives the call ran, from ``CommDebugMode``)."""

    def spread(t, *placements):
        return distribute_tensor(t.to(device), mesh, list(placements))

    x, w, b = torch.randn(6, DIM), torch.randn(HIDDEN, DIM), torch.randn(HIDDEN)
    h, y = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    # case: (the operands, distributed outside the counted region; the call; torch's result)
    cases = {
        "linear_relu_colwise": (
            lambda: (spread(x, Replicate()), spread(w, Shard(0)), spread(b, Shard(0))),
            fusedkit.linear_relu,
            torch.relu(x @ w.t() + b),
        ),
        "linear_relu_rowwise": (
            lambda: (spread(h, Shard(1)), spread(w.t().contiguous(), Shard(1)), spread(x[0], Replicate())),
            fusedkit.linear_relu,
            torch.relu(h @ w + x[0]),
        ),
        "matmul_rowwise_partial": (lambda: (spread(h, Shard(1)), spread(w, Shard(0))), fusedkit.matmul, h @ w),
        "add_relu_broadcast": (
            lambda: (spread(h, Shard(1)), spread(b, Shard(0))),
            fusedkit.add_relu,
            torch.relu(h + b),
        ),
        "silu_mul_rows": (
            lambda: (spread(h, Shard(0)), spread(y, Shard(0))),
            fusedkit.silu_mul,
            torch.nn.functional.silu(h) * y,
        ),
        "add_relu_out": (
            lambda: (spread(h, Shard(0)), spread(y, Shard(0)), spread(torch.full_like(h, -7.0), Shard(0))),
            add_relu_into,
            torch.relu(h + y),
        ),
        "add_rms_norm_rows": (
            lambda: (spread(h, Shard(0)), spread(y, Shard(0)), spread(b, Replicate())),
            lambda a, r, w: fusedkit.add_rms_norm(a, r, w, 1e-6)[0],
            torch.nn.functional.rms_norm(h + y, (HIDDEN,), b, 1e-6),
        ),
        # the weight's gradient from row-sharded rows: each rank's partial sum
        "rms_norm_rows_weight_grad": (
            lambda: (spread(h, Shard(0)), spread(b, Replicate()).requires_grad_()),
            lambda a, w: torch.autograd.grad(fusedkit.rms_norm(a, (HIDDEN,), w, 1e-6), w, torch.ones_like(a))[0],
            _rms_weight_grad(h, b),
        ),
        # an out= placed otherwise than the result: written all the same (copied in, as torch does)
        "add_relu_out_replicated": (
            lambda: (spread(h, Shard(0)), spread(y, Shard(0)), spread(torch.full_like(h, -7.0), Replicate())),
            add_relu_into,
            torch.relu(h + y),
        ),
    }
    # The MLP ops on the placements a tensor-parallel MLP gives them (and one they do not take):
    # each rank's shards through one local call of the op, where a case says so.
    g, u, act = x @ w.t() + b, x @ w.t() * 0.5, torch.nn.functional.silu
    cases |= {
        "gated_mlp_tensor_parallel": (
            lambda: (
                spread(x, Replicate()),
                *(spread(t, Shard(0)) for t in (w, w * 0.5)),
                spread(w.t().contiguous(), Shard(1)),
                *(spread(t, Shard(0)) for t in (b, torch.zeros_like(b))),
                spread(x[0], Replicate()),
            ),
            lambda x, wg, wu, wd, *bias: fusedkit.gated_mlp(x, wg, wu, wd, bias=bias),
            (act(g) * u) @ w + x[0],
        ),
        "gated_mlp_tensor_parallel_partial": (
            lambda: (
                spread(x, Replicate()),
                *(spread(t, Shard(0)) for t in (w, w * 0.5)),
                spread(w.t().contiguous(), Shard(1)),
            ),
            fusedkit.gated_mlp,
            (act(x @ w.t()) * u) @ w,
        ),
        "gated_mlp_rows": (
            lambda: (spread(x, Shard(0)), *(spread(t, Replicate()) for t in (w, w * 0.5, w.t().contiguous()))),
            fusedkit.gated_mlp,
            (act(x @ w.t()) * u) @ w,
        ),
        "mlp_tensor_parallel": (
            lambda: (
                spread(x, Replicate()),
                spread(w, Shard(0)),
                spread(b, Shard(0)),
                spread(w.t().contiguous(), Shard(1)),
                spread(x[0], Replicate()),
            ),
            fusedkit.mlp,
            torch.nn.functional.gelu(g) @ w + x[0],
        ),
        "mlp_rows": (
            lambda: (spread(x, Shard(0)), *(spread(t, Replicate()) for t in (w, b, w.t().contiguous(), x[0]))),
            fusedkit.mlp,
            torch.nn.functional.gelu(g) @ w + x[0],
        ),
        "mlp_rows_uneven": (  # (5 rows on 2 ranks: local_map would take each rank's rows as 3)
            lambda: (spread(x[:5], Shard(0)), *(spread(t, Replicate()) for t in (w, b, w.t().contiguous(), x[0]))),
            fusedkit.mlp,
            torch.nn.functional.gelu(g[:5]) @ w + x[0],
        ),
        "gated_mlp_gate_and_up_placed_apart": (  # (the up projection sharded, the gate not)
            lambda: (
                spread(x, Replicate()),
                spread(w, Replicate()),
                spread(w * 0.5, Shard(0)),
                spread(w.t().contiguous(), Shard(1)),
            ),
            fusedkit.gated_mlp,
            (act(x @ w.t()) * u) @ w,
        ),
        "mlp_k_sharded": (  # (no local call computes it: the composition, op by op)
            lambda: (spread(x, Shard(1)), *(spread(t, Replicate()) for t in (w, b, w.t().contiguous(), x[0]))),
            fusedkit.mlp,
            torch.nn.functional.gelu(g) @ w + x[0],
        ),
    }
    local = [0]

    def counting(op):
        def call(x, *args, **kwargs):
            local[0] += not isinstance(x, DTensor)  # (a call on one rank's shards)
            return op(x, *args, **kwargs)

        return call

    found = {}
    real = fusedkit.dispatch.mlp, fusedkit.dispatch.gated_mlp
    fusedkit.dispatch.mlp, fusedkit.dispatch.gated_mlp = (counting(op) for op in real)
    try:
        for name, (operands, call, want) in cases.items():
            args = operands()
            local[0] = 0
            with CommDebugMode() as comms:
                got = call(*args)
            counts = {str(k).split(".")[-1]: v for k, v in comms.get_comm_counts().items() if v}
            diff = (got.full_tensor().cpu() - want).abs().max().item()
            found[name] = [[str(p) for p in got.placements], diff, counts, local[0]]
    finally:
        fusedkit.dispatch.mlp, fusedkit.dispatch.gated_mlp = real
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint", help="folder for the checkpoint (default: a new temporary one)")
    args = p.parse_args()
    dist.init_process_group("nccl" if _gpus else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}") if _gpus else torch.device("cpu")
    if _gpus:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    result = {"world": world, "backend": dist.get_backend(), "device": str(device), "steps": args.steps}

    torch.manual_seed(0)  # same initial weights and data on every rank
    batches = [torch.randn(4 * world, DIM) for _ in range(args.steps)]
    fused0, torch0 = MLP(fused=True).to(device), MLP(fused=False).to(device)
    torch0.load_state_dict(fused0.state_dict())
    torch_trained = copy.deepcopy(torch0)
    torch_run = reference(torch_trained, batches, device)

    # DDP: the MLP above, and the earlier check's LinearReLU stack and conv block.
    ddp = DDP(copy.deepcopy(fused0), device_ids=[rank] if _gpus else None)
    compare("ddp", result, ddp.module, train(ddp, batches, device, rank, world), torch_trained, torch_run)
    extra = {
        "linear_relu_mlp": (linear_relu_mlp(), [torch.randn(8 * world, 16) for _ in range(args.steps)]),
        "conv_block": (ConvBlock(4), [torch.randn(2 * world, 4, 6, 6) for _ in range(args.steps)]),
    }
    for name, (model, data) in extra.items():
        single = copy.deepcopy(model).to(device)
        wrapped = DDP(model.to(device), device_ids=[rank] if _gpus else None)
        train(wrapped, data, device, rank, world)
        train(single, data, device, shard=False)
        result[f"ddp_{name}_param_diff"] = max_diff(list(wrapped.module.parameters()), list(single.parameters()))

    # FSDP2: each block, then the root.
    def sharded_fsdp():
        model = copy.deepcopy(fused0)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    fsdp = sharded_fsdp()
    compare("fsdp", result, fsdp, train(fsdp, batches, device, rank, world), torch_trained, torch_run)

    # Tensor parallel: column-parallel up-projections, row-parallel down-projections.
    tp = copy.deepcopy(fused0)
    plan = {}
    for i in range(len(tp.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(tp, mesh, plan)
    compare("tp", result, tp, train(tp, batches, device, shard=False), torch_trained, torch_run)

    # The tensor-parallel model compiled whole (fullgraph): DTensors through fusedkit's ops in a
    # graph, whose collectives are counted in the forward and backward graphs AOT autograd makes.
    compiled = copy.deepcopy(fused0)
    parallelize_module(compiled, mesh, plan)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    compiled_run = torch.compile(compiled, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    x = batches[0].to(device)
    out, want = compiled_run(x), torch0(x)
    mean_loss(out).backward()
    mean_loss(want).backward()
    result["tp_compiled_out_diff"] = max_diff([out], [want])
    result["tp_compiled_grad_diff"] = max_diff(
        [p.grad for p in compiled.parameters()], [p.grad for p in torch0.parameters()]
    )
    result["tp_compiled_collectives"] = {
        name: sum(code.count(f"{name}.default(") for code in graphs)
        for name in ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")
    }
    torch0.zero_grad(set_to_none=True)

    # A LLaMA-style MLP: gate and up column-parallel, down row-parallel; silu_mul on the shards.
    swiglu = fusedkit.nn.SwiGLU(DIM, HIDDEN).to(device)
    plain = copy.deepcopy(swiglu)
    parallelize_module(swiglu, mesh, {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(6, DIM, device=device)
    out, want = swiglu(x), plain.down(torch.nn.functional.silu(plain.gate(x)) * plain.up(x))
    mean_loss(out).backward()
    mean_loss(want).backward()
    result["tp_swiglu_out_diff"] = max_diff([out], [want])
    result["tp_swiglu_grad_diff"] = max_diff(
        [p.grad for p in swiglu.parameters()], [p.grad for p in plain.parameters()]
    )

    # The rules themselves: fusedkit's ops on DTensors give DTensors placed as a rule says.
    result["rules"] = check_rules(mesh, device)

    # Checkpoint: the trained FSDP2 model through torch.distributed.checkpoint into a fresh one.
    folder = args.checkpoint
    made = None
    if folder is None:
        made = tempfile.mkdtemp(prefix="fusedkit-dcp-") if rank == 0 else None
        holder = [made]
        dist.broadcast_object_list(holder)
        folder = holder[0]
    dcp.save({"model": get_model_state_dict(fsdp)}, checkpoint_id=folder)
    restored = sharded_fsdp()
    state = {"model": get_model_state_dict(restored)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(restored, state["model"])
    result["checkpoint_param_diff"] = max_diff(list(restored.parameters()), list(fsdp.parameters()))
    extra_batch = [torch.randn(4 * world, DIM)]
    after = [train(m, extra_batch, device, rank, world)[0][0] for m in (fsdp, restored)]
    result["checkpoint_next_loss_diff"] = abs(after[0] - after[1])
    dist.barrier()
    if made is not None:
        import shutil

        shutil.rmtree(made, ignore_errors=True)
    if rank == 0:
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
