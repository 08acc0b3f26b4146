"""fusedkit.MemoryCounterMode: exact modelled bytes per op, per module, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand

import fusedkit

F32 = 4


def count(fn, device=DEVICE):
    with fusedkit.MemoryCounterMode(display=False) as counter:
        fn()
    return counter


def traffic(counter, op):
    forward, backward = counter.get_traffic_by_module()["Global"][op]
    return forward + backward


def test_exact_bytes_of_simple_ops():
    x, y = rand((64, 48), torch.float32, DEVICE), rand((64, 48), torch.float32, DEVICE)
    n = 64 * 48 * F32
    c = count(lambda: torch.add(x, y))
    assert c.get_bytes_by_op() == {"aten.add": 3 * n} and c.get_total_bytes() == 3 * n
    assert count(lambda: torch.relu(x)).get_bytes_by_op() == {"aten.relu": 2 * n}
    bias, w = rand((32,), torch.float32, DEVICE), rand((48, 32), torch.float32, DEVICE)
    # addmm reads bias, x and w once and writes the (64, 32) result
    assert count(lambda: torch.addmm(bias, x, w)).get_bytes_by_op() == {
        "aten.addmm": (32 + 64 * 48 + 48 * 32 + 64 * 32) * F32
    }


def test_broadcast_transposed_and_views():
    x, row = rand((64, 48), torch.float32, DEVICE), rand((48,), torch.float32, DEVICE)
    n = 64 * 48 * F32
    # the broadcast operand is read once, not once per row
    assert count(lambda: x + row).get_bytes_by_op() == {"aten.add": 2 * n + 48 * F32}
    # a transposed operand moves the same bytes (its elements are dense, in another order)
    t = rand((48, 64), torch.float32, DEVICE).t()
    assert count(lambda: x + t).get_bytes_by_op() == {"aten.add": 3 * n}
    # a column slice with stride 2 moves whole 32-byte sectors: twice its bytes
    wide = rand((64, 96), torch.float32, DEVICE)
    assert count(lambda: torch.relu(wide[:, ::2])).get_bytes_by_op() == {"aten.relu": 2 * n + n}
    # views and metadata move nothing
    c = count(lambda: (x.view(-1), x.t(), x[1:], x.expand(2, 64, 48), x.unsqueeze(0), x.detach(), x.shape))
    assert c.get_total_bytes() == 0 and c.get_bytes_by_op() == {}


def test_in_place_out_overwrites_and_allocations():
    x, y = rand((64, 48), torch.float32, DEVICE), rand((64, 48), torch.float32, DEVICE)
    n = 64 * 48 * F32
    assert count(lambda: x.add_(y)).get_bytes_by_op() == {"aten.add_": 3 * n}  # reads x and y, writes x
    out = torch.empty_like(x)
    c = count(lambda: torch.add(x, y, out=out))
    assert traffic(c, "aten.add").read == 2 * n and traffic(c, "aten.add").written == n  # out is not read
    assert count(lambda: x.fill_(1.0)).get_bytes_by_op() == {"aten.fill_": n}
    assert count(lambda: x.copy_(y)).get_bytes_by_op() == {"aten.copy_": 2 * n}
    assert count(lambda: torch.empty(1000, 1000, device=DEVICE)).get_total_bytes() == 0
    assert count(lambda: torch.zeros(10, device=DEVICE)).get_total_bytes() == 10 * F32
    # a tensor passed twice is read once
    assert count(lambda: torch.mul(x, x)).get_bytes_by_op() == {"aten.mul": 2 * n}


def test_gathers_read_what_they_take():
    table = rand((10000, 16), torch.float32, DEVICE)
    idx = torch.tensor([[1, 5, 9]], device=DEVICE)
    c = count(lambda: F.embedding(idx, table))
    assert traffic(c, "aten.embedding").written == 3 * 16 * F32
    assert traffic(c, "aten.embedding").read == 3 * 16 * F32 + 3 * 8


def test_fusedkit_ops_are_named_by_kernel_and_counted_once():
    x, bias = rand((64, 48), torch.float32, DEVICE), rand((48,), torch.float32, DEVICE)
    n = 64 * 48 * F32
    c = count(lambda: fusedkit.add_relu(x, bias))
    assert c.get_bytes_by_op() == {"fusedkit.add_relu": 2 * n + 48 * F32}
    # the eager pair it replaces moves the intermediate twice more
    assert count(lambda: torch.relu(x + bias)).get_total_bytes() == 4 * n + 48 * F32
    # a (64, 1) column of a row-major matrix: each element costs a 32-byte sector
    c = count(lambda: fusedkit.silu_mul(x, x[:, :1]))
    assert c.get_bytes_by_op() == {"fusedkit.silu_mul": 2 * n + 64 * 32}


def test_modules_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(DEVICE)
    x = rand((64, 48), torch.float32, DEVICE)
    with fusedkit.MemoryCounterMode(depth=2, display=False) as c:
        model(x).sum().backward()
    by_module = c.get_traffic_by_module()
    assert {"Global", "Sequential", "Sequential.0", "Sequential.1", "Sequential.2"} <= set(by_module)
    forward, backward = by_module["Sequential.1"]["aten.relu"]
    assert forward.total == 2 * 64 * 32 * F32 and backward.total == 0
    forward, backward = by_module["Sequential.1"]["aten.threshold_backward"]
    assert forward.total == 0 and backward.total == 3 * 64 * 32 * F32
    # a module's bytes are the sum of its children's and its own ops'
    total = lambda m: sum(f.total + b.total for f, b in by_module[m].values())
    assert total("Sequential") == sum(total(f"Sequential.{i}") for i in range(3))
    table = c.get_table()
    assert "Sequential.1" in table and "aten.threshold_backward" in table and "100.0%" in table
    assert "Sequential.1" not in c.get_table(depth=1)


def test_multi_pass_ops_count_each_pass():
    # batch norm in training reads its input twice (statistics, then normalizing), its backward
    # grad and input twice; a convolution's backward reads grad_output once per gradient
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(16).to(DEVICE)
    conv = torch.nn.Conv2d(16, 4, 3, bias=False).to(DEVICE)
    x = rand((8, 16, 6, 6), torch.float32, DEVICE).requires_grad_()
    g = rand((8, 4, 4, 4), torch.float32, DEVICE)
    n, grad, w, channel = 8 * 16 * 36 * F32, 8 * 4 * 16 * F32, 4 * 16 * 9 * F32, 16 * F32
    # (without cuDNN, whose batch norm ops keep the default model, on a GPU as on the CPU)
    with torch.backends.cudnn.flags(enabled=False), fusedkit.MemoryCounterMode(display=False) as c:
        conv(bn(x)).backward(g)
    ops = c.get_bytes_by_op()
    # reads: input twice, weight, bias, running mean and var; writes: output, saved mean and invstd
    assert ops["aten.native_batch_norm"] == (2 * n + 4 * channel) + (n + 2 * channel)
    # reads: grad_output for each of the two gradients, the input (weight's), the weight (input's)
    assert ops["aten.convolution_backward"] == (2 * grad + n + w) + (n + w)
    # reads: grad and input twice, weight, running mean and var, saved mean and invstd; writes
    # the three gradients
    assert ops["aten.native_batch_norm_backward"] == (4 * n + 5 * channel) + (n + 2 * channel)
    bn.eval()
    with torch.backends.cudnn.flags(enabled=False), fusedkit.MemoryCounterMode(display=False) as c:
        bn(x.detach())
    assert c.get_bytes_by_op() == {"aten.native_batch_norm": n + 4 * channel + n}  # one pass


def test_batch_norm_in_evaluation_writes_its_output_only():
    # CUDA and meta return the saved statistics allocated and unwritten in evaluation (the CPU
    # returns them empty): the H200 suite counted 2 x 16 channels too many before
    x = torch.empty(8, 16, 6, 6, device="meta")
    weight, bias, running_mean, running_var = (torch.empty(16, device="meta") for _ in range(4))
    with fusedkit.MemoryCounterMode(display=False) as c:
        _, mean, _ = torch.native_batch_norm(x, weight, bias, running_mean, running_var, False, 0.1, 1e-5)
    assert mean.numel() == 16  # (what makes this test able to fail)
    n = 8 * 16 * 36 * F32
    assert c.get_bytes_by_op() == {"aten.native_batch_norm": (n + 4 * 16 * F32) + n}


def test_counts_on_the_meta_device_and_prints_on_exit(capsys):
    a = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    with fusedkit.MemoryCounterMode() as c:
        torch.mm(a, a.t())
    assert c.get_bytes_by_op() == {"aten.mm": 3 * 4096 * 4096 * 2}  # reads a and a.t(), writes the product
    assert "aten.mm" in capsys.readouterr().out


def test_counts_fresh_each_time_and_leaves_no_mode_behind():
    x = rand((16,), torch.float32, DEVICE)
    counter = fusedkit.MemoryCounterMode(display=False)
    for _ in range(2):
        with counter:
            torch.relu(x)
        assert counter.get_total_bytes() == 2 * 16 * F32
    assert torch._C._len_torch_dispatch_stack() == 0
    with pytest.raises(ValueError, match="boom"), counter:
        raise ValueError("boom")
    assert torch._C._len_torch_dispatch_stack() == 0


def test_lists_shape_only_ops_in_place_views_and_unannotated_views():
    xs = [rand((64, 48), torch.float32, DEVICE) for _ in range(3)]
    n = 64 * 48 * F32
    # an op returning a list counts every tensor of it
    assert count(lambda: torch._foreach_sqrt(xs)).get_bytes_by_op() == {"aten._foreach_sqrt": 6 * n}
    x = xs[0]
    # *_like reads the shape only
    assert count(lambda: torch.zeros_like(x)).get_bytes_by_op() == {"aten.zeros_like": n}
    # in-place views and views without an alias annotation move nothing
    y = x.clone()
    assert count(lambda: y.unsqueeze_(0)).get_total_bytes() == 0
    assert count(lambda: torch.ops.aten._unsafe_view(x, (48, 64))).get_total_bytes() == 0
    # fusedkit's out= op writes out, reads x and y only
    out = torch.empty_like(x)
    c = count(lambda: fusedkit.add(x, xs[1], out=out))
    assert traffic(c, "fusedkit.add").read == 2 * n and traffic(c, "fusedkit.add").written == n


def test_gathers_and_scatters_move_the_rows_they_touch():
    table = rand((10000, 16), torch.float32, DEVICE)
    idx = torch.tensor([1, 5, 9], device=DEVICE)
    rows = 3 * 16 * F32
    c = count(lambda: table[idx])
    assert traffic(c, "aten.index").read == rows + 3 * 8 and traffic(c, "aten.index").written == rows
    src = rand((3, 16), torch.float32, DEVICE)
    c = count(lambda: table.index_add_(0, idx, src))
    assert traffic(c, "aten.index_add_").written == rows and traffic(c, "aten.index_add_").read == 3 * 8 + 2 * rows


def test_what_cannot_be_sized_is_left_uncounted_not_raised():
    nested = torch.nested.nested_tensor(
        [rand((2, 3), torch.float32, DEVICE), rand((4, 3), torch.float32, DEVICE)], layout=torch.jagged
    )
    with fusedkit.MemoryCounterMode(display=False, depth=None) as c:
        torch.relu(nested)
    assert sum(c.uncounted.values()) >= 1
    assert "Global" in c.get_table()
    with pytest.raises(fusedkit.FusedkitError, match="counting already"), c:
        with c:
            pass
    assert torch._C._len_torch_dispatch_stack() == 0


def test_fused_backward_kernels_are_counted_as_one_op():
    a, b = (rand((64, 48), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    n = 64 * 48 * F32
    out = fusedkit.silu_mul(a, b)
    g = torch.ones_like(out)
    with fusedkit.MemoryCounterMode(display=False) as c:
        torch.autograd.grad(out, (a, b), g)
    # reads grad, a and b, writes both gradients: 5n, where the eager composition's backward moves more
    assert c.get_bytes_by_op() == {"fusedkit.silu_mul_grad": 5 * n}
    x, y = (t.detach().requires_grad_() for t in (a, b))
    out = fusedkit.add_gelu(x, y)
    with fusedkit.MemoryCounterMode(display=False) as c:
        torch.autograd.grad(out, (x, y), g)
    # from the kept sum: reads grad and the sum, writes the gradient both operands take
    assert c.get_bytes_by_op() == {"fusedkit.gelu_grad": 3 * n}


def test_a_counted_add_gelu_step_moves_what_the_eager_one_does():
    # Under the counter, as in eager: the forward pair writes the result and the sum (4n),
    # the backward reads grad and the sum and writes the gradient (3n); nothing recomputed.
    x, y = (rand((64, 48), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    n = 64 * 48 * F32
    with fusedkit.MemoryCounterMode(display=False) as c:
        out = fusedkit.add_gelu(x, y)
        torch.autograd.grad(out, (x, y), torch.ones_like(out))
    assert c.get_bytes_by_op() == {"fusedkit.add_gelu_pre": 4 * n, "aten.ones_like": n, "fusedkit.gelu_grad": 3 * n}


def test_a_matmul_backward_allocates_no_gradient_for_its_saved_pre_activation():
    # The op's second output (the pre-activation kept for GELU's backward) gets no gradient:
    # no M x N zeros in the counted backward, as in an eager step.
    a = rand((16, 32), torch.float32, DEVICE).requires_grad_()
    w = rand((32, 24), torch.float32, DEVICE).requires_grad_()
    with fusedkit.MemoryCounterMode(display=False) as counter:
        fusedkit.matmul(a, w, None, "gelu").sum().backward()
    assert "aten.zeros" not in counter.get_bytes_by_op()
    assert a.grad is not None and w.grad is not None
