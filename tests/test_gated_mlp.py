"""fusedkit.gated_mlp: a gated MLP's gate and up projections in one GEMM (the gated epilogue)
against float64 PyTorch.

The grid: each gate (silu, gelu, gelu_tanh) in float32 and bfloat16, with and without
``recompute``, on both paths of the first GEMM (the gated epilogue, and past
``GATED_GEMM_MAX_M`` rows two GEMMs and the gate) (quick: float32, and each gate once);
gradcheck in float64 (quick: silu). The gated GEMM itself runs on both matmul kernels, on more
than one tile row and column and odd sizes, with the gate and up projections kept exactly as
the epilogue sees them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand, slow_unless

import fusedkit
from fusedkit import autograd as fk_autograd
from fusedkit.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from fusedkit.runtime import matmul as mm
from fusedkit.testing import assert_rel_err, matmul_rel_err

GATES = [("silu", "none"), ("gelu", "none"), ("gelu", "tanh")]


@pytest.fixture(autouse=True)
def fixed_matmul_config(fk_settings):
    """The fixed tile, as tests/test_matmul.py runs (tuning every test shape would compile
    hundreds of kernels on a GPU)."""
    fk_settings(autotune=False)


def act_of(activation, approximate):
    return F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate=approximate))


def reference(x, w_gate, w_up, w_down, bias, activation, approximate):
    b_gate, b_up, b_down = bias if bias is not None else (None, None, None)
    gate = act_of(activation, approximate)(F.linear(x, w_gate, b_gate))
    return F.linear(gate * F.linear(x, w_up, b_up), w_down, b_down)


def weights(dtype, inner=24, hidden=40, out=16, biases=(True, True, True)):
    shapes = ((hidden, inner), (hidden, inner), (out, hidden))
    ws = [(rand(s, dtype, DEVICE) * s[1] ** -0.5).requires_grad_() for s in shapes]
    bs = [rand((n,), dtype, DEVICE).requires_grad_() if on else None for n, on in zip((hidden, hidden, out), biases)]
    return ws, tuple(bs)


def _check(x, ws, bias, act, recompute, bound):
    y = fusedkit.gated_mlp(x, *ws, activation=act[0], approximate=act[1], bias=bias, recompute=recompute)
    g = rand(y.shape, y.dtype, DEVICE)
    leaves = [t for t in (x, *ws, *bias) if t is not None]
    grads = torch.autograd.grad(y, leaves, g)
    wide = [t.detach().double().cpu().requires_grad_() for t in leaves]
    it = iter(wide)
    xw, wg, wu, wd = (next(it) for _ in range(4))
    bw = tuple(next(it) if b is not None else None for b in bias)
    y64 = reference(xw, wg, wu, wd, bw, *act)
    refs = torch.autograd.grad(y64, wide, g.double().cpu())
    assert y.dtype == x.dtype and y.shape == y64.shape
    assert_rel_err(y, y64, bound)
    for got, ref, t in zip(grads, refs, leaves):
        assert got.dtype == t.dtype and got.shape == t.shape
        assert_rel_err(got, ref, bound)


@pytest.fixture(params=["one_gemm", "two_gemms"])
def first_gemm(request, monkeypatch):
    """Both paths of the gate and up projections, whatever the row count."""
    monkeypatch.setattr(mm, "GATED_GEMM_MAX_M", 2**62 if request.param == "one_gemm" else -1)
    return request.param


@pytest.mark.parametrize(
    "dtype,act,recompute",
    slow_unless(
        lambda dtype, act, recompute: dtype == torch.float32 and (act == GATES[0] or not recompute),
        [(d, a, r) for d in (torch.float32, torch.bfloat16) for a in GATES for r in (False, True)],
    ),
)
def test_forward_and_gradients_match_torch(dtype, act, recompute, first_gemm):
    # 74 rows and 40 hidden features: more than one tile row and column, the last ones part-filled
    x = rand((2, 37, 24), dtype, DEVICE).requires_grad_()
    ws, bias = weights(dtype)
    bound = 3e-2 if dtype == torch.bfloat16 else matmul_rel_err(torch.float32) * 10
    _check(x, ws, bias, act, recompute, bound)


@pytest.mark.parametrize("act", slow_unless(lambda act: act == GATES[0], [(a,) for a in GATES]))
def test_gradcheck_float64(act):
    x = rand((3, 4), torch.float64, DEVICE).requires_grad_()
    ws, bias = weights(torch.float64, inner=4, hidden=5, out=3)
    for recompute in (False, True):
        assert torch.autograd.gradcheck(
            lambda x, wg, wu, wd, bg, bu, bd: fusedkit.gated_mlp(
                x, wg, wu, wd, activation=act[0], approximate=act[1], bias=(bg, bu, bd), recompute=recompute
            ),
            (x, *ws, *bias),
            eps=1e-6,
            atol=1e-5,
            rtol=1e-4,
        )


def test_one_bias_or_none_and_without_grad(first_gemm):
    x = rand((5, 24), torch.float32, DEVICE).requires_grad_()
    for biases in ((False, False, False), (True, False, False), (False, True, True)):
        ws, bias = weights(torch.float32, biases=biases)
        _check(x, ws, bias, GATES[0], False, matmul_rel_err(torch.float32) * 10)
    ws, bias = weights(torch.float32)
    with torch.no_grad():
        y = fusedkit.gated_mlp(x, *ws, bias=bias)
    assert not y.requires_grad
    wide = [t.detach().double().cpu() for t in (x, *ws)]
    assert_rel_err(y, reference(*wide, tuple(b.double().cpu() for b in bias), "silu", "none"), 1e-4)


def test_saved_tensors_and_recompute(first_gemm):
    """Default: x, the three weights and biases (no copies: for a gradient of the gradient), and
    the gate and up projections, two tensors of the hidden size where eager keeps four (the
    gate, its activation, up and their product); recompute: nothing of the hidden size."""
    x = rand((8, 6), torch.float32, DEVICE).requires_grad_()
    ws, bias = weights(torch.float32, inner=6, hidden=10, out=4)
    inputs = [(8, 6), (10, 6), (10, 6), (4, 10), (10,), (10,), (4,)]
    for recompute, want in [(False, [*inputs, (8, 10), (8, 10)]), (True, inputs)]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            fusedkit.gated_mlp(x, *ws, bias=bias, recompute=recompute)
        assert saved == want, recompute
    eager = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(tuple(t.shape)) or t, lambda t: t):
        reference(x, *ws, bias, "silu", "none")
    assert sum(s == (8, 10) for s in eager) == 4  # eager's four of the hidden size, against two


@pytest.mark.parametrize("kernel", ["pointer", "tma"])
def test_gated_gemm_on_both_kernels_keeps_gate_and_up(kernel, fk_settings, monkeypatch):
    """The gated epilogue of both matmul kernels (the TMA one where the layout allows, as here:
    rows of 16-byte multiples): ``act(gate) * up`` and the two projections it kept, each against
    float64, on 100 x 72 outputs (several tiles of the interpreter's 32, odd edges)."""
    fk_settings(matmul_kernel=kernel)
    fusedkit.clear_caches()  # (a kept TMA launch would skip launch_tma)
    tma_launches = []
    launch_tma = mm.matmul_tma.launch_tma
    monkeypatch.setattr(mm.matmul_tma, "launch_tma", lambda *a, **k: tma_launches.append(1) or launch_tma(*a, **k))
    for dtype in (torch.float32, torch.bfloat16):
        x, wg, wu = (rand(s, dtype, DEVICE) for s in ((100, 48), (72, 48), (72, 48)))
        bg, bu = rand((72,), dtype, DEVICE), rand((72,), dtype, DEVICE)
        for activation in ("silu", "gelu", "gelu_tanh"):
            h, gate, up = fk_autograd.gated_forward(x, wg, wu, bg, bu, activation, True, fused=True)
            xd = x.double().cpu()
            g64 = xd @ wg.double().cpu().t() + bg.double().cpu()
            u64 = xd @ wu.double().cpu().t() + bu.double().cpu()
            bound = 1e-2 if dtype == torch.bfloat16 else matmul_rel_err(torch.float32)
            assert_rel_err(gate, g64, bound)
            assert_rel_err(up, u64, bound)
            assert_rel_err(h, mm.torch_activation(g64, activation) * u64, bound)
            again = fk_autograd.gated_forward(x, wg, wu, bg, bu, activation, False, fused=True)
            assert torch.equal(again[0], h) and again[1] is None and again[2] is None
    assert bool(tma_launches) == (
        kernel == "tma" and (DEVICE.type == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    )


def test_a_stacked_gate_up_weight_is_read_in_place(monkeypatch):
    monkeypatch.setattr(mm, "GATED_GEMM_MAX_M", 64)  # (9 rows: one GEMM, as at decode)
    """vLLM's and Megatron's stacked ``gate_up_proj`` (2H, K): its halves (and its interleaved
    rows) are views with equal strides, passed as they are; the launch reads them, no copy."""
    x = rand((9, 24), torch.float32, DEVICE)
    stacked = rand((80, 24), torch.float32, DEVICE) * 0.2
    wd = rand((16, 40), torch.float32, DEVICE)
    seen = []
    launch = mm.launch_matmul
    monkeypatch.setattr(
        mm, "launch_matmul", lambda a, b, *r, **k: seen.append((b, k["gate"].b2)) or launch(a, b, *r, **k)
    )
    for wg, wu in ((stacked[:40], stacked[40:]), (stacked[0::2], stacked[1::2])):
        y = fusedkit.gated_mlp(x, wg, wu, wd)
        b, b2 = seen.pop()
        assert b.data_ptr() == wg.data_ptr() and b2.data_ptr() == wu.data_ptr()  # the views themselves
        ref = reference(*(t.double().cpu() for t in (x, wg, wu, wd)), None, "silu", "none")
        assert_rel_err(y, ref, matmul_rel_err(torch.float32) * 10)


def test_unequal_weight_layouts_run_the_composition(monkeypatch):
    monkeypatch.setattr(mm, "launch_matmul", lambda *a, **k: pytest.fail("the gated GEMM needs equal strides"))
    x = rand((5, 24), torch.float32, DEVICE)
    wg, wu, wd = (
        rand((40, 24), torch.float32, DEVICE),
        rand((24, 40), torch.float32, DEVICE).t(),
        rand((16, 40), torch.float32, DEVICE),
    )
    y = fusedkit.gated_mlp(x, wg, wu, wd)
    torch.testing.assert_close(y, reference(x, wg, wu, wd, None, "silu", "none"))


def test_empty_and_zero_inner_sizes(first_gemm):
    ws, bias = weights(torch.float32)
    assert fusedkit.gated_mlp(rand((0, 24), torch.float32, DEVICE), *ws, bias=bias).shape == (0, 16)
    x0 = rand((3, 0), torch.float32, DEVICE)
    w0 = [rand(s, torch.float32, DEVICE) for s in ((40, 0), (40, 0), (16, 40))]
    b = tuple(t.detach() for t in bias)
    torch.testing.assert_close(fusedkit.gated_mlp(x0, *w0, bias=b), reference(x0, *w0, b, "silu", "none"))


def test_autocast_follows_f_linear():
    if DEVICE.type == "cpu":
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    x = rand((6, 24), torch.float32, DEVICE)
    ws, _ = weights(torch.float32)
    with autocast:
        y = fusedkit.gated_mlp(x, *ws)
        ref = reference(x, *ws, None, "silu", "none")
    assert y.dtype == ref.dtype == torch.bfloat16
    assert_rel_err(y, ref.double(), 3e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CPU autocast has no view op: a weight casts each call")
def test_autocast_casts_a_weight_once_a_region_as_f_linear_does():
    # A decode loop runs every token's MLP under one autocast region: the weights' casts come
    # from autocast's cache where it keeps one (made once, dropped when the region ends), as
    # F.linear's do; under inference_mode PyTorch may keep none, and then neither do we.
    from fusedkit import dispatch

    x = rand((2, 24), torch.float32, DEVICE)
    w = torch.nn.Parameter(rand((40, 24), torch.float32, DEVICE))
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        first, again = (dispatch.autocast(x, w)[1] for _ in range(2))
        assert first.dtype == torch.bfloat16 and first.data_ptr() == again.data_ptr()
        assert dispatch.autocast(x, w.detach())[1].data_ptr() != first.data_ptr()  # (autocast caches weights only)
        # fusedkit.nn and fuse pass the transpose: the leaf's cached cast, transposed
        first_t, again_t = (dispatch.autocast(x, w.t())[1] for _ in range(2))
        assert first_t.data_ptr() == again_t.data_ptr() == first.data_ptr() and first_t.shape == (24, 40)
        assert torch.equal(first_t, w.t().to(torch.bfloat16))
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.inference_mode():
        first, again = (dispatch.autocast(x, w)[1] for _ in range(2))
        assert (first.data_ptr() == again.data_ptr()) == dispatch._autocast_caches_in_inference_mode("cuda")
    w_down = torch.nn.Parameter(rand((16, 40), torch.float32, DEVICE))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fusedkit.gated_mlp(x, w, w, w_down)  # (one weight as gate and up: one cast, shared)
        ref = reference(x, w, w, w_down, None, "silu", "none")
    got, want = (torch.autograd.grad(out.float().square().sum(), (w, w_down)) for out in (y, ref))
    for g, r in zip(got, want):  # (through the cached cast, into the float32 weights)
        assert g.dtype == torch.float32
        assert_rel_err(g, r.double(), 3e-2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, ref = fusedkit.matmul(x, w.t(), None, "gelu"), F.gelu(F.linear(x, w))
    got, want = (torch.autograd.grad(out.float().square().sum(), w) for out in (y, ref))
    assert got[0].dtype == torch.float32 and got[0].shape == w.shape  # (through the transposed cached cast)
    assert_rel_err(got[0], want[0].double(), 3e-2)


def test_only_a_leafs_exact_transpose_takes_its_cached_cast():
    # (w.t() casts as w's cached cast transposed; any other view casts as itself)
    from fusedkit import dispatch

    w = torch.nn.Parameter(torch.randn(5, 3))
    assert dispatch._transposed_leaf(w.t()) is w
    for other in (w, w[:, :2].t(), w[1:].t(), w.t().t(), w.t().contiguous(), w.view(3, 5), w.detach().t()):
        assert dispatch._transposed_leaf(other) is None
    # a leaf view's gradient is its own, wherever it came from
    assert dispatch._transposed_leaf(torch.randn(5, 3).t().requires_grad_()) is None
    with torch.no_grad():
        own = w.t()
        assert dispatch._transposed_leaf(own) is w  # (no graph: generate() casts w.t() as w there)
    assert dispatch._transposed_leaf(own.requires_grad_()) is None
    # the view's own hooks and .grad, and a view of the data w had before w.data was replaced
    hooked, kept, stale = w.t(), w.t(), w.t()
    hooked.register_hook(lambda g: g)
    kept.retain_grad()
    assert dispatch._transposed_leaf(hooked) is dispatch._transposed_leaf(kept) is None
    assert dispatch._transposed_leaf(stale) is w
    w.data = torch.randn(5, 3)
    assert dispatch._transposed_leaf(stale) is None


def test_a_cast_without_grad_history_keeps_no_plan_without_autograd(monkeypatch):
    # Where autocast hands a grad-mode call the cast it cached under no_grad (pytorch#158232),
    # that call gets no gradient, as F.linear's does; its kept plan must not take autograd
    # away from later regions, whose casts have it again.
    from fusedkit import dispatch

    cache = {}  # (one region's cache, as autocast kept it: the first cast of a weight, whatever grad mode)

    def stale_cast(t, dtype):
        if t.requires_grad and t.is_leaf:
            return cache.setdefault(id(t), t.to(dtype))
        return t.to(dtype)

    monkeypatch.setattr(dispatch, "_cast", stale_cast)
    fusedkit.clear_caches()
    x = rand((3, 16), torch.float32, DEVICE)
    ws = [torch.nn.Parameter(rand(s, torch.float32, DEVICE)) for s in ((24, 16), (24, 16), (16, 24))]
    device_type = "cuda" if DEVICE.type == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        with torch.no_grad():
            fusedkit.gated_mlp(x, *ws)
        assert not fusedkit.gated_mlp(x, *ws).requires_grad  # (the stale casts: none, as F.linear's)
    cache.clear()  # (the region ended)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        y = fusedkit.gated_mlp(x, *ws)
    assert all(g.abs().sum() > 0 for g in torch.autograd.grad(y.float().sum(), ws))


def test_bad_input_is_refused_before_launch(monkeypatch):
    monkeypatch.setattr(mm, "launch_matmul", lambda *a, **k: pytest.fail("launched on bad input"))
    x = rand((4, 6), torch.float32, DEVICE)
    (wg, wu, wd), (bg, bu, bd) = ([t.detach() for t in group] for group in weights(torch.float32, 6, 10, 4))
    cases = [
        ((x, wg, wu, wd), {"activation": "relu"}, ArgumentError, "choose activation"),
        ((x, wg, wu, wd), {"activation": "silu", "approximate": "tanh"}, ArgumentError, "choose activation"),
        ((x, wg, wu, wd), {"bias": (bg, bu)}, ArgumentError, "bias must be None or"),
        ((x, wg, wu, wd), {"bias": (bg, "bu", bd)}, DTypeError, "b_up must be a Tensor or None"),
        ((x, wg, wu, wd), {"bias": (bg[:9], bu, bd)}, ShapeError, r"b_gate must have shape \(10,\)"),
        ((x[:, :5], wg, wu, wd), {}, ShapeError, "in_features"),
        ((x, wg, wu[:9], wd), {}, ShapeError, "w_gate's shape"),
        ((x, wg, wu, wd[:, :9]), {}, ShapeError, "hidden features"),
        ((x, wg[0], wu, wd), {}, ShapeError, "2-D"),
        ((x, wg, wu.double(), wd), {}, DTypeError, "share a dtype"),
        ((x, "wg", wu, wd), {}, DTypeError, "w_gate must be a Tensor"),
        ((x, wg, wu, wd.to("meta")), {}, DeviceError, "w_down is on meta"),
        ((x.int(), wg.int(), wu.int(), wd.int()), {}, DTypeError, "not supported"),
    ]
    for args, kw, error, words in cases:
        with pytest.raises(error, match=words):
            fusedkit.gated_mlp(*args, **kw)


def test_one_sided_and_unlike_biases_are_read_as_given(first_gemm):
    """A bias given for one projection only, strided or expanded, or two biases of different
    strides: the epilogue reads both with one stride, so they are made alike first (found by a
    review: a strided one-sided bias read past its end)."""
    x = rand((8, 24), torch.float32, DEVICE).requires_grad_()
    ws, _ = weights(torch.float32)
    wide = rand((80,), torch.float32, DEVICE)
    for bias in (
        (None, wide[::2], None),
        (wide[::2], None, None),
        (None, rand((1,), torch.float32, DEVICE).expand(40), None),
        (wide[::2], wide[:40], None),
    ):
        y = fusedkit.gated_mlp(x, *ws, bias=bias)
        ref = reference(
            *(t.detach().double().cpu() for t in (x, *ws)),
            tuple(None if b is None else b.double().cpu() for b in bias),
            "silu",
            "none",
        )
        assert_rel_err(y, ref, matmul_rel_err(torch.float32) * 10)


def test_lazily_negated_weights_of_unlike_strides_are_read_as_given(first_gemm):
    """Strides compared after lazily negated views resolve (a review found the kernel reading a
    resolved, contiguous ``w_gate`` with the strides of a sliced ``w_up``)."""
    x = rand((8, 24), torch.float32, DEVICE)
    big_g, big_u = rand((40, 48), torch.float32, DEVICE) * 0.2, rand((40, 48), torch.float32, DEVICE) * 0.2
    wg, wu = big_g[:, :24], big_u[:, :24]  # both (48, 1)
    wd = rand((16, 40), torch.float32, DEVICE) * 0.2
    for g, u in ((torch._neg_view(wg), wu), (wg, torch._neg_view(wu))):
        y = fusedkit.gated_mlp(x, g, u, wd)
        ref = reference(*(t.double().cpu() for t in (x, g.resolve_neg(), u.resolve_neg(), wd)), None, "silu", "none")
        assert_rel_err(y, ref, matmul_rel_err(torch.float32) * 10)


def test_gated_mlp_and_swiglu_compile_whole():
    # Under torch.compile the composition is traced (no graph break): Inductor fuses the gate.
    torch._dynamo.reset()
    x = rand((6, 16), torch.float32, DEVICE)
    w_gate, w_up, w_down = (rand(s, torch.float32, DEVICE) / 4 for s in ((24, 16), (24, 16), (16, 24)))
    fn = torch.compile(
        lambda x: fusedkit.gated_mlp(x, w_gate, w_up, w_down, activation="gelu", approximate="tanh"),
        backend="eager",
        fullgraph=True,
    )
    want = reference(x.double(), w_gate.double(), w_up.double(), w_down.double(), None, "gelu", "tanh")
    assert_rel_err(fn(x), want, 1e-5)
    module = fusedkit.nn.SwiGLU(16, 24, device=DEVICE)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-6)


def test_a_repeated_call_takes_its_kept_plan(monkeypatch):
    # The second call of a signature skips the checks (dispatch.GATED_KEPT): the same results
    # and gradients; calls whose tensors the first call had to change on the way (a one-sided
    # bias made alike) are not kept, autocast's casts are made again, and grad mode and the
    # autocast dtype are part of the signature.
    from fusedkit import dispatch

    fusedkit.clear_caches()
    x = rand((3, 16), torch.float32, DEVICE).requires_grad_()
    w_gate, w_up, w_down = (rand(s, torch.float32, DEVICE).requires_grad_() for s in ((24, 16), (24, 16), (16, 24)))
    runs = []
    for _ in range(2):
        y = fusedkit.gated_mlp(x, w_gate, w_up, w_down)
        runs.append((y, *torch.autograd.grad(y.square().sum(), (x, w_gate, w_up, w_down))))
    assert len(dispatch.GATED_KEPT) == 1 and all(torch.equal(a, b) for a, b in zip(*runs))
    with torch.no_grad():
        assert torch.equal(fusedkit.gated_mlp(x, w_gate, w_up, w_down), runs[0][0])
    assert len(dispatch.GATED_KEPT) == 2
    b = rand((24,), torch.float32, DEVICE)
    want = reference(x, w_gate, w_up, w_down, (b, None, None), "silu", "none")
    for _ in range(2):
        assert_rel_err(fusedkit.gated_mlp(x, w_gate, w_up, w_down, bias=(b, None, None)), want, 1e-5)
    device_type = "cuda" if DEVICE.type == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        cast = [fusedkit.gated_mlp(x, w_gate, w_up, w_down) for _ in range(2)]
    assert [y.dtype for y in cast] == [torch.bfloat16] * 2 and torch.equal(*cast)
    assert len(dispatch.GATED_KEPT) == 3
    # bf16 tensors under bf16 autocast reach the kernels as they are (kept); under float16
    # autocast the same call is another signature, cast as F.linear would cast it
    half = [t.detach().bfloat16() for t in (x, w_gate, w_up, w_down)]
    with torch.autocast(device_type, dtype=torch.bfloat16):
        for _ in range(2):
            assert fusedkit.gated_mlp(*half).dtype == torch.bfloat16
    assert len(dispatch.GATED_KEPT) == 4
    seen, forward = [], fk_autograd.gated_forward
    monkeypatch.setattr(fk_autograd, "gated_forward", lambda x2, *a: seen.append(x2.dtype) or forward(x2, *a))
    with torch.autocast(device_type, dtype=torch.float16):
        assert fusedkit.gated_mlp(*half).dtype == torch.float16
    assert seen == [torch.float16]
    with pytest.raises(ShapeError):  # (another signature: checked again)
        fusedkit.gated_mlp(x[:, :8], w_gate, w_up, w_down)


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_a_gradient_of_the_gradient_is_the_compositions(recompute):
    # Under create_graph the backward differentiates PyTorch's composition on the kept inputs
    # (as eager's modules allowed: nn.SwiGLU ran them before it ran gated_mlp).
    x = rand((5, 16), torch.float32, DEVICE).requires_grad_()
    shapes = ((24, 16), (24, 16), (16, 24), (24,), (24,), (16,))
    params = [rand(s, torch.float32, DEVICE).requires_grad_() for s in shapes]
    w_gate, w_up, w_down, *bias = params

    def second(x, w_gate, w_up, w_down, *bias, fn):
        y = fn(x, w_gate, w_up, w_down, tuple(bias))
        (dw,) = torch.autograd.grad(y.square().sum(), (w_gate,), create_graph=True)
        return torch.autograd.grad(dw.square().sum(), (x, w_up, *bias))

    got = second(x, *params, fn=lambda *a: fusedkit.gated_mlp(*a[:4], bias=a[4], recompute=recompute))
    ref = [t.detach().double().requires_grad_() for t in (x, *params)]
    want = second(*ref, fn=lambda x, wg, wu, wd, b: reference(x, wg, wu, wd, b, "silu", "none"))
    for g, w in zip(got, want):
        assert_rel_err(g, w, 1e-4)


def test_a_kept_plan_answers_only_the_argument_types_the_checks_take():
    np = pytest.importorskip("numpy")
    x, w_gate, w_up, w_down = (rand(s, torch.float32, DEVICE) for s in ((2, 8), (12, 8), (12, 8), (8, 12)))
    fusedkit.gated_mlp(x, w_gate, w_up, w_down, activation="silu")
    with pytest.raises(ArgumentError):
        fusedkit.gated_mlp(x, w_gate, w_up, w_down, activation=np.str_("silu"))


def test_a_transposed_weights_cached_cast_carries_its_gradient_to_the_leaf(monkeypatch):
    # (the CUDA path on the CPU: a stand-in for autocast's cached cast, a differentiable cast)
    from fusedkit import dispatch

    monkeypatch.setattr(dispatch, "CACHED_CAST_DEVICES", ("cpu",))
    handed = []
    monkeypatch.setattr(dispatch, "_einsum", lambda eq, ts: handed.append(ts[0]) or ts[0].to(torch.bfloat16))
    w = torch.nn.Parameter(torch.randn(5, 3))
    cast = dispatch._cast(w.t(), torch.bfloat16)
    assert len(handed) == 1 and handed[0] is w  # (the leaf, whose cast autocast caches: not the view)
    with torch.no_grad():
        dispatch._cast(w.t(), torch.bfloat16)
    assert handed[-1] is w
    assert cast.dtype == torch.bfloat16 and cast.shape == (3, 5) and torch.equal(cast, w.t().to(torch.bfloat16))
    (grad,) = torch.autograd.grad(cast.float().square().sum(), w)
    torch.testing.assert_close(grad, 2 * w.detach().to(torch.bfloat16).float(), rtol=0, atol=0)
    own = torch.randn(5, 3).t().requires_grad_()  # (a leaf view: its gradient is its own)
    (grad,) = torch.autograd.grad(dispatch._cast(own, torch.bfloat16).float().sum(), own)
    assert grad.shape == own.shape and handed[-1] is own
