"""fusedkit.MemoryCounterMode: exact modelled bytes per op, per module, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand

import fusedkit
from fusedkit.registry import Traffic

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


# --- Scatters and ops with a scalar value (issue 45 item 1) ---------------------------------

I64, ROWS, COLS = 8, 8, 16
TARGET = ROWS * COLS * F32  # the (8, 16) float32 target's bytes


def test_the_issues_scatters_with_a_scalar_value_move_what_they_select():
    # The issue's three cases on a (1024, 1024) fp32 x, which counted 4, 4 and 0 bytes written.
    n = 1024
    x = rand((n, n), torch.float32, DEVICE)
    full = n * n * F32
    # x[rows] = 0.0 writes the 512 rows it selects, reading their indices and the value once
    rows = torch.arange(0, n, 2, device=DEVICE)
    c = count(lambda: x.__setitem__(rows, 0.0))
    assert traffic(c, "aten.index_put_") == Traffic(512 * I64 + F32, 512 * n * F32)
    # scatter_ with a Scalar value writes one element per index element and reads the index
    idx = torch.randint(0, n, (n, n), device=DEVICE)
    c = count(lambda: x.scatter_(1, idx, 0.0))
    assert traffic(c, "aten.scatter_") == Traffic(n * n * I64, n * n * F32)
    # x[mask] = 0.0 runs as masked_fill_ (PyTorch's index_put_ hands a one-element value with a
    # boolean index to it), which on CUDA is an elementwise pass: it reads the mask and all of x
    # and writes all of x, however many elements the mask selects
    mask = torch.zeros(n, n, dtype=torch.bool, device=DEVICE)
    mask[::4] = True
    c = count(lambda: x.__setitem__(mask, 0.0))
    assert traffic(c, "aten.index_put_") == Traffic(n * n + full + F32, full)
    assert traffic(count(lambda: x.masked_fill_(mask, 0.0)), "aten.masked_fill_") == Traffic(n * n + full, full)
    # with as many values as it selects, index_put_ writes the mask's True elements alone
    values = rand((n * n // 4,), torch.float32, DEVICE)
    c = count(lambda: x.__setitem__(mask, values))
    assert traffic(c, "aten.index_put_") == Traffic(n * n + full // 4, full // 4)


@pytest.mark.parametrize("value", ["number", "0-d tensor", "full tensor"])
def test_a_scatters_value_is_read_once_as_a_number_or_0d_tensor(value):
    x = rand((ROWS, COLS), torch.float32, DEVICE)
    rows = torch.tensor([1, 4, 6], device=DEVICE)
    picked = 3 * COLS * F32
    value_of = {"number": 2.0, "0-d tensor": torch.tensor(2.0, device=DEVICE)}
    value_of["full tensor"] = rand((3, COLS), torch.float32, DEVICE)
    read = {"number": F32, "0-d tensor": F32, "full tensor": picked}[value]  # (a number is lifted to a 0-d tensor)
    c = count(lambda: x.__setitem__(rows, value_of[value]))
    assert traffic(c, "aten.index_put_") == Traffic(3 * I64 + read, picked)
    # a boolean index: one value runs as masked_fill_ (the whole of x), more write the True rows
    row_mask = torch.zeros(ROWS, dtype=torch.bool, device=DEVICE)
    row_mask[rows] = True
    c = count(lambda: x.__setitem__(row_mask, value_of[value]))
    expected = Traffic(ROWS + picked, picked) if value == "full tensor" else Traffic(ROWS + F32 + TARGET, TARGET)
    assert traffic(c, "aten.index_put_") == expected
    # scatter_ and index_fill_ take a Scalar or a tensor
    idx = torch.tensor([[0, 3], [2, 2]], device=DEVICE)
    if value == "number":
        assert traffic(count(lambda: x.scatter_(1, idx, 2.0)), "aten.scatter_") == Traffic(4 * I64, 4 * F32)
        c = count(lambda: x.index_fill_(0, rows, 2.0))
        assert traffic(c, "aten.index_fill_") == Traffic(3 * I64, picked)
    elif value == "0-d tensor":
        c = count(lambda: x.index_fill_(0, rows, value_of[value]))
        assert traffic(c, "aten.index_fill_") == Traffic(3 * I64 + F32, picked)
    else:
        src = rand((ROWS, COLS), torch.float32, DEVICE)  # (larger than the index: 4 of its elements are read)
        c = count(lambda: x.scatter_(1, idx, src))
        assert traffic(c, "aten.scatter_") == Traffic(4 * I64 + 4 * F32, 4 * F32)


def _scatter_cases():
    """(op, arguments after the target, the Traffic of its writing into an (8, 16) float32 target),
    in place, out of place and with out= where the op has those forms: every scatter-like op of
    aten's schemas (scatter, index_put, index_fill, masked_... and the view scatters) and each
    overload with a Scalar value among them. aten's other ops with a Scalar value either keep the
    elementwise rule (addcmul, addcdiv, threshold, their _foreach forms) or are counted below
    (fill, constant_pad_nd)."""
    d = DEVICE
    idx = torch.tensor([[0, 3, 5, 3], [2, 2, 9, 1]], device=d)  # 8 elements
    src = torch.randn(ROWS, COLS, device=d)
    rows, cols = torch.tensor([1, 4, 6], device=d), torch.tensor([0, 7, 15], device=d)
    row_src = torch.randn(3, COLS, device=d)
    flat, flat_src = torch.tensor([0, 17, 100, 127, 5], device=d), torch.randn(5, device=d)
    row_mask = torch.zeros(ROWS, dtype=torch.bool, device=d)
    row_mask[rows] = True
    mask = torch.zeros(ROWS, COLS, dtype=torch.bool, device=d)
    mask[:, ::4] = True  # 32 True
    zero_d = torch.tensor(2.0, device=d)
    e, r = 8 * F32, 3 * COLS * F32  # bytes of 8 scattered elements; of the 3 rows
    prefix = ROWS * COLS * I64  # masked_scatter's prefix sum of the mask
    return [
        pytest.param("scatter", (1, idx, src), {}, Traffic(8 * I64 + e, e), id="scatter.src"),
        pytest.param("scatter", (1, idx, 2.0), {}, Traffic(8 * I64, e), id="scatter.value"),
        pytest.param("scatter", (1, idx, src), {"reduce": "add"}, Traffic(8 * I64 + 2 * e, e), id="scatter.reduce"),
        pytest.param(
            "scatter", (1, idx, 2.0), {"reduce": "multiply"}, Traffic(8 * I64 + e, e), id="scatter.value_reduce"
        ),
        pytest.param("scatter_add", (1, idx, src), {}, Traffic(8 * I64 + 2 * e, e), id="scatter_add"),
        pytest.param("scatter_reduce", (1, idx, src, "amax"), {}, Traffic(8 * I64 + 2 * e, e), id="scatter_reduce"),
        pytest.param("put", (flat, flat_src), {}, Traffic(5 * I64 + 5 * F32, 5 * F32), id="put"),
        pytest.param("put", (flat, flat_src, True), {}, Traffic(5 * I64 + 10 * F32, 5 * F32), id="put-accumulate"),
        pytest.param("index_add", (0, rows, row_src), {}, Traffic(3 * I64 + 2 * r, r), id="index_add"),
        pytest.param("index_copy", (0, rows, row_src), {}, Traffic(3 * I64 + r, r), id="index_copy"),
        pytest.param("index_fill", (0, rows, 2.0), {}, Traffic(3 * I64, r), id="index_fill.int_Scalar"),
        pytest.param(
            "index_fill", (1, cols, zero_d), {}, Traffic(3 * I64 + F32, 3 * ROWS * F32), id="index_fill.int_Tensor"
        ),
        pytest.param("index_reduce", (0, rows, row_src, "prod"), {}, Traffic(3 * I64 + 2 * r, r), id="index_reduce"),
        pytest.param("index_put", ([rows], zero_d), {}, Traffic(3 * I64 + F32, r), id="index_put-rows-0d"),
        pytest.param(
            "index_put", ([rows], row_src, True), {}, Traffic(3 * I64 + 2 * r, r), id="index_put-rows-accumulate"
        ),
        pytest.param(
            "index_put", ([rows, cols], flat_src[:3]), {}, Traffic(6 * I64 + 3 * F32, 3 * F32), id="index_put-rows-cols"
        ),
        pytest.param(
            "index_put",
            ([None, cols], flat_src[:3]),
            {},
            Traffic(3 * I64 + 3 * F32, 3 * ROWS * F32),
            id="index_put-None-cols",
        ),
        pytest.param("index_put", ([row_mask], row_src), {}, Traffic(ROWS + r, r), id="index_put-mask-rows"),
        pytest.param(
            "index_put", ([row_mask], zero_d), {}, Traffic(ROWS + F32 + TARGET, TARGET), id="index_put-mask-0d"
        ),
        pytest.param("_unsafe_index_put", ([rows], row_src), {}, Traffic(3 * I64 + r, r), id="_unsafe_index_put"),
        pytest.param("masked_fill", (mask, 2.0), {}, Traffic(ROWS * COLS + TARGET, TARGET), id="masked_fill.Scalar"),
        pytest.param(
            "masked_fill", (mask, zero_d), {}, Traffic(ROWS * COLS + F32 + TARGET, TARGET), id="masked_fill.Tensor"
        ),
        pytest.param(
            "masked_fill", (row_mask[:, None], 2.0), {}, Traffic(ROWS + TARGET, TARGET), id="masked_fill-broadcast-mask"
        ),
        pytest.param(
            "masked_scatter",
            (mask, src.flatten()),
            {},
            # the scan's mask read and int64 prefix sum written, then the pass: the mask, the prefix
            # sum, 32 source elements and the target read, the target written
            Traffic(ROWS * COLS, prefix) + Traffic(ROWS * COLS + prefix + 32 * F32 + TARGET, TARGET),
            id="masked_scatter",
        ),
        pytest.param("select_scatter", (src[0], 0, 1), {}, Traffic(COLS * F32, COLS * F32), id="select_scatter"),
        pytest.param("slice_scatter", (row_src, 0, 2, 5), {}, Traffic(r, r), id="slice_scatter"),
        pytest.param("diagonal_scatter", (src[0, :ROWS],), {}, Traffic(ROWS * F32, ROWS * F32), id="diagonal_scatter"),
        pytest.param(
            "as_strided_scatter",
            (src[:4, :4], (4, 4), (16, 1)),
            {},
            Traffic(16 * F32, 16 * F32),
            id="as_strided_scatter",
        ),
    ]


@pytest.mark.parametrize("name, args, kwargs, scattered", _scatter_cases())
def test_scatters_in_place_out_of_place_and_out_count_what_they_select(name, args, kwargs, scattered):
    packet = getattr(torch.ops.aten, name)
    in_place = getattr(torch.ops.aten, name + "_", None)
    x = rand((ROWS, COLS), torch.float32, DEVICE)
    if in_place is not None:
        y = x.clone()
        c = count(lambda: in_place(y, *args, **kwargs))
        assert traffic(c, f"aten.{name}_") == scattered
    # out of place: the input copied into the result (a read of x, a write of the result), then scattered into
    copied = Traffic(TARGET, TARGET)
    c = count(lambda: packet(x, *args, **kwargs))
    assert traffic(c, f"aten.{name}") == scattered + copied
    if any(a.is_out for o in packet.overloads() for a in getattr(packet, o)._schema.arguments):
        out = torch.empty_like(x)
        c = count(lambda: packet(x, *args, **kwargs, out=out))
        assert traffic(c, f"aten.{name}") == scattered + copied


def test_a_masks_true_elements_are_counted_outside_every_mode():
    # The count runs inside the counter's dispatch: neither it nor a mode beneath it sees it.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = rand((ROWS, COLS), torch.float32, DEVICE)
    row_mask = torch.tensor([True, False, False, True, False, True, True, False], device=DEVICE)
    values = rand((COLS,), torch.float32, DEVICE)
    with Seen() as seen, fusedkit.MemoryCounterMode(display=False) as c:
        x[row_mask] = values
    assert seen.ops == ["index_put_"]
    # the 4 True rows, each written from the broadcast row of values, read once
    forward, _ = c.get_traffic_by_module()["Global"]["aten.index_put_"]
    assert c.get_bytes_by_op().keys() == {"aten.index_put_"}
    assert forward == Traffic(ROWS + COLS * F32, 4 * COLS * F32)


def test_masks_without_data_count_their_bound_on_meta_and_fake_tensors():
    # No True elements to count: every element of the mask is taken as selected (the bound).
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run(device):
        x = torch.empty(ROWS, COLS, device=device)
        row_mask = torch.empty(ROWS, dtype=torch.bool, device=device)
        mask = torch.empty(ROWS, COLS, dtype=torch.bool, device=device)
        values, source = torch.empty(COLS, device=device), torch.empty(ROWS * COLS, device=device)
        with fusedkit.MemoryCounterMode(display=False) as c:
            x.index_put_((row_mask,), values)
            x.masked_scatter_(mask, source)
        return c

    with FakeTensorMode():
        fake = run("cpu")
    for c in (run("meta"), fake):
        assert not c.uncounted
        ops = c.get_traffic_by_module()["Global"]
        assert ops["aten.index_put_"][0] == Traffic(ROWS + COLS * F32, TARGET)  # every row
        # a source element for every element (and the mask's prefix sum, an int64 each)
        prefix = ROWS * COLS * I64
        assert ops["aten.masked_scatter_"][0] == Traffic(2 * ROWS * COLS + prefix + 2 * TARGET, TARGET + prefix)


def test_fill_reads_no_input_and_a_constant_pad_fills_then_copies():
    x = rand((ROWS, COLS), torch.float32, DEVICE)
    assert traffic(count(lambda: torch.ops.aten.fill(x, 2.0)), "aten.fill") == Traffic(0, TARGET)
    zero_d = torch.tensor(2.0, device=DEVICE)
    assert traffic(count(lambda: torch.ops.aten.fill(x, zero_d)), "aten.fill") == Traffic(F32, TARGET)
    # a positive pad: the (8, 18) result filled, then x copied into it
    c = count(lambda: F.pad(x, (1, 1)))
    assert traffic(c, "aten.constant_pad_nd") == Traffic(TARGET, ROWS * 18 * F32 + TARGET)
    # negative pads alone: the kept (8, 14) part copied, nothing filled
    c = count(lambda: F.pad(x, (-1, -1)))
    assert traffic(c, "aten.constant_pad_nd") == Traffic(ROWS * 14 * F32, ROWS * 14 * F32)
    # both: (9, 15) filled, the kept (8, 15) part copied
    c = count(lambda: F.pad(x, (0, -1, 0, 1), value=3.0))
    assert traffic(c, "aten.constant_pad_nd") == Traffic(ROWS * 15 * F32, 9 * 15 * F32 + ROWS * 15 * F32)
