"""GPU-only guarantees: no host-device synchronisation, no allocation beyond the
output, bit-identical reruns, launches on the tensors' own device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rand

import fusedkit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = torch.device("cuda")


def _ops():
    x, y = rand((300, 257), torch.float32, DEV), rand((257,), torch.float32, DEV)
    w = rand((96, 257), torch.bfloat16, DEV)
    xb = x.to(torch.bfloat16)
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    # Backward too: a sync there would also explain a host-bound backward.
    return [
        lambda: fusedkit.add(x, y, alpha=2),
        lambda: fusedkit.add_relu(x.t(), 1.5),
        lambda: fusedkit.add_relu(x, torch.tensor(0.5)),
        lambda: fusedkit.linear_relu(xb, w),
        lambda: torch.autograd.grad(fusedkit.add_relu(xg, yg, alpha=0.5).sum(), (xg, yg)),
        lambda: torch.autograd.grad(fusedkit.linear_relu(xb, wg).sum(), (wg,)),
    ]


def test_no_host_device_sync():
    ops = _ops()
    for op in ops:  # compile and tune first: that may synchronise
        op()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for op in ops:
            op()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_forward_allocates_only_its_output():
    x, y = rand((1024, 1024), torch.float32, DEV), rand((1024,), torch.float32, DEV)
    fusedkit.add_relu(x, y)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fusedkit.add_relu(x, y)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == out.numel() * out.element_size()


def test_reruns_are_bit_identical():
    x, y = rand((4097, 333), torch.bfloat16, DEV), rand((333,), torch.float32, DEV)
    first = fusedkit.add_relu(x, y, alpha=0.3)
    for _ in range(3):
        assert torch.equal(fusedkit.add_relu(x, y, alpha=0.3), first)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_every_op_launches_on_the_inputs_device():
    dev1 = torch.device("cuda:1")
    x, y = rand((1000,), torch.float32, dev1), rand((1000,), torch.float32, dev1)
    a, w, b = (rand(s, torch.bfloat16, dev1) for s in ((64, 128), (96, 128), (96,)))
    cases = {
        "add": (lambda: fusedkit.add(x, y, alpha=2), lambda: torch.add(x, y, alpha=2)),
        "add_relu": (lambda: fusedkit.add_relu(x, y), lambda: torch.relu(x + y)),
        "matmul": (
            lambda: fusedkit.matmul(a, w.t(), b, "gelu"),
            lambda: torch.nn.functional.gelu(torch.addmm(b, a, w.t())),
        ),
        "linear_relu": (lambda: fusedkit.linear_relu(a, w, b), lambda: torch.relu(torch.addmm(b, a, w.t()))),
    }
    for name, (op, ref) in cases.items():
        for _ in range(2):  # the full path, then the cached fast path
            with torch.cuda.device(0):
                out = op()
            assert out.device == dev1, name
            torch.testing.assert_close(out.float(), ref().float(), atol=0.05, rtol=0.02, msg=name)
    with pytest.raises(fusedkit.DeviceError):
        fusedkit.add(x, rand((1000,), torch.float32, torch.device("cuda:0")))
    with pytest.raises(fusedkit.DeviceError):
        fusedkit.linear_relu(a, w.to("cuda:0"), b)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_matmul_allocates_only_its_output_and_reruns_bit_identical(fk_settings, kernel, monkeypatch):
    fk_settings(matmul_kernel=kernel)
    fk_settings(autotune=False)  # one fixed config: a deterministic kernel
    x, w, b = (rand(s, torch.bfloat16, DEV) for s in ((300, 512), (384, 512), (384,)))
    first = fusedkit.linear_relu(x, w, b)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fusedkit.linear_relu(x, w, b)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == out.numel() * out.element_size()
    for _ in range(3):
        assert torch.equal(fusedkit.linear_relu(x, w, b), first)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_matmul_output_past_2_pow_31_elements(fk_settings, kernel, monkeypatch):
    """(2**16 + 3) x (2**15 + 8) bf16 outputs: 2.15e9 elements, 64-bit offsets; head and tail checked."""
    fk_settings(matmul_kernel=kernel)
    fk_settings(autotune=False)
    m, n, k = 2**16 + 3, 2**15 + 8, 16
    a, b, bias = (rand(s, torch.bfloat16, DEV) for s in ((m, k), (k, n), (n,)))
    out = fusedkit.matmul_relu(a, b, bias)
    assert out.numel() > 2**31
    for rows, cols in (
        (slice(0, 64), slice(0, 64)),
        (slice(m - 64, m), slice(n - 64, n)),
        (slice(m // 2, m // 2 + 64), slice(n - 100, n)),
    ):
        ref = torch.relu(a[rows].double() @ b[:, cols].double() + bias[cols].double())
        torch.testing.assert_close(out[rows, cols].double(), ref, atol=0.05, rtol=0.02)
    del out
    torch.cuda.empty_cache()


def _step_peak(step, leaves, dy) -> tuple[int, list]:
    """Bytes a forward + backward allocates above what was live before it (after warm-up
    calls: plans kept, table copies made), and the live bytes as each backward node starts."""
    for _ in range(3):
        torch.autograd.grad(step(), leaves, dy)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = step()
    marks, node, seen = [], y.grad_fn, set()
    stack = [node]
    while stack:  # (a prehook on every node: where the live bytes rise)
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        n.register_prehook(lambda g, n=n: marks.append((type(n).__name__, torch.cuda.memory_allocated() - before)))
        stack += [f for f, _ in n.next_functions]
    torch.autograd.grad(y, leaves, dy)
    del y
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, marks


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_an_epilogue_fused_mlp_step_peaks_no_higher_than_eagers(activation):
    # GPT-2's MLP as fuse writes it: the up-projection's activation in its GEMM's epilogue,
    # the down-projection F.linear. Both save x, pre (or, for ReLU, the output) and h, so the
    # step should peak where eager's does (the models record had it 1.3-1.5x eager's).
    m, k, hidden = 2048, 256, 1024
    dt = torch.bfloat16
    shapes = ((m, k), (hidden, k), (hidden,), (k, hidden), (k,))
    x, w1, b1, w2, b2 = (rand(s, dt, DEV).div_(s[-1] ** 0.5).requires_grad_() for s in shapes)
    leaves, dy = (x, w1, b1, w2, b2), rand((m, k), dt, DEV)
    act = {"gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"), "relu": torch.relu}[activation]
    eager, eager_marks = _step_peak(lambda: F.linear(act(F.linear(x, w1, b1)), w2, b2), leaves, dy)
    fused, fused_marks = _step_peak(lambda: F.linear(fusedkit.matmul(x, w1.t(), b1, activation), w2, b2), leaves, dy)
    unit = m * hidden * dt.itemsize
    # (one node runs the activation's gradient and both products, so dx is allocated while the
    # incoming gradient is alive, where eager's GeluBackward0 frees it first: x's bytes more)
    assert fused <= eager + x.numel() * x.element_size() + unit // 16, (
        f"peak {fused / unit:.2f} units of M x H against eager's {eager / unit:.2f}; live bytes as each node "
        f"starts, fused: {[(n, round(b / unit, 2)) for n, b in fused_marks]}; eager: "
        f"{[(n, round(b / unit, 2)) for n, b in eager_marks]}"
    )
