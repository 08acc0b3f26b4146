"""The row normalisations (rms_norm, layer_norm, add_rms_norm, add_layer_norm) and their
modules against PyTorch in float64.

The grid is pruned: every op at every kernel dtype at three widths (one column; a narrow row,
several a program; a row in one block), and the widest path (rows read in chunks) once per op
in float32 and bfloat16: the kernels' switches are the op's (RMS or LayerNorm, residual,
weight, bias) and the width's (one pass or chunks); the dtype only changes loads and stores.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand

import fusedkit
from fusedkit.kernels.norm import MAX_ONE_PASS
from fusedkit.testing import NORM_TOLERANCES, TOLERANCES

OPS = [k.name for k in fusedkit.registry.row_kernels()]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDE = MAX_ONE_PASS + 808  # (rows read in chunks)


def _call(op, x, r, w, b, eps, alpha=1.0, shape=None):
    """``(y, h)`` of ``op`` (``h`` None for the plain norms) through fusedkit or, with
    ``op`` prefixed ``torch:``, PyTorch's composition."""
    shape = shape or w.shape
    if op.startswith("torch:"):
        op = op.removeprefix("torch:")
        h = torch.add(x, r, alpha=alpha) if op.startswith("add_") else x
        y = F.rms_norm(h, shape, w, eps) if "rms" in op else F.layer_norm(h, shape, w, b, eps)
        return y, (h if op.startswith("add_") else None)
    if op == "rms_norm":
        return fusedkit.rms_norm(x, shape, w, eps), None
    if op == "layer_norm":
        return fusedkit.layer_norm(x, shape, w, b, eps), None
    if op == "add_rms_norm":
        return fusedkit.add_rms_norm(x, r, w, eps, alpha=alpha)
    return fusedkit.add_layer_norm(x, r, w, b, eps, alpha=alpha)


def _inputs(op, rows, n, dtype, grad=False):
    x, r = rand((rows, n), dtype, DEVICE), rand((rows, n), dtype, DEVICE)
    w = rand((n,), torch.float32, DEVICE) / 3  # (a float32 weight, as autocast training keeps it)
    b = rand((n,), torch.float32, DEVICE) / 3 if "layer" in op else None
    tensors = [x, r if op.startswith("add_") else None, w, b]
    return [t.requires_grad_(grad) if t is not None else None for t in tensors]


def _wide(t):
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)


def _close(got, want, dtype, tol=None):
    tol = tol or NORM_TOLERANCES[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol, equal_nan=True)


GRID = [(op, dtype, n) for op in OPS for dtype in DTYPES for n in (1, 96, 1000)]
GRID += [pytest.param(op, dtype, WIDE, marks=pytest.mark.slow) for op in OPS for dtype in DTYPES[:2]]


@pytest.mark.parametrize(("op", "dtype", "n"), GRID)
def test_forward_matches_float64(op, dtype, n):
    x, r, w, b = _inputs(op, 7, n, dtype)
    (y, h), (yr, hr) = _call(op, x, r, w, b, 1e-5, 0.5), _call("torch:" + op, *map(_wide, (x, r, w, b)), 1e-5, 0.5)
    if h is not None:
        _close(h, hr, dtype, TOLERANCES[dtype])
        yr = _call("torch:" + op.removeprefix("add_"), h.double(), None, w.double(), _wide(b), 1e-5)[0]
    _close(y, yr, dtype)


@pytest.mark.parametrize(("op", "dtype", "n"), [(op, dtype, 96) for op in OPS for dtype in DTYPES[:2]])
def test_gradients_match_float64(op, dtype, n):
    """Every input's gradient, both outputs' gradients flowing (the residual stream's too)."""
    _check_gradients(op, 9, n, dtype)


@pytest.mark.parametrize("op", OPS)
def test_gradients_when_programs_take_many_row_blocks(op):
    # The backward's programs each loop over blocks of BLOCK_M rows, the last program's last
    # block part-filled; the weight's gradient sums every program's rows.
    from fusedkit.runtime.norm import _config, _programs_per_device

    n = 200
    _check_gradients(op, 3 * _config(n)["BLOCK_M"] * _programs_per_device(torch.device(DEVICE)) + 5, n, torch.float32)


def _check_gradients(op, rows, n, dtype):
    x, r, w, b = _inputs(op, rows, n, dtype, grad=True)
    wide = list(map(_wide, (x, r, w, b)))
    (y, h), (yr, hr) = _call(op, x, r, w, b, 1e-5, 0.5), _call("torch:" + op, *wide, 1e-5, 0.5)
    if h is not None:  # the norm reads h as rounded to its dtype (as the eager add rounds it)
        rounded = hr + (h.detach().double() - hr).detach()
        yr = _call("torch:" + op.removeprefix("add_"), rounded, None, *wide[2:], 1e-5)[0]
    gy = rand(y.shape, dtype, DEVICE)
    outs, grads, wide_outs, wide_grads = [y], [gy], [yr], [gy.double()]
    if h is not None:
        gh = rand(h.shape, dtype, DEVICE)
        outs, grads, wide_outs, wide_grads = [y, h], [gy, gh], [yr, hr], [gy.double(), gh.double()]
    leaves = [t for t in (x, r, w, b) if t is not None]
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(wide_outs, [t for t in wide if t is not None], wide_grads)
    for g, wg, leaf in zip(got, want, leaves):
        scale = wg.abs().max().item()  # (a sum over rows: held to the rounding of its size)
        tol = NORM_TOLERANCES[leaf.dtype]
        torch.testing.assert_close(g.double(), wg, atol=tol.atol * max(scale, 1), rtol=tol.rtol)
        assert g.dtype == leaf.dtype


@pytest.mark.slow  # rows read in chunks, in the interpreter
@pytest.mark.parametrize("op", OPS)
def test_wide_rows_gradients(op):
    """Rows in chunks: every input's gradient, both outputs' gradients flowing (the chunked
    loop adds the gradient that reached h itself)."""
    _check_gradients(op, 3, WIDE, torch.float32)


def test_views_shapes_and_special_values():
    """Rows at a stride (a slice of a wider buffer), a transposed input, several normalised
    dims, a batch of matrices, empty inputs; NaN and inf rows as torch gives them."""
    big = rand((12, 40), torch.float32, DEVICE)
    for x in (big[::2, 3:35], big[:8, :32].t().contiguous().t(), big[:32, :8].t()):
        w = rand((x.shape[-1],), torch.float32, DEVICE)
        _close(fusedkit.rms_norm(x, x.shape[-1:], w), F.rms_norm(x.double(), x.shape[-1:], w.double()), x.dtype)
    x, w, b = rand((2, 3, 4, 5), torch.float32, DEVICE), rand((4, 5), torch.float32, DEVICE), None
    _close(fusedkit.layer_norm(x, (4, 5), w, b), F.layer_norm(x.double(), (4, 5), w.double()), torch.float32)
    for shape in ((0, 8), (3, 0)):
        e = torch.empty(shape, device=DEVICE)
        assert fusedkit.rms_norm(e, shape[-1:]).shape == shape
        y, h = fusedkit.add_layer_norm(e, e, None, None)
        assert y.shape == h.shape == shape
    x = rand((4, 6), torch.float32, DEVICE)
    x[1, 2], x[2, 0], x[3, :] = float("nan"), float("inf"), -0.0
    # (RMSNorm's documented formula: F.rms_norm gives an inf row as it on the CPU, all NaN on
    # CUDA (torch 2.11); the kernels give the formula's [nan, 0, ...] on both)
    d = x.double()
    rms = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5)
    for op, want in (("rms_norm", rms), ("layer_norm", F.layer_norm(d, (6,), eps=1e-5))):
        _close(_call(op, x, None, None, None, 1e-5, shape=(6,))[0], want, torch.float32)


def test_bad_input_raises_before_anything_runs():
    x, w = rand((4, 8), torch.float32, DEVICE), rand((8,), torch.float32, DEVICE)
    cases = [
        (fusedkit.ShapeError, lambda: fusedkit.rms_norm(x, (4,))),
        (fusedkit.ShapeError, lambda: fusedkit.rms_norm(x, ())),
        (fusedkit.ShapeError, lambda: fusedkit.rms_norm(torch.tensor(1.0, device=DEVICE), (1,))),
        (fusedkit.ShapeError, lambda: fusedkit.layer_norm(x, (8,), w[:4])),
        (fusedkit.ShapeError, lambda: fusedkit.add_rms_norm(x, x[:2], w)),
        (fusedkit.DTypeError, lambda: fusedkit.rms_norm(x.int(), (8,))),
        (fusedkit.DTypeError, lambda: fusedkit.rms_norm(x.tolist(), (8,))),
        (fusedkit.DeviceError, lambda: fusedkit.rms_norm(x, (8,), w.to("meta"))),
        (fusedkit.ArgumentError, lambda: fusedkit.layer_norm(x, (8,), eps=-1.0)),
        (fusedkit.ArgumentError, lambda: fusedkit.add_rms_norm(x, x, w, alpha=True)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
    assert issubclass(fusedkit.ShapeError, ValueError) and issubclass(fusedkit.DTypeError, TypeError)


def test_backward_is_deterministic_and_checks_saved_versions():
    x, r, w, b = _inputs("add_layer_norm", 64, 96, torch.float32, grad=True)
    grads = []
    for _ in range(2):
        y, h = fusedkit.add_layer_norm(x, r, w, b)
        grads.append(torch.autograd.grad((y * y).sum() + h.sum(), (w, b, x)))
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    frozen = w.detach()  # (a weight without a gradient scales the input's gradient still)
    (got,) = torch.autograd.grad(fusedkit.rms_norm(x, (96,), frozen).square().sum(), x)
    (want,) = torch.autograd.grad(F.rms_norm(x, (96,), frozen).square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    y = fusedkit.rms_norm(x, (96,), w)
    with torch.no_grad():
        x.mul_(2)  # the saved input changed in place: autograd refuses, as for torch's ops
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_and_torch_func():
    x, _, w, b = _inputs("layer_norm", 5, 12, torch.float32, grad=True)
    xw, ww, bw = map(_wide, (x, w, b))
    (g,) = torch.autograd.grad(fusedkit.layer_norm(x, (12,), w, b).square().sum(), x, create_graph=True)
    (gw,) = torch.autograd.grad(F.layer_norm(xw, (12,), ww, bw).square().sum(), xw, create_graph=True)
    torch.testing.assert_close(
        torch.autograd.grad(g.sum(), w)[0].double(), torch.autograd.grad(gw.sum(), ww)[0], atol=1e-5, rtol=1e-5
    )
    f = torch.func.grad(lambda t: fusedkit.rms_norm(t, (12,), w.detach()).sum())
    torch.testing.assert_close(
        f(x.detach()), torch.func.grad(lambda t: F.rms_norm(t, (12,), w.detach()).sum())(x.detach())
    )
    batched = torch.func.vmap(lambda t: fusedkit.rms_norm(t, (12,)))(x.detach())
    torch.testing.assert_close(batched, F.rms_norm(x.detach(), (12,)))


def test_autocast_follows_torch():
    """Result dtypes under autocast as torch's norms give them on this device."""
    x = rand((4, 16), torch.bfloat16, DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        for t in (x, x.float()):
            assert fusedkit.rms_norm(t, (16,)).dtype == F.rms_norm(t, (16,)).dtype
            assert fusedkit.layer_norm(t, (16,)).dtype == F.layer_norm(t, (16,)).dtype
            y, h = fusedkit.add_rms_norm(t, t, None)
            assert (y.dtype, h.dtype) == (F.rms_norm(t + t, (16,)).dtype, t.dtype)


@pytest.mark.slow  # torch.compile
def test_compiles_fullgraph_as_pytorchs_composition():
    x, r, w, b = _inputs("add_layer_norm", 6, 32, torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    torch._dynamo.reset()
    got = torch.compile(lambda *a: fusedkit.add_layer_norm(*a), fullgraph=True, backend=backend)(x, r, w, b)
    want = fusedkit.add_layer_norm(x, r, w, b)
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g, wnt)
    assert graphs and not any("fusedkit" in op for op in graphs[0])


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_modules_are_drop_ins(cls):
    torch_cls, ours = getattr(torch.nn, cls), getattr(fusedkit.nn, cls)
    for kwargs in ({}, {"elementwise_affine": False}, {"eps": 1e-3}) + (
        ({"bias": False},) if cls == "LayerNorm" else ()
    ):
        stock, mine = torch_cls((3, 8), **kwargs).to(DEVICE), ours((3, 8), **kwargs).to(DEVICE)
        with torch.no_grad():
            for p in stock.parameters():
                p.copy_(rand(p.shape, p.dtype, DEVICE))
        mine.load_state_dict(stock.state_dict())
        assert list(mine.state_dict()) == list(stock.state_dict())
        x = rand((5, 3, 8), torch.float32, DEVICE).requires_grad_()
        _close(mine(x), stock(x), torch.float32)
        (gm,) = torch.autograd.grad(mine(x).sum(), x)
        (gs,) = torch.autograd.grad(stock(x).sum(), x)
        torch.testing.assert_close(gm, gs, atol=1e-5, rtol=1e-5)


def test_rms_norm_loads_a_llama_rms_norm():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    stock = LlamaRMSNorm(16, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        stock.weight.copy_(rand((16,), torch.float32, DEVICE))
    mine = fusedkit.nn.RMSNorm(16, eps=1e-6).to(DEVICE)
    mine.load_state_dict(stock.state_dict())
    x = rand((4, 16), torch.float32, DEVICE)
    _close(mine(x), stock(x), torch.float32)
    assert transformers is not None


def test_a_byte_counter_sees_one_op_each_way_with_the_byte_model():
    x, r, w, _ = _inputs("add_rms_norm", 64, 32, torch.float32, grad=True)
    with fusedkit.MemoryCounterMode(display=False) as counter:
        y, h = fusedkit.add_rms_norm(x, r, w)
        torch.autograd.backward((y, h), (torch.ones_like(y), torch.ones_like(h)))
    by_op = counter.get_bytes_by_op()
    # x and r read, y and h written, the weight read, one float32 statistic a row written
    assert (
        by_op["fusedkit.add_rms_norm"]
        == fusedkit.registry.row_kernel("add_rms_norm").bytes_fused(64, 32, x.dtype).total
    )
    assert "fusedkit.add_rms_norm_grad" in by_op and not any(op.startswith("aten.pow") for op in by_op)
    assert x.grad is not None and r.grad is not None and w.grad is not None


@pytest.mark.parametrize("name", OPS)
def test_registered_ops_pass_opcheck(name):
    from fusedkit.autograd import norm_backward_op, norm_op

    x, r, w, b = (t.detach() if t is not None else None for t in _inputs(name, 8, 16, torch.float32))
    args = (x, r, w, b, name, 1e-5, 0.5, torch.float32, torch.float32)
    torch.library.opcheck(norm_op, args)
    y, h, mean, rstd = norm_op(*args)
    rows = h if r is not None else x
    torch.library.opcheck(norm_backward_op, (torch.randn_like(y), rows, w, mean, rstd, None, name, b is not None, True))


@pytest.mark.slow  # torch.compile
def test_compiled_with_the_kernel_setting_runs_the_registered_op():
    x, r, w, b = _inputs("add_layer_norm", 6, 32, torch.float32, grad=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    with fusedkit.settings.override(compiled_elementwise="kernel"):
        torch._dynamo.reset()
        y, h = torch.compile(lambda *a: fusedkit.add_layer_norm(*a), fullgraph=True, backend=backend)(x, r, w, b)
    want_y, want_h = fusedkit.add_layer_norm(x, r, w, b)
    torch.testing.assert_close((y, h), (want_y, want_h))
    got = torch.autograd.grad(y.sum() + h.sum(), (x, r, w, b))
    want = torch.autograd.grad(want_y.sum() + want_h.sum(), (x, r, w, b))
    torch.testing.assert_close(got, want)
    assert any("fusedkit.norm" in op for op in graphs[0])


def test_parameters_at_a_stride_the_default_eps_and_a_broadcast_residual_as_torch():
    x = rand((4, 16), torch.float32, DEVICE)
    w, b = rand((32,), torch.float32, DEVICE)[::2], rand((32,), torch.float32, DEVICE)[::2]  # read at a stride
    _close(fusedkit.layer_norm(x, (16,), w, b), F.layer_norm(x.double(), (16,), w.double(), b.double()), x.dtype)
    expanded = torch.tensor([2.0], device=DEVICE).expand(16)
    _close(fusedkit.rms_norm(x, (16,), expanded), F.rms_norm(x.double(), (16,), expanded.double()), x.dtype)
    # eps=None: float32's epsilon for half inputs too, as torch computes (not bfloat16's 2**-7)
    small = (rand((4, 64), torch.float32, DEVICE) * 0.003).bfloat16()
    _close(
        fusedkit.rms_norm(small, (64,)),
        F.rms_norm(small.double(), (64,), eps=torch.finfo(torch.float32).eps),
        small.dtype,
    )
    # a residual that broadcasts: torch's add, then the norm; h of the broadcast shape
    x3, pos = rand((3, 6, 16), torch.float32, DEVICE), rand((1, 6, 16), torch.float32, DEVICE)
    y, h = fusedkit.add_layer_norm(x3, pos, None, None)
    torch.testing.assert_close(h, x3 + pos)
    _close(y, F.layer_norm((x3 + pos).double(), (16,)), torch.float32)
    y, h = fusedkit.add_rms_norm(x3, x3, None, normalized_shape=(6, 16))  # two dims without a weight
    _close(y, F.rms_norm((2 * x3).double(), (6, 16)), torch.float32)
    with pytest.raises(fusedkit.DTypeError):
        fusedkit.add_rms_norm(x, None, w)
    with pytest.raises(fusedkit.ShapeError):
        fusedkit.add_rms_norm(x, x[:, :3], None)


def test_add_norm_keeps_h_not_its_operands_and_differentiates_twice():
    """Autograd keeps h (not x and residual: an in-place change of x after the call trains on,
    as eager's add allows); a gradient of the gradient flows back to x and residual through h,
    on the kernels' path and on the registered ops' (under a byte counter)."""
    a, r, w, _ = _inputs("add_rms_norm", 3, 8, torch.float32, grad=True)
    x = a * 1
    y, h = fusedkit.add_rms_norm(x, r, w, 1e-6)
    with torch.no_grad():
        x.add_(1)
    y.sum().backward()  # (no error: x is not kept)
    wide = [t.detach().double().requires_grad_() for t in (a, r, w)]

    def grads_of_grads(add_rms_norm, a, r, w):
        y, h = add_rms_norm(a, r, w)
        g = torch.autograd.grad(y.square().sum() + h.pow(3).sum(), (a, r, w), create_graph=True)
        return torch.autograd.grad(sum(t.square().sum() for t in g), (a, r, w))

    want = grads_of_grads(lambda a, r, w: (F.rms_norm(a + 0.5 * r, (8,), w, 1e-6), a + 0.5 * r), *wide)
    fused = functools.partial(fusedkit.add_rms_norm, eps=1e-6, alpha=0.5)
    for context in (contextlib.nullcontext(), fusedkit.MemoryCounterMode(display=False)):
        with context:
            got = grads_of_grads(fused, a, r, w)
        for g, wg in zip(got, want):
            torch.testing.assert_close(g.double(), wg, atol=1e-4 * max(wg.abs().max().item(), 1), rtol=1e-4)
    w2 = w.detach().requires_grad_()
    _, h = fusedkit.add_rms_norm(a, r, w2)
    h.sum().backward()
    assert w2.grad is None  # (only the residual stream reached the loss, as in torch)


def test_a_repeated_call_takes_its_kept_plan_and_any_change_the_full_path(monkeypatch):
    """The first call of a signature checks and plans; a repeat skips both (host time a
    decoding step pays per layer); any change of what the checks read (a shape, requires_grad,
    eps, the grad mode, autocast) plans again; fusedkit.clear_caches() empties the plans."""
    from fusedkit.runtime import norm as rn

    fusedkit.clear_caches()
    x, r, w, _ = _inputs("add_rms_norm", 5, 32, torch.float32)
    first = fusedkit.add_rms_norm(x, r, w, 1e-6)
    assert len(rn.KEPT) == 1
    checks = []
    monkeypatch.setattr(rn, "validate", lambda *a: checks.append(a))
    again = fusedkit.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert checks == [] and all(torch.equal(a, b) for a, b in zip(first, again))
    calls = [
        lambda: fusedkit.add_rms_norm(x[:4], r[:4], w, 1e-6),
        lambda: fusedkit.add_rms_norm(x, r, w, 1e-5),
        lambda: fusedkit.add_rms_norm(x, r, w.detach().requires_grad_(), 1e-6),
        lambda: fusedkit.add_rms_norm(x.t().contiguous().t(), r, w, 1e-6),
    ]
    for i, call in enumerate(calls, 1):
        call()
        assert len(checks) == i, i
    with torch.no_grad():
        fusedkit.add_rms_norm(x, r, w.detach().requires_grad_(), 1e-6)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        fusedkit.add_rms_norm(x, r, w, 1e-6)
    assert len(checks) == len(calls) + 2
    fusedkit.clear_caches()
    assert len(rn.KEPT) == 0


@pytest.mark.parametrize("n", [5, 1000, pytest.param(WIDE, marks=pytest.mark.slow)])
def test_masked_out_columns_are_never_summed(monkeypatch, n):
    """A masked load without ``other`` is undefined on a GPU (the interpreter gives zeros):
    here masked-out lanes read 7, and every row sum must still cover the row alone."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if DEVICE.type != "cpu" or builder is None or not hasattr(builder, "create_masked_load"):
        pytest.skip("needs Triton's interpreter (its masked load to patch)")
    import numpy as np

    original = builder.create_masked_load

    def garbage(self, ptrs, mask, other, *args):
        if other is None:
            dtype = ptrs.get_element_ty()
            other = interpreter.TensorHandle(np.full_like(ptrs.data, 7, dtype=interpreter._get_np_dtype(dtype)), dtype)
        return original(self, ptrs, mask, other, *args)

    monkeypatch.setattr(builder, "create_masked_load", garbage)
    for op in OPS:
        x, r, w, b = _inputs(op, 3, n, torch.float32, grad=True)
        y, _ = _call(op, x, r, w, b, 1e-5)
        _close(
            y,
            _call("torch:" + op, *(None if t is None else t.detach().double() for t in (x, r, w, b)), 1e-5)[0],
            x.dtype,
        )
        leaves = [t for t in (x, r, w, b) if t is not None]
        got = torch.autograd.grad(y, leaves, torch.ones_like(y))
        wide = [t.detach().double().requires_grad_() for t in leaves]
        it = iter(wide)
        args = [next(it) if t is not None else None for t in (x, r, w, b)]
        want = torch.autograd.grad(_call("torch:" + op, *args, 1e-5)[0], wide, torch.ones(y.shape, dtype=torch.float64))
        for g, wg in zip(got, want):
            torch.testing.assert_close(g.double(), wg, atol=1e-4 * max(wg.abs().max().item(), 1), rtol=1e-4)


def test_the_registered_ops_read_a_transposed_input_as_the_kernels_do():
    """Under a dispatch mode the registered ops run; a transposed input's rows are read at their
    strides forward and backward (the backward read them as contiguous)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = rand((6, 4), torch.float32, DEVICE).t().requires_grad_()
    w, b = (rand((6,), torch.float32, DEVICE).requires_grad_() for _ in range(2))
    with PassThrough():
        got = torch.autograd.grad(fusedkit.layer_norm(x, (6,), w, b).square().sum(), (x, w, b))
    want = torch.autograd.grad(F.layer_norm(x, (6,), w, b).square().sum(), (x, w, b))
    for g, wg in zip(got, want):
        torch.testing.assert_close(g, wg, atol=1e-4, rtol=1e-4)


def test_plans_follow_the_settings_and_never_skip_a_check_they_would_fail():
    from fusedkit.runtime import norm as rn

    fusedkit.clear_caches()
    x = rand((3, 6), torch.float32, DEVICE)
    with fusedkit.settings.override(fast_launch=False):
        fusedkit.rms_norm(x, (6,))
        assert len(rn.KEPT) == 0
    fusedkit.rms_norm(x, (6,))
    assert len(rn.KEPT) == 1
    for bad in ((6.0,), (True,)):  # (equal to (6,) and (1,) as keys)
        with pytest.raises(fusedkit.ShapeError):
            fusedkit.rms_norm(x, bad)
    with pytest.raises(fusedkit.ArgumentError):
        fusedkit.rms_norm(x, (6,), eps=float("inf"))


@pytest.mark.parametrize("op", OPS)
def test_every_call_path_gives_the_same_bits(op):
    # The first call (checks, then a plan kept), a repeat (the kept plan), and the registered
    # ops a dispatch mode sees (here a byte counter) launch the same kernels: outputs and every
    # gradient bit for bit (docs/design.md, "Norm calls").
    x, r, w, b = _inputs(op, 37, 200, torch.bfloat16, grad=True)
    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = [rand((37, 200), torch.bfloat16, DEVICE) for _ in range(2)]

    def run():
        y, h = _call(op, x, r, w, b, 1e-5, 0.5)
        outs = [y] if h is None else [y, h]
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads[: len(outs)]))

    fusedkit.clear_caches()
    first, kept = run(), run()
    with fusedkit.MemoryCounterMode(display=False):
        registered = run()
    for a, k, g in zip(first, kept, registered):
        assert torch.equal(a, k) and torch.equal(a, g)
    with torch.no_grad():  # (the second call without a gradient launches from its recipe on a GPU)
        for _ in range(2):
            y, h = _call(op, x, r, w, b, 1e-5, 0.5)
            assert all(torch.equal(a, o) for a, o in zip(first, [y] if h is None else [y, h]))


@pytest.mark.parametrize("op", OPS)
def test_lazily_negated_views_are_read_as_their_values(op):
    # A negation bit (torch._neg_view; what conj of a real view gives) is resolved before the
    # kernels read memory: the values and gradients are the view's, the first call and a repeat.
    x, r, w, b = _inputs(op, 9, 24, torch.float32, grad=True)
    neg = [None if t is None else torch._neg_view(t) for t in (x, r, w, b)]
    assert neg[0].is_neg()
    wide = [None if t is None else -_wide(t) for t in (x, r, w, b)]
    leaves = [t for t in (x, r, w, b) if t is not None]
    want = _call("torch:" + op, *wide, 1e-5)
    want_grads = torch.autograd.grad([o.sum() for o in want if o is not None], [t for t in wide if t is not None])
    for _ in range(2):
        got = _call(op, *neg, 1e-5)
        for g, e in zip(got, want):
            if e is not None:
                torch.testing.assert_close(g.double(), e, atol=1e-4, rtol=1e-4)
        grads = torch.autograd.grad([o.sum() for o in got if o is not None], leaves)
        for g, e in zip(grads, want_grads):  # (d/dt of f(-t) is -f'(-t))
            torch.testing.assert_close(g.double(), -e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weight", [None, "frozen"])
def test_the_registered_backward_without_parameter_gradients(weight):
    # Under a dispatch mode the norm runs as its registered ops; a backward with no parameter
    # gradient to give returns an empty tensor for each (an op's outputs alias nothing).
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    w = None if weight is None else torch.randn(8, device=DEVICE)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False):
        y = fusedkit.rms_norm(x, (8,), w, 1e-6)
        (g,) = torch.autograd.grad(y.sum(), x)
    want = torch.func.grad(lambda t: torch.nn.functional.rms_norm(t, (8,), w, 1e-6).sum())(x.detach())
    torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)
