"""fusedkit.mlp: the MLP as one trainable unit (the backward epilogue's GEMM) against float64 PyTorch.

The grid: every activation in float32 and bfloat16 with and without ``recompute`` (quick: float32,
and each activation once); gradcheck in float64 for each activation (quick: gelu). The backward
GEMM itself (``matmul.activation_grad``) is checked on more tile rows than one program covers, so
the bias gradient's partial sums are summed across tiles, and twice for the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand, slow_unless

import fusedkit
from fusedkit.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from fusedkit.runtime import matmul as mm
from fusedkit.testing import assert_rel_err, matmul_rel_err

ACTIVATIONS = [("gelu", "none"), ("gelu", "tanh"), ("relu", "none"), ("silu", "none")]


@pytest.fixture(autouse=True)
def fixed_matmul_config(fk_settings, request):
    """The fixed tile, as tests/test_matmul.py runs (tuning every test shape would compile
    hundreds of kernels on a GPU); the tuned test tunes."""
    fk_settings(autotune="tuned" in request.node.name)


def reference(x, w1, b1, w2, b2, activation, approximate):
    act = {"gelu": lambda t: F.gelu(t, approximate=approximate), "relu": F.relu, "silu": F.silu}[activation]
    return F.linear(act(F.linear(x, w1, b1)), w2, b2)


def params(dtype, inner=24, hidden=40, out=16):
    return [rand(s, dtype, DEVICE).requires_grad_() for s in ((hidden, inner), (hidden,), (out, hidden), (out,))]


@pytest.mark.parametrize(
    "dtype,act,recompute",
    slow_unless(
        lambda dtype, act, recompute: dtype == torch.float32 and (act == ACTIVATIONS[0] or not recompute),
        [(d, a, r) for d in (torch.float32, torch.bfloat16) for a in ACTIVATIONS for r in (False, True)],
    ),
)
def test_forward_and_gradients_match_torch(dtype, act, recompute):
    # 74 rows: more than one tile row of the backward GEMM, the last part-filled
    x = rand((2, 37, 24), dtype, DEVICE).requires_grad_()
    w1, b1, w2, b2 = params(dtype)
    y = fusedkit.mlp(x, w1, b1, w2, b2, activation=act[0], approximate=act[1], recompute=recompute)
    g = rand(y.shape, dtype, DEVICE)
    y.backward(g)
    wide = [t.detach().double().cpu().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y64 = reference(*wide, *act)
    y64.backward(g.double().cpu())
    assert y.dtype == dtype and y.shape == (2, 37, 16)
    bound = 3e-2 if dtype == torch.bfloat16 else matmul_rel_err(torch.float32) * 10
    assert_rel_err(y, y64, bound)
    for got, ref in zip((x, w1, b1, w2, b2), wide):
        assert got.grad.dtype == dtype
        assert_rel_err(got.grad, ref.grad, bound)


@pytest.mark.parametrize("act", slow_unless(lambda act: act == ACTIVATIONS[0], [(a,) for a in ACTIVATIONS]))
def test_gradcheck_float64(act):
    x = rand((3, 4), torch.float64, DEVICE).requires_grad_()
    w1, b1, w2, b2 = params(torch.float64, inner=4, hidden=5, out=3)
    for recompute in (False, True):
        assert torch.autograd.gradcheck(
            lambda *t: fusedkit.mlp(*t, activation=act[0], approximate=act[1], recompute=recompute),
            (x, w1, b1, w2, b2),
            eps=1e-6,
            atol=1e-5,
            rtol=1e-4,
        )


@pytest.mark.parametrize("act", slow_unless(lambda act: act[0] == "relu", [(a,) for a in ACTIVATIONS]))
def test_without_the_prologue_h_is_saved_and_the_gradients_agree(act, monkeypatch):
    """``autograd.MLP_PROLOGUE = False``: the first GEMM's epilogue writes h (and pre where the
    derivative needs it), saved as eager keeps them; the same gradients (float64 gradcheck)."""
    from fusedkit import autograd

    monkeypatch.setattr(autograd, "MLP_PROLOGUE", False)
    x = rand((3, 4), torch.float64, DEVICE).requires_grad_()
    w1, b1, w2, b2 = params(torch.float64, inner=4, hidden=5, out=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        fusedkit.mlp(x, w1, b1, w2, b2, activation=act[0], approximate=act[1])
    assert saved.count((3, 5)) == (1 if act[0] == "relu" else 2)
    fn = lambda *t: fusedkit.mlp(*t, activation=act[0], approximate=act[1])
    assert torch.autograd.gradcheck(fn, (x, w1, b1, w2, b2), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_saved_tensors_and_recompute():
    """Default: x, the weights and the activation's input, one tensor of the hidden size where
    eager keeps two (GELU, SiLU: input and output; ReLU: its output); recompute: x and the
    weights (b1 to run the first GEMM again), nothing of the hidden size."""
    x = rand((8, 6), torch.float32, DEVICE).requires_grad_()
    w1, b1, w2, b2 = params(torch.float32, inner=6, hidden=10, out=4)
    for activation, recompute, want in [
        ("gelu", False, [(8, 6), (10, 6), (4, 10), (8, 10)]),
        ("relu", False, [(8, 6), (10, 6), (4, 10), (8, 10)]),
        ("silu", False, [(8, 6), (10, 6), (4, 10), (8, 10)]),
        ("gelu", True, [(8, 6), (10, 6), (10,), (4, 10)]),
    ]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            fusedkit.mlp(x, w1, b1, w2, b2, activation=activation, recompute=recompute)
        assert saved == want, (activation, recompute)


def test_without_biases_and_without_grad():
    x = rand((5, 24), torch.float32, DEVICE)
    w1, _, w2, _ = params(torch.float32)
    with torch.no_grad():
        y = fusedkit.mlp(x, w1, None, w2, None, activation="silu")
    assert_rel_err(
        y, reference(*(t.double().cpu() for t in (x, w1)), None, w2.double().cpu(), None, "silu", "none"), 1e-4
    )
    w1.grad = None
    x.requires_grad_()
    fusedkit.mlp(x, w1, None, w2, None, activation="silu").sum().backward()
    assert x.grad is not None and w1.grad is not None


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_backward_epilogue_bias_sums_across_tile_rows_same_bits(kernel, fk_settings, monkeypatch):
    """Both matmul kernels' backward epilogue (the TMA one where the layout allows, as here:
    rows of 16-byte multiples), on four tile rows of the interpreter's tiles (32), the last
    part-filled."""
    fk_settings(matmul_kernel=kernel)
    fusedkit.clear_caches()  # (a kept TMA launch would skip launch_tma)
    tma_launches = []
    launch_tma = mm.matmul_tma.launch_tma
    monkeypatch.setattr(mm.matmul_tma, "launch_tma", lambda *a, **k: tma_launches.append(1) or launch_tma(*a, **k))
    m, k, n = 100, 24, 40
    g, b, pre = (rand(s, torch.float32, DEVICE) for s in ((m, k), (k, n), (m, n)))
    for activation in mm.ACTIVATION_NAMES:
        dpre, db = mm.activation_grad(g, b, pre, activation, True)
        p64 = pre.double().cpu().requires_grad_()
        (ref,) = torch.autograd.grad(mm.torch_activation(p64, activation), p64, g.double().cpu() @ b.double().cpu())
        assert_rel_err(dpre, ref, matmul_rel_err(torch.float32) * 10)
        assert_rel_err(db, ref.sum(0), matmul_rel_err(torch.float32) * 10)
        again = mm.activation_grad(g, b, pre, activation, True)
        assert torch.equal(again[0], dpre) and torch.equal(again[1], db)
    assert mm.activation_grad(g, b, pre, "gelu", False)[1] is None
    wide = rand((m, 2 * n), torch.float32, DEVICE)[:, ::2]  # a strided pre: read as its values
    assert torch.equal(
        mm.activation_grad(g, b, wide, "silu", False)[0], mm.activation_grad(g, b, wide.contiguous(), "silu", False)[0]
    )
    assert bool(tma_launches) == (
        kernel == "tma" and (DEVICE.type == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    )


def test_bad_input_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(mm, "launch_matmul", lambda *a, **k: pytest.fail("launched on bad input"))
    x = rand((4, 6), torch.float32, DEVICE)
    w1, b1, w2, b2 = (t.detach() for t in params(torch.float32, inner=6, hidden=10, out=4))
    cases = [
        ((x, w1, b1, w2, b2), {"activation": "tanh"}, ArgumentError, "choose activation"),
        ((x, w1, b1, w2, b2), {"activation": "relu", "approximate": "tanh"}, ArgumentError, "choose activation"),
        ((x, w1, b1, w2, b2), {"activation": ["gelu"]}, ArgumentError, "choose activation"),
        ((x[:, :5], w1, b1, w2, b2), {}, ShapeError, "in_features"),
        ((x, w1, b1, w2[:, :9], b2), {}, ShapeError, "hidden features"),
        ((x, w1, b1[:9], w2, b2), {}, ShapeError, r"b1 must have shape \(10,\)"),
        ((x, w1[0], b1, w2, b2), {}, ShapeError, "2-D"),
        ((x, w1.double(), b1, w2, b2), {}, DTypeError, "share a dtype"),
        ((x, w1, "b1", w2, b2), {}, DTypeError, "b1 must be a Tensor or None"),
        ((x, w1, b1, w2.to("meta"), b2), {}, DeviceError, "w2 is on meta"),
        ((x.int(), w1.int(), None, w2.int(), None), {}, DTypeError, "not supported"),
    ]
    for args, kw, error, words in cases:
        with pytest.raises(error, match=words):
            fusedkit.mlp(*args, **kw)


def _timm_mlp(in_features, hidden, approximate):
    """timm's ``layers.Mlp`` where timm imports (the GPU machine), else a module with its
    state dict keys and forward (fc1, act, fc2; its dropouts and norm identities by default)."""
    try:
        from timm.layers import Mlp

        return Mlp(in_features, hidden, act_layer=lambda: torch.nn.GELU(approximate=approximate))
    except Exception:  # timm needs a working torchvision: not on the CPU machine
        stock = torch.nn.Module()
        stock.fc1, stock.act, stock.fc2 = (
            torch.nn.Linear(in_features, hidden),
            torch.nn.GELU(approximate=approximate),
            torch.nn.Linear(hidden, in_features),
        )
        stock.forward = lambda x: stock.fc2(stock.act(stock.fc1(x)))
        return stock


def _assert_same_step(stock, fused, in_features):
    """The same output, and input gradient, from ``stock`` and the ``fused`` module that loaded
    its state dict, on one batch (the parameters' gradients are left for the caller)."""
    x = rand((2, 5, in_features), torch.float32, DEVICE)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yf = stock(xs), fused(xf)
    torch.testing.assert_close(yf, ys, rtol=1e-5, atol=1e-5)
    ys.square().sum().backward()
    yf.square().sum().backward()
    torch.testing.assert_close(xf.grad, xs.grad, rtol=1e-4, atol=1e-4)


def test_module_loads_timm_mlp_and_matches_it():
    torch.manual_seed(3)
    stock = _timm_mlp(12, 20, "tanh").to(DEVICE)
    fused = fusedkit.nn.MLP(12, 20, activation="gelu", approximate="tanh", device=DEVICE)
    fused.load_state_dict(stock.state_dict())
    assert fused.state_dict().keys() == stock.state_dict().keys()
    _assert_same_step(stock, fused, 12)
    for (name, p), q in zip(fused.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=name)
    with pytest.raises(ArgumentError, match="choose activation"):
        fusedkit.nn.MLP(12, 20, activation="tanh")


def test_lazily_negated_gradient_and_float64_bias_gradient():
    """A gradient with the negation bit (``z.conj().imag``) is read as its values, not its
    memory; float64's bias gradient is summed in float64 (partials of the accumulator's dtype)."""
    x = rand((37, 24), torch.float64, DEVICE).requires_grad_()
    w1, b1, w2, b2 = params(torch.float64)
    g = torch.randn(37, 16, dtype=torch.complex128, device=DEVICE).conj().imag
    assert g.is_neg()
    grads = torch.autograd.grad(fusedkit.mlp(x, w1, b1, w2, b2), (x, w1, b1), g)
    wide = [t.detach().cpu().requires_grad_() for t in (x, w1, b1, w2, b2)]
    refs = torch.autograd.grad(reference(*wide, "gelu", "none"), wide[:3], g.cpu().resolve_neg())
    for got, ref in zip(grads, refs):
        assert_rel_err(got, ref, 1e-12)


def test_bias_gradient_of_a_tuned_first_call():
    """Tuning runs every candidate tile on the same buffers; each writes the column sums' rows
    of its own tile height. Those rows are zeroed before every run (``reset_to_zero``), so the
    first, tuned, call's bias gradient holds the chosen tile's sums alone."""
    assert "colsum_ptr" in mm.matmul_tuned.reset_to_zero
    if DEVICE.type != "cuda":
        pytest.skip("autotuning runs on a GPU only")
    m, k, n = 1000 + torch.randint(0, 100, ()).item(), 96, 200  # a shape no other test tuned
    g, b, pre = (rand(s, torch.bfloat16, DEVICE) for s in ((m, k), (k, n), (m, n)))
    db = mm.activation_grad(g, b, pre, "gelu", True)[1]
    p64 = pre.double().cpu().requires_grad_()
    (ref,) = torch.autograd.grad(F.gelu(p64), p64, g.double().cpu() @ b.double().cpu())
    assert_rel_err(db, ref.sum(0), 1e-2)  # (another tile's rows left in would be ~100%)


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_prologue_is_the_product_of_the_activations_output(kernel, fk_settings):
    """``act(a) @ b`` with the activation applied as A's tiles load, rounded to A's dtype as an
    eager ``act(a)`` is stored: row-major ``a`` (the down-projection) and column-major (the
    weight gradient's ``pre^T``), odd sizes (masked loads give act(0) = 0)."""
    fk_settings(matmul_kernel=kernel)
    for dtype in (torch.float32, torch.bfloat16):
        pre, b = rand((70, 48), dtype, DEVICE), rand((48, 40), dtype, DEVICE)
        for a in (pre, rand((48, 70), dtype, DEVICE).t()):
            for activation in mm.ACTIVATION_NAMES:
                got = mm.forward(a, b, None, None, False, prologue=activation)[0]
                h = mm.torch_activation(a.float(), activation).to(dtype)  # eager's stored h
                ref = h.double().cpu() @ b.double().cpu()
                assert_rel_err(got, ref, 1e-2 if dtype == torch.bfloat16 else matmul_rel_err(torch.float32))


def test_module_loads_a_gpt2_mlp_and_matches_it():
    """transformers' ``GPT2MLP`` (``Conv1D`` weights stored (in, out)) loads into ``nn.MLP``
    with its weights transposed, and the two agree, forward and backward."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(4)
    config = transformers.GPT2Config(n_embd=12, n_inner=20, activation_function="gelu_new", resid_pdrop=0.0)
    stock = GPT2MLP(20, config).to(DEVICE)
    fused = fusedkit.nn.MLP(12, 20, activation="gelu", approximate="tanh", device=DEVICE)
    fused.load_state_dict(stock.state_dict())
    _assert_same_step(stock, fused, 12)
    torch.testing.assert_close(fused.fc1.weight.grad, stock.c_fc.weight.grad.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation,approximate", [("gelu", "tanh"), ("relu", "none"), ("silu", "none")])
def test_module_with_a_hooked_projection_runs_its_layers_and_their_hooks(activation, approximate):
    # (as SwiGLU: a hook on fc1 or fc2, a global one, or a layer put in fc2's place sees its call)
    torch.manual_seed(5)
    module = fusedkit.nn.MLP(12, 20, activation=activation, approximate=approximate, device=DEVICE)
    x = rand((7, 12), torch.float32, DEVICE)
    plain = module(x)
    seen = []
    handle = module.fc1.register_forward_hook(lambda m, args, out: seen.append(("fc1", tuple(out.shape))))
    hooked = module(x)
    handle.remove()
    assert seen == [("fc1", (7, 20))]
    torch.testing.assert_close(hooked, plain, rtol=1e-4, atol=1e-4)
    with torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__)):
        module(x)
    assert seen[1:] == ["Linear", "Linear", "MLP"]
    module.fc2 = torch.nn.Sequential(module.fc2)  # (another layer in its place)
    torch.testing.assert_close(module(x), plain, rtol=1e-4, atol=1e-4)


def test_a_repeated_call_takes_its_kept_plan(monkeypatch):
    # The second call of a signature skips the checks (dispatch.MLP_KEPT): the same results and
    # gradients; grad mode, recompute and the autocast dtype are part of the signature, and
    # autocast's casts are made again each call; a call whose tensors the first call changed on
    # the way (a lazily negated view, resolved) is not kept.
    from fusedkit import dispatch

    fusedkit.clear_caches()
    x = rand((3, 2, 24), torch.float32, DEVICE).requires_grad_()
    w1, b1, w2, b2 = (t.requires_grad_() for t in params(torch.float32))
    runs = []
    checks = dispatch._check_tensors
    for _ in range(2):
        y = fusedkit.mlp(x, w1, b1, w2, b2)
        runs.append((y, *torch.autograd.grad(y.square().sum(), (x, w1, b1, w2, b2))))
        monkeypatch.setattr(dispatch, "_check_tensors", lambda *a, **k: pytest.fail("a kept call was checked"))
    monkeypatch.setattr(dispatch, "_check_tensors", checks)
    assert len(dispatch.MLP_KEPT) == 1 and all(torch.equal(a, b) for a, b in zip(*runs))
    for _ in range(2):
        y = fusedkit.mlp(x, w1, b1, w2, b2, recompute=True)
    assert len(dispatch.MLP_KEPT) == 2 and torch.equal(y, runs[0][0])
    with torch.no_grad():
        assert torch.equal(fusedkit.mlp(x, w1, b1, w2, b2), runs[0][0])
    assert len(dispatch.MLP_KEPT) == 3
    device_type = "cuda" if DEVICE.type == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        cast = [fusedkit.mlp(x, w1, b1, w2, b2) for _ in range(2)]
    assert [y.dtype for y in cast] == [torch.bfloat16] * 2 and torch.equal(*cast)
    assert len(dispatch.MLP_KEPT) == 4
    negated = torch.randn(3, 2, 24, dtype=torch.complex64, device=DEVICE).conj().imag
    want = reference(negated.resolve_neg(), w1, b1, w2, b2, "gelu", "none")
    for _ in range(2):
        assert_rel_err(fusedkit.mlp(negated, w1, b1, w2, b2), want, 1e-5)
    assert len(dispatch.MLP_KEPT) == 4
    with pytest.raises(ShapeError):  # (another signature: checked again)
        fusedkit.mlp(x, w1, b1, w2, b2[:-1])
