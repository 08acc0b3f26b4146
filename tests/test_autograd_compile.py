"""Autograd, torch.compile, torch.library and CUDA graphs for the elementwise ops."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import rand

import fusedkit
from fusedkit._library import elementwise_op

DIFFERENTIABLE = [k for k in fusedkit.registry.kernels() if k.backward is not None]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def leaf(shape, dtype=torch.float64):
    return rand(shape, dtype, DEVICE).requires_grad_()


@pytest.mark.parametrize("alpha", [1, -0.5, 2.0])
@pytest.mark.parametrize("kernel", DIFFERENTIABLE, ids=lambda k: k.name)
def test_gradcheck_float64(kernel, alpha):
    for shapes in (((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 3), (4, 1)), ((), (5,))):
        a, b = leaf(shapes[0]), leaf(shapes[1])
        assert torch.autograd.gradcheck(lambda p, q: fusedkit.elementwise(kernel, p, q, alpha=alpha), (a, b))
    x = leaf((3, 4))
    assert torch.autograd.gradcheck(lambda p: fusedkit.elementwise(kernel, 1.5, p, alpha=alpha), (x,))
    assert torch.autograd.gradcheck(lambda p: fusedkit.elementwise(kernel, p.t(), -0.25, alpha=alpha), (x,))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("kernel", DIFFERENTIABLE, ids=lambda k: k.name)
def test_gradients_match_torch(kernel, dtype):
    x, bias = leaf((33, 17), dtype), leaf((17,), torch.float32)  # mixed dtypes: the bias stays fp32
    g = rand((33, 17), torch.result_type(x, bias), DEVICE)
    fusedkit.elementwise(kernel, x, bias, alpha=2).backward(g)
    xr, br = (t.detach().double().requires_grad_() for t in (x, bias))
    kernel.reference(xr, br, 2).backward(g.double())
    assert x.grad.dtype == dtype and bias.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=GRAD_TOL[dtype], rtol=GRAD_TOL[dtype])
    torch.testing.assert_close(bias.grad.double(), br.grad, atol=GRAD_TOL[dtype] * 40, rtol=GRAD_TOL[dtype])


def _saved_bytes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_add_relu_saves_only_its_output():
    x, y = leaf((64, 32), torch.float32), leaf((64, 32), torch.float32)
    out, saved = _saved_bytes(lambda: fusedkit.add_relu(x, y))
    assert len(saved) == 1 and saved[0].shape == out.shape
    _, saved_torch = _saved_bytes(lambda: torch.relu(x + y))
    assert sum(t.numel() for t in saved) <= sum(t.numel() for t in saved_torch)
    _, saved_add = _saved_bytes(lambda: fusedkit.add(x, y, alpha=3))
    assert saved_add == []


def test_addrelu_module():
    m = fusedkit.nn.AddReLU(alpha=0.5, inplace=True)
    x, r = rand((4, 6), torch.float32, DEVICE), rand((6,), torch.float32, DEVICE)
    expected = torch.relu(x + 0.5 * r)
    with torch.no_grad():
        assert m(x, r) is x
    torch.testing.assert_close(x, expected)
    xg = leaf((4, 6), torch.float32)
    out = m(xg, r)
    assert out is not xg and out.requires_grad
    assert "alpha=0.5" in repr(m)


@pytest.mark.parametrize("kernel", [k for k in fusedkit.registry.kernels()], ids=lambda k: k.name)
def test_opcheck(kernel):
    dtypes = [d for d in (torch.float32, torch.float64, torch.int64) if d in kernel.dtypes]
    for dtype in dtypes:
        a, b = rand((5, 6), dtype, DEVICE), rand((6,), dtype, DEVICE)
        if dtype.is_floating_point and kernel.backward is not None:
            a.requires_grad_()
        param = 2 if kernel.param is not None else 0
        torch.library.opcheck(elementwise_op, (kernel.name, [a, b], [0, 1], [], param))
        torch.library.opcheck(elementwise_op, (kernel.name, [a], [0], [3], param))


def _model(x, bias, r):
    h = fusedkit.add_relu(x, bias)
    h = fusedkit.add(h, r, alpha=0.5)
    return fusedkit.add_relu(h * 2, 1.0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_no_breaks(dynamic):
    torch._dynamo.reset()
    x, bias, r = (rand(s, torch.float32, DEVICE) for s in ((16, 8), (8,), (16, 8)))
    explanation = torch._dynamo.explain(_model)(x, bias, r)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(_model, fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(compiled(x, bias, r), _model(x, bias, r))
    x2, r2 = rand((24, 8), torch.float32, DEVICE), rand((24, 8), torch.float32, DEVICE)
    torch.testing.assert_close(compiled(x2, bias, r2), _model(x2, bias, r2))


def test_compile_with_out_and_backward():
    torch._dynamo.reset()

    def step(x, y, buf):
        fusedkit.add_relu(x.detach(), y.detach(), out=buf)
        return fusedkit.add_relu(x, y).sum() + buf.sum()

    x, y = leaf((8, 8), torch.float32), leaf((8,), torch.float32)
    buf = torch.empty(8, 8, device=DEVICE)
    loss = torch.compile(step, fullgraph=True)(x, y, buf)
    loss.backward()
    xr, yr = (t.detach().requires_grad_() for t in (x, y))
    (2 * torch.relu(xr + yr)).sum().backward()  # same value; grads only through the second call
    torch.testing.assert_close(loss, (2 * torch.relu(xr + yr)).sum())
    torch.testing.assert_close(x.grad, xr.grad / 2)
    torch.testing.assert_close(buf, torch.relu(xr + yr).detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    x, y = rand((1000, 64), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    w = rand((32, 64), torch.float32, DEVICE)
    out = torch.empty(1000, 64, device=DEVICE)
    fusedkit.add_relu(x, y, out=out)  # warm-up: compile (and tune) before capture
    mm = fusedkit.linear_relu(out, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fusedkit.add_relu(x, y, out=out)
        mm_g = fusedkit.linear_relu(out, w)
    x.copy_(rand((1000, 64), torch.float32, DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fusedkit.add_relu(x, y))
    assert torch.equal(mm_g, fusedkit.linear_relu(out, w))
    del mm
