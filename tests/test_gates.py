"""The gates and bias + GELU: silu_mul, gelu_mul, add_gelu, their fused backward and nn.SwiGLU.

The registry-driven suites (test_elementwise, test_autograd_compile) check each entry's
forward against float64 and its gradients against torch's; this module checks what is
particular to these ops: the public signatures, what autograd keeps, that the backward is
one launch, transforms and compile, and the module.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import DEVICE
from helpers import one_at_a_time, rand, slow_unless, value_id, views

import fusedkit
from fusedkit import library
from fusedkit.kernels import activations
from fusedkit.registry import ElementwiseKernel
from fusedkit.runtime import elementwise as ew
from fusedkit.testing import assert_matches_reference

F64 = torch.float64


def leaf(shape, dtype=F64):
    return rand(shape, dtype, DEVICE).requires_grad_()


GATES = [
    (lambda a, b: fusedkit.silu_mul(a, b), lambda a, b: F.silu(a) * b),
    (lambda a, b: fusedkit.gelu_mul(a, b), lambda a, b: F.gelu(a) * b),
    (lambda a, b: fusedkit.gelu_mul(a, b, approximate="tanh"), lambda a, b: F.gelu(a, approximate="tanh") * b),
    (lambda a, b: fusedkit.add_gelu(a, b, alpha=-0.5), lambda a, b: F.gelu(torch.add(a, b, alpha=-0.5))),
    (lambda a, b: fusedkit.add_gelu(a, b, approximate="tanh"), lambda a, b: F.gelu(a + b, approximate="tanh")),
]
GATE_IDS = ["silu_mul", "gelu_mul", "gelu_mul_tanh", "add_gelu_alpha", "add_gelu_tanh"]


@pytest.mark.parametrize("fused,plain", GATES, ids=GATE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded_row", "col_strided"])
def test_public_ops_forward_and_backward_match_torch(fused, plain, layout):
    a = views((23, 17), F64, DEVICE)[layout] if layout != "contiguous" else rand((23, 17), F64, DEVICE)
    a = a.detach().requires_grad_()  # a view as the leaf: its gradient has its shape
    b = leaf((17,))  # broadcast: its gradient is summed over the rows
    g = rand((23, 17), F64, DEVICE)
    out = fused(a, b)
    assert_matches_reference(out, plain(a.detach().cpu(), b.detach().cpu()))
    ours = torch.autograd.grad(out, (a, b), g)
    theirs = torch.autograd.grad(plain(a, b), (a, b), g)
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused,plain", GATES, ids=GATE_IDS)
def test_half_types_compute_in_float32_and_round_once(fused, plain, dtype):
    a, b = rand((31, 9), dtype, DEVICE), rand((31, 9), dtype, DEVICE)
    out = fused(a, b)
    assert out.dtype == dtype
    assert_matches_reference(out, plain(a.cpu().double(), b.cpu().double()), dtype)


def test_approximate_is_checked_before_anything_runs():
    a = rand((4,), torch.float32, DEVICE)
    out = torch.full((4,), 7.0, device=DEVICE)
    for call in (
        lambda: fusedkit.gelu_mul(a, a, approximate="erf", out=out),
        lambda: fusedkit.add_gelu(a, a, approximate=None, out=out),
    ):
        with pytest.raises(fusedkit.ArgumentError, match="approximate must be 'none' or 'tanh'") as info:
            call()
        assert isinstance(info.value, ValueError)
    assert torch.equal(out, torch.full((4,), 7.0, device=DEVICE))
    with pytest.raises(fusedkit.DTypeError, match="result dtype"):
        fusedkit.silu_mul(torch.ones(4, dtype=torch.int32, device=DEVICE), 2)  # floating results only


def test_out_and_in_place():
    a, b = rand((6, 5), torch.float32, DEVICE), rand((6, 5), torch.float32, DEVICE)
    expected = F.silu(a.double()) * b.double()
    out = torch.empty(6, 5, dtype=torch.float64, device=DEVICE)  # a dtype the result casts to
    assert fusedkit.silu_mul(a, b, out=out) is out
    assert_matches_reference(out, expected.cpu(), torch.float32)
    assert fusedkit.silu_mul(a, b, out=a) is a  # in place on an input
    assert_matches_reference(a, expected.cpu())


@pytest.mark.parametrize("op", [fusedkit.silu_mul, fusedkit.gelu_mul])
def test_a_gate_keeps_the_inputs_and_no_intermediate(op):
    a, b = leaf((40, 8), torch.float32), leaf((40, 8), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        op(a, b)
    assert sorted(t.data_ptr() for t in saved) == sorted((a.data_ptr(), b.data_ptr()))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_add_gelu_keeps_the_sum_as_torch_does(approximate):
    # F.gelu(x + y) keeps the sum (GeluBackward's self), not x and y: one tensor, whatever
    # changes x and y undergo afterwards. fusedkit writes it beside the result in one launch.
    x, bias = leaf((40, 8), torch.float32), leaf((8,), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fusedkit.add_gelu(x, bias, approximate=approximate)
    assert len(saved) == 1 and saved[0].shape == out.shape
    assert saved[0].data_ptr() not in (x.data_ptr(), bias.data_ptr(), out.data_ptr())
    assert torch.equal(saved[0].cpu(), (x + bias).detach().cpu())


def _launches(monkeypatch):
    calls = []
    real = ew.launch_elementwise

    def counted(kernel, *args, **kwargs):
        calls.append(kernel.name)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(ew, "launch_elementwise", counted)
    return calls


@pytest.mark.parametrize(
    "op,alpha,expected",
    [
        (fusedkit.silu_mul, None, ["silu_mul_grad"]),
        (fusedkit.gelu_mul, None, ["gelu_mul_grad"]),
        (fusedkit.add_gelu, 1, ["gelu_grad"]),  # from the kept sum
        (fusedkit.add_gelu, 2.0, ["gelu_grad", "add"]),  # d/dy = alpha * d/dx
    ],
)
def test_backward_is_one_fused_launch(monkeypatch, op, alpha, expected):
    if fusedkit.backend_for(DEVICE) == "torch":
        pytest.skip("the PyTorch path launches no kernel")
    a, b = leaf((16, 8), torch.float32), leaf((16, 8), torch.float32)
    out = op(a, b) if alpha is None else op(a, b, alpha=alpha)
    fusedkit.clear_caches()  # every launch takes launch_elementwise (none kept)
    calls = _launches(monkeypatch)
    ga, gb = torch.autograd.grad(out, (a, b), torch.ones_like(out))
    assert calls == expected
    if alpha == 1:
        assert ga is gb or torch.equal(ga, gb)


def test_two_output_kernels_stay_out_of_the_registry():
    assert "silu_mul_grad" not in fusedkit.registry.names()
    pair = ElementwiseKernel(
        name="pair",
        math=activations.silu_mul_grad_math,
        reference=lambda g, a, b: (g, g),
        arg_names=("g", "a", "b"),
        param=None,
        outputs=2,
        formula="pair",
        unfused=("x",),
    )
    with pytest.raises(fusedkit.ArgumentError, match="2 outputs"):
        fusedkit.registry.register(pair)
    with pytest.raises(fusedkit.ArgumentError, match="outputs must be 1 or 2"):
        ElementwiseKernel(
            name="three",
            math=activations.silu_mul_grad_math,
            reference=lambda g, a, b: g,
            arg_names=("g", "a", "b"),
            param=None,
            outputs=3,
            formula="three",
            unfused=("x",),
        )
    with pytest.raises(fusedkit.ArgumentError, match="two-output"):
        ew.run_pair(library.SILU_MUL, (rand((3,), torch.float32, DEVICE),) * 2, None)


# For the layouts and the numbers in place of tensors; quick: each kernel, layout and dtype
# once (silu_mul_grad, transposed, float32 the representatives).
@pytest.mark.parametrize(
    "dtype,layout,kernel",
    one_at_a_time(
        [
            (d, layout, k)
            for k in (library.SILU_MUL_GRAD, library.GELU_MUL_GRAD, library.GELU_TANH_MUL_GRAD)
            for layout in ("transposed", "expanded_col", "offset")
            for d in (torch.bfloat16, torch.float32, F64)
        ],
        ("float32", "transposed", "silu_mul_grad"),
    ),
)
def test_run_pair_reads_strided_inputs_and_numbers(kernel, layout, dtype):
    grad = rand((23, 17), dtype, DEVICE)
    a = views((23, 17), dtype, DEVICE)[layout]
    for operands in ((grad, a, 1.5), (grad, a, a.t().t()), (grad, -0.75, a)):
        da, db = ew.run_pair(kernel, operands, None)
        assert da.shape == db.shape == (23, 17) and da.stride() == db.stride() and da.dtype == dtype
        wide = tuple(v.double().cpu() if isinstance(v, torch.Tensor) else v for v in operands)
        ref_da, ref_db = kernel.reference(*wide)
        assert_matches_reference(da, ref_da)
        assert_matches_reference(db, ref_db)


@pytest.mark.slow  # float64 gradcheck and gradgradcheck in the interpreter
@pytest.mark.parametrize(
    "op",
    [
        fusedkit.silu_mul,
        lambda a, b: fusedkit.gelu_mul(a, b, approximate="tanh"),
        lambda a, b: fusedkit.add_gelu(a, b, alpha=0.5),
    ],
    ids=["silu", "gelu_tanh", "add"],
)
def test_second_derivatives(op):
    a, b = leaf((4, 3)), leaf((3,))
    assert torch.autograd.gradcheck(op, (a, b))
    assert torch.autograd.gradgradcheck(op, (a, b))


def test_torch_func_transforms():
    from torch.func import grad, vmap

    x, y = rand((5, 3), F64, DEVICE), rand((5, 3), F64, DEVICE)
    for fused, plain in GATES:
        torch.testing.assert_close(vmap(fused)(x, y), vmap(plain)(x, y))
        for f, p in ((fused, plain),):  # (bound per pair: the lambdas below run now)
            torch.testing.assert_close(grad(lambda a, f=f: f(a, y).sum())(x), grad(lambda a, p=p: p(a, y).sum())(x))
            torch.testing.assert_close(
                vmap(grad(lambda a, b, f=f: f(a, b).sum()))(x, y), vmap(grad(lambda a, b, p=p: p(a, b).sum()))(x, y)
            )


@pytest.mark.slow  # torch.compile
def test_compile_fullgraph_forward_and_backward():
    def f(a, b, c):
        return fusedkit.add_gelu(fusedkit.silu_mul(a, b), c, approximate="tanh").sum()

    a, b, c = leaf((8, 6), torch.float32), leaf((8, 6), torch.float32), leaf((6,), torch.float32)
    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(a, b, c), (a, b, c))
    expected = torch.autograd.grad(F.gelu(F.silu(a) * b + c, approximate="tanh").sum(), (a, b, c))
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# --- nn.SwiGLU ------------------------------------------------------------------------------


class _LlamaStyleMLP(torch.nn.Module):
    """The LLaMA MLP as people write it: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, d, h):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, h, bias=False)
        self.up_proj = torch.nn.Linear(d, h, bias=False)
        self.down_proj = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_swiglu_loads_a_llama_mlp_and_trains_to_the_same_loss():
    torch.manual_seed(0)
    ref = _LlamaStyleMLP(12, 20).to(DEVICE)
    ours = fusedkit.nn.SwiGLU(12, 20, device=DEVICE)
    assert ours.load_state_dict(ref.state_dict()).missing_keys == []
    assert set(ours.state_dict()) == {"gate.weight", "up.weight", "down.weight"}
    x, target = rand((7, 5, 12), torch.float32, DEVICE), rand((7, 5, 12), torch.float32, DEVICE)
    losses = []
    for model in (ref, ours):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        run = []
        for _ in range(4):
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)


def test_swiglu_loads_transformers_llama_mlp():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=24, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4
    )
    from transformers.models.llama.modeling_llama import LlamaMLP

    ref = LlamaMLP(config).to(DEVICE)
    ours = fusedkit.nn.SwiGLU(16, 24, device=DEVICE)
    ours.load_state_dict(ref.state_dict())
    x = rand((3, 16), torch.float32, DEVICE)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_swiglu_loads_a_stacked_gate_up_proj():
    """transformers' ``Phi3MLP`` (vLLM likewise) stacks the gate's and up projection's rows in one
    ``gate_up_proj``, the gate's first: split as it loads, the same outputs."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    config = transformers.Phi3Config(hidden_size=16, intermediate_size=24, hidden_act="silu")
    ref = Phi3MLP(config).to(DEVICE)
    ours = fusedkit.nn.SwiGLU(16, 24, device=DEVICE)
    assert ours.load_state_dict(ref.state_dict()).missing_keys == []
    x = rand((3, 16), torch.float32, DEVICE)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    # its own keys beside a stacked one: the stacked key is left, and a strict load names it
    state = {**ours.state_dict(), "gate_up_proj.weight": torch.zeros(48, 16, device=DEVICE)}
    with pytest.raises(RuntimeError, match="gate_up_proj.weight"):
        ours.load_state_dict(state, strict=True)


def _saved_shapes(fn):
    """The shapes of the tensors autograd saves while ``fn()`` runs forward."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


@pytest.mark.parametrize("recompute", [False, True], ids=["default", "recompute"])
def test_swiglu_keeps_the_gated_mlps_tensors(recompute):
    # One gated_mlp call: x, gate and up kept (recompute: x), where the three modules and the
    # gate kernel would keep x twice, gate, up and h.
    m = fusedkit.nn.SwiGLU(8, 12, recompute=recompute, device=DEVICE)
    x = rand((5, 8), torch.float32, DEVICE).requires_grad_()
    y, shapes = _saved_shapes(lambda: m(x))
    hidden = [s for s in shapes if s == (5, 12)]
    assert len(hidden) == (0 if recompute else 2), shapes
    assert "recompute=" + str(recompute) in repr(m)
    want = F.linear(F.silu(F.linear(x, m.gate.weight)) * F.linear(x, m.up.weight), m.down.weight)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(y.square().sum(), (x, m.gate.weight, m.up.weight, m.down.weight))
    ref = torch.autograd.grad(want.square().sum(), (x, m.gate.weight, m.up.weight, m.down.weight))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_swiglu_calls_its_layers_as_modules_where_a_hook_would_see_them():
    m = fusedkit.nn.SwiGLU(8, 12, bias=True, device=DEVICE)
    x = rand((3, 8), torch.float32, DEVICE)
    plain = m(x)
    seen = []
    handle = m.up.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    torch.testing.assert_close(m(x), plain, rtol=1e-5, atol=1e-6)
    assert seen == [(3, 12)]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(type(mod)))
    try:
        m(x)
    finally:
        handle.remove()
    assert seen.count(torch.nn.Linear) == 3
    # a layer put in a projection's place (an adapter's) runs as itself
    m.down = torch.nn.Sequential(m.down, torch.nn.Identity())
    torch.testing.assert_close(m(x), plain, rtol=1e-5, atol=1e-6)
    # a parametrization applies on either path
    m = fusedkit.nn.SwiGLU(8, 12, device=DEVICE)
    plain = m(x)
    torch.nn.utils.parametrize.register_parametrization(m.gate, "weight", _Double())
    with torch.no_grad():
        doubled = F.linear(
            F.silu(F.linear(x, 2 * m.gate.parametrizations.weight.original)) * F.linear(x, m.up.weight), m.down.weight
        )
    torch.testing.assert_close(m(x), doubled, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m(x), plain)


def test_swiglu_runs_a_layer_that_is_not_linears_own_forward():
    # A forward set on the instance (an offloading or adapter wrapper), or a parametrized
    # subclass with its own forward: the layer runs as itself.
    x = rand((3, 8), torch.float32, DEVICE)
    m = fusedkit.nn.SwiGLU(8, 12, device=DEVICE)
    forward = m.up.forward
    m.up.forward = lambda t: 0 * forward(t)
    assert torch.equal(m(x), torch.zeros(3, 8, device=DEVICE))

    class Silenced(torch.nn.Linear):
        def forward(self, t):
            return 0 * super().forward(t)

    m = fusedkit.nn.SwiGLU(8, 12, device=DEVICE)
    m.up = Silenced(8, 12, device=DEVICE)
    torch.nn.utils.parametrize.register_parametrization(m.up, "weight", _Double())
    assert torch.equal(m(x), torch.zeros(3, 8, device=DEVICE))


class _Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_is_the_gelu_gated_mlp(approximate):
    m = fusedkit.nn.GeGLU(8, 12, bias=True, approximate=approximate, device=DEVICE)
    x = rand((2, 3, 8), torch.float32, DEVICE)
    gate = F.gelu(F.linear(x, m.gate.weight, m.gate.bias), approximate=approximate)
    want = F.linear(gate * F.linear(x, m.up.weight, m.up.bias), m.down.weight, m.down.bias)
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    m.gate.register_forward_pre_hook(lambda mod, args: None)  # (the module path: gelu_mul)
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)
    assert f"approximate={approximate!r}" in repr(m)
    with pytest.raises(fusedkit.ArgumentError, match="approximate"):
        fusedkit.nn.GeGLU(8, 12, approximate="erf")


def test_geglu_loads_transformers_gemma_mlp():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = transformers.GemmaConfig(hidden_size=16, intermediate_size=24, hidden_act="gelu_pytorch_tanh")
    ref = GemmaMLP(config).to(DEVICE)
    ours = fusedkit.nn.GeGLU(16, 24, approximate="tanh", device=DEVICE)
    assert ours.load_state_dict(ref.state_dict()).missing_keys == []
    x = rand((3, 16), torch.float32, DEVICE)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_swiglu_takes_what_linear_takes_and_follows_autocast():
    m = fusedkit.nn.SwiGLU(8, 6, bias=True, device=DEVICE)
    assert m(rand((8,), torch.float32, DEVICE)).shape == (8,)
    assert m(rand((0, 8), torch.float32, DEVICE)).shape == (0, 8)
    assert "hidden_features=6, bias=True" in repr(m)
    device_type = "cuda" if DEVICE.type == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        y = m(rand((4, 8), torch.float32, DEVICE))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert m.gate.weight.grad.dtype == torch.float32


_GRAD_DTYPE_OPS = GATES + [(fusedkit.add_relu, lambda x, y: torch.relu(x + y))]
_GRAD_DTYPE_IDS = GATE_IDS + ["add_relu"]


# For the grad_dtype settings; quick: each op with the default, and each setting with silu_mul.
@pytest.mark.parametrize(
    "grad_dtype,fused,plain",
    slow_unless(
        lambda grad_dtype, fused, plain: grad_dtype == "default" or fused is GATES[0][0],
        [(g, *op) for g in ("default", None, torch.float32) for op in _GRAD_DTYPE_OPS],
        ids=[f"{value_id(g)}-{name}" for g in ("default", None, torch.float32) for name in _GRAD_DTYPE_IDS],
    ),
)
def test_gradient_dtype_is_autograds(fused, plain, grad_dtype):
    """A promoted operand's gradient takes the dtype torch's own ops give it: the operand's,
    or the ``grad_dtype`` its leaf asks for (None: the result's), on every path a repeated
    call takes (validated, kept, and on a GPU the C++ node's planned backward)."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("Tensor.grad_dtype is new in torch 2.10")
    a = leaf((5, 7), torch.float32)
    grad = rand((5, 7), torch.float32, DEVICE)
    for _ in range(3):
        got, want = leaf((7,), torch.float16), leaf((7,), torch.float16)
        if grad_dtype != "default":
            got.grad_dtype = want.grad_dtype = grad_dtype
        fused(a.detach().requires_grad_(), got).backward(grad)
        plain(a.detach().requires_grad_(), want).backward(grad)
        assert got.grad.dtype == want.grad.dtype and got.grad.shape == want.grad.shape


@pytest.mark.parametrize("op", [fusedkit.add, fusedkit.add_gelu])
def test_scaled_gradient_keeps_the_sign_of_zero(op):
    # d/dy = alpha * grad, as torch's AddBackward: a -0.0 product stays -0.0.
    x, y = torch.tensor([0.0, 1.0], device=DEVICE, requires_grad=True), leaf((2,), torch.float32)
    g = torch.tensor([-0.0, 0.0], device=DEVICE)
    plain = (
        (lambda a, b: torch.add(a, b, alpha=2.0))
        if op is fusedkit.add
        else (lambda a, b: F.gelu(torch.add(a, b, alpha=2.0)))
    )
    ours = torch.autograd.grad(op(x, y, alpha=2.0), (x, y), g)[1]
    theirs = torch.autograd.grad(plain(x, y), (x, y), g)[1]
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs)) and torch.equal(ours, theirs)


def test_a_two_output_kernel_is_refused_where_one_result_is_expected():
    t = rand((4,), torch.float32, DEVICE)
    out = torch.full((4,), 7.0, device=DEVICE)
    with pytest.raises(fusedkit.ArgumentError, match="run_pair"):
        fusedkit.elementwise(library.SILU_MUL_GRAD, t, t, t, out=out)
    with pytest.raises(fusedkit.ArgumentError, match="run_pair"):
        fusedkit.elementwise(library.SILU_MUL_GRAD, t, t, t)
    assert torch.equal(out, torch.full((4,), 7.0, device=DEVICE))
    with pytest.raises(fusedkit.ArgumentError, match="no backward"):
        ElementwiseKernel(
            name="pair",
            math=activations.silu_mul_grad_math,
            reference=lambda g, a, b: (g, g),
            arg_names=("g", "a", "b"),
            param=None,
            outputs=2,
            formula="pair",
            unfused=("x",),
            saves="inputs",
            backward=lambda g, s, p: (g, g, g),
        )


def test_the_gate_backward_has_a_profiler_range():
    a, b = leaf((8, 4), torch.float32), leaf((8, 4), torch.float32)
    out = fusedkit.silu_mul(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    assert "fusedkit::silu_mul_grad" in {e.name for e in prof.events()}


def test_swiglu_strict_load_does_not_let_a_llama_key_overwrite_its_own():
    m = fusedkit.nn.SwiGLU(4, 6, device=DEVICE)
    state = m.state_dict()
    state["gate_proj.weight"] = torch.zeros(6, 4, device=DEVICE)
    with pytest.raises(RuntimeError, match="gate_proj.weight"):
        m.load_state_dict(state, strict=True)
    assert not torch.equal(m.gate.weight.detach(), torch.zeros(6, 4, device=DEVICE))
    # nested in a parent module, under its prefix
    parent = torch.nn.Sequential(fusedkit.nn.SwiGLU(4, 6, device=DEVICE))
    llama = {f"0.{k}": v for k, v in _LlamaStyleMLP(4, 6).to(DEVICE).state_dict().items()}
    parent.load_state_dict(llama)
    torch.testing.assert_close(parent[0].up.weight, llama["0.up_proj.weight"])


def test_the_pair_op_passes_opcheck():
    from fusedkit.autograd import elementwise_pair_op

    for dtype in (torch.float32, torch.bfloat16, F64):
        g, a, b = (rand(shape, dtype, DEVICE) for shape in ((5, 6), (5, 6), (6,)))
        torch.library.opcheck(elementwise_pair_op, ([g, a, b], "silu_mul_grad", [0, 1, 2], [], 0))
        torch.library.opcheck(elementwise_pair_op, ([g, a], "gelu_tanh_mul_grad", [0, 1], [1.5], 0))
        torch.library.opcheck(elementwise_pair_op, ([a, b], "add_gelu_pre", [0, 1], [], -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_tanh_gelu_gradients_at_extremes_are_torchs(dtype):
    # float64: torch's backward overflows v * v beyond |v| ~ 1.3e154 and gives NaN; float32 is
    # checked against float64, finite over float32's range.
    big = [1e200, -1e200, 2e154, 1e150] if dtype == F64 else [3e38, -3e38, 1e19, -1e19]
    v = torch.tensor(big + [5.1, -5.1, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    a = v.to(DEVICE).requires_grad_()
    (grad_a,) = torch.autograd.grad(fusedkit.gelu_mul(a, 2.0, approximate="tanh").sum(), a)
    wide = v.double().requires_grad_()
    (want,) = torch.autograd.grad((F.gelu(wide, approximate="tanh") * 2.0).sum(), wide)
    assert_matches_reference(grad_a, want)


# quick: the tanh GELU's (its sigmoid form is the SiLU's too)
@pytest.mark.parametrize("name", [pytest.param("silu_grad", marks=pytest.mark.slow), "gelu_tanh_grad"])
def test_float32_derivatives_stay_within_a_few_ulp(name):
    # 1 - sigmoid(v) computed as a difference lost up to 16 ulp of the tanh-GELU derivative where
    # the sigmoid nears 1 (1.9e-6 relative in float32), and the derivative was rounded to 1 where
    # the sigmoid rounds to 1 (up to 1e-6); both derivatives now stay within 4 ulp here, away from
    # the derivative's zero crossing, where relative error is unbounded.
    v = torch.linspace(-12, 12, 200_001, dtype=torch.float32)
    got = fusedkit.elementwise(name, torch.ones_like(v).to(DEVICE), v.to(DEVICE)).double().cpu()
    wide = v.double().requires_grad_()
    act = F.silu(wide) if name == "silu_grad" else F.gelu(wide, approximate="tanh")
    (want,) = torch.autograd.grad(act.sum(), wide)
    keep = want.abs() > 0.2
    assert ((got - want).abs() / want.abs())[keep].max().item() < 4 * torch.finfo(torch.float32).eps


def _exact_gelu(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU and its derivative in float64 from ``erfc``: torch's ``1 + erf`` cancels below
    v = -8 even in float64, where erfc keeps its relative accuracy."""
    w = v.double()
    cdf = 0.5 * torch.special.erfc(-w / math.sqrt(2))
    return w * cdf, cdf + w * torch.exp(-0.5 * w * w) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_erf_gelu_in_16_bit_types_is_within_an_ulp_of_exact_everywhere(dtype):
    # Every finite input: below float64 GELU's erfc is approximated (kernels.activations.ERFC_P);
    # rounded to 16 bits, the results differ from the exactly rounded ones by an ulp at most,
    # in under 1% of inputs (49 of 42172 for bfloat16's forward in the interpreter). Left out:
    # results under 2^-100, in the tail, where the approximation's relative error reaches 0.5%
    # (2 bfloat16 ulp near 1e-36) and float32 flushes below 2^-126; near the derivative's zero,
    # float32's absolute error (a few 1e-8) is allowed.
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    v = v[torch.isfinite(v)].to(DEVICE)
    forward, slope = _exact_gelu(v.cpu())
    for got, want in (
        (fusedkit.gelu_mul(v, torch.ones_like(v)), forward),
        (fusedkit.elementwise("gelu_grad", torch.ones_like(v), v), slope),
    ):
        exact = want.to(dtype)
        keep = want.abs() >= 2.0**-100
        got = got.cpu()
        ulps = (exact.view(torch.int16).int() - got.view(torch.int16).int()).abs()
        close = (ulps <= 1) | ((got.double() - want).abs() <= 1e-7)
        assert close[keep].all(), v.cpu()[keep & ~close][:8].tolist()
        assert (ulps[keep] > 0).float().mean().item() < 0.01


def test_erf_gelu_in_float32_is_accurate_where_torchs_cancels():
    # Away from zero, gelu and its derivative stay within a few ulp (interpreter: 1.9 and 4.3;
    # 6 to 7 with the GPU's approximate reciprocal and exponential at their worst);
    # where the CDF is small they keep relative accuracy (1.4e-5 at |gelu| > 1e-3, 7e-4 at
    # 1e-10), where 1 + erf(v / sqrt 2) in float32 loses it all below v = -5.8.
    v = torch.linspace(-12, 12, 200_001, dtype=torch.float32)
    forward, slope = _exact_gelu(v)
    eps = torch.finfo(torch.float32).eps
    got = fusedkit.gelu_mul(v.to(DEVICE), 1.0).cpu().double()
    got_slope = fusedkit.elementwise("gelu_grad", torch.ones_like(v).to(DEVICE), v.to(DEVICE)).cpu().double()
    for value, want in ((got, forward), (got_slope, slope)):
        rel = (value - want).abs() / want.abs()
        assert rel[want.abs() > 0.2].max().item() < 12 * eps
    rel = (got - forward).abs() / forward.abs()
    assert rel[forward.abs() > 1e-3].max().item() < 1e-4
    assert rel[forward.abs() > 1e-10].max().item() < 3e-3


TANH_F64_ENTRIES = {
    "gelu_mul": lambda v: fusedkit.gelu_mul(v, torch.ones_like(v), approximate="tanh"),
    "add_gelu": lambda v: fusedkit.add_gelu(v, torch.full_like(v, -0.0), approximate="tanh"),
    "matmul": lambda v: fusedkit.matmul(v[:, None], torch.ones(1, 1, dtype=F64, device=v.device), None, "gelu_tanh")[
        :, 0
    ],
}


@pytest.mark.parametrize("entry", sorted(TANH_F64_ENTRIES))
def test_float64_tanh_gelu_computes_what_torch_computes(entry):
    # float64 takes torch's own formula, 0.5 v (1 + tanh z), and so its cancellation: where tanh
    # rounds to -1 GELU is -0.0 (v = -10), and times inf that is NaN, not -inf; the derivative
    # likewise. What is left is the tanh's own rounding (an ulp or two of 1).
    special = [-10.0, -5.0, -0.0, 0.0, 1e-300, -1e-300, 1e154, 1e155, -1e155, math.inf, -math.inf, math.nan]
    v = torch.cat([torch.linspace(-40, 40, 4001, dtype=F64), torch.tensor(special, dtype=F64)]).to(DEVICE)
    v = v.requires_grad_()
    got = TANH_F64_ENTRIES[entry](v)
    want = F.gelu(v.detach(), approximate="tanh")
    torch.testing.assert_close(got.detach(), want, rtol=1e-13, atol=1e-15, equal_nan=True)
    if entry != "matmul":  # (the accumulator starts at +0: a product's -0.0 sums to +0.0)
        signed = ~want.isnan()
        assert torch.equal(torch.signbit(got.detach())[signed], torch.signbit(want)[signed])
    (slope,) = torch.autograd.grad(got.sum(), v)
    wide = v.detach().requires_grad_()
    (want_slope,) = torch.autograd.grad(F.gelu(wide, approximate="tanh").sum(), wide)
    torch.testing.assert_close(slope, want_slope, rtol=1e-13, atol=1e-14, equal_nan=True)
    b = torch.tensor([math.inf], dtype=F64, device=DEVICE)
    nan = fusedkit.gelu_mul(torch.tensor([-10.0], dtype=F64, device=DEVICE), b, approximate="tanh")
    assert torch.isnan(nan).all() and torch.isnan(
        F.gelu(torch.tensor([-10.0], dtype=F64), approximate="tanh") * math.inf
    )


PROMOTING = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("other", PROMOTING, ids=str)
@pytest.mark.parametrize("fused,plain", GATES, ids=GATE_IDS)
def test_gates_take_torchs_type_promotion(fused, plain, other):
    # silu_mul(features, mask_bool), gelu_mul(a, positions_int64), add_gelu(a, int_bias): the
    # result is the float operand's dtype, as in torch, and the float operand gets its gradient.
    a = rand((6, 5), torch.float32, DEVICE).requires_grad_()
    b = (torch.arange(30, device=DEVICE).reshape(6, 5) % 3).to(other)
    for x, y in ((a, b), (b, a)):
        try:
            want = plain(x.detach().cpu(), y.detach().cpu())
        except (NotImplementedError, RuntimeError):  # torch's silu / gelu of an integer tensor
            continue
        out = fused(x, y)
        assert out.dtype == want.dtype == torch.float32
        torch.testing.assert_close(out.detach().cpu(), want, rtol=1.3e-6, atol=1e-6)
        (grad,) = torch.autograd.grad(out.sum(), a)
        (want_grad,) = torch.autograd.grad(plain(*(t if t is not a else a for t in (x, y))).sum(), a)
        torch.testing.assert_close(grad, want_grad, rtol=1.3e-6, atol=1e-6)


GATE_OPS = {"silu_mul": (fusedkit.silu_mul, F.silu), "gelu_mul": (fusedkit.gelu_mul, F.gelu)}


@pytest.mark.parametrize("name", sorted(GATE_OPS))
def test_a_gate_keeps_only_what_the_requested_gradients_read(name):
    # torch's silu(a) * w with only w requiring grad keeps silu(a) and not w; fusedkit keeps a
    # alone, so features made under inference mode train a weight, and w may change in place.
    fused, act = GATE_OPS[name]
    with torch.inference_mode():
        features = rand((16, 8), torch.float32, DEVICE)
    w = leaf((8,), torch.float32)
    (grad,) = torch.autograd.grad(fused(features, w).sum(), w)
    (want,) = torch.autograd.grad((act(features.clone()) * w).sum(), w)
    torch.testing.assert_close(grad, want, rtol=1.3e-6, atol=1e-5)
    a, w = leaf((16, 8), torch.float32).detach(), leaf((16, 8), torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused(a, w)
    assert [t.data_ptr() for t in saved] == [a.data_ptr()]
    with torch.no_grad():
        w.mul_(2)  # not read by w's gradient: the backward still runs, as torch's does
    (grad,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(grad, act(a), rtol=1.3e-6, atol=1e-6)
    # the other way round: an inference tensor a gradient reads is held, not refused
    x = leaf((16, 8), torch.float32)
    (gx,) = torch.autograd.grad(fused(x, features).sum(), x)
    xw = x.detach().requires_grad_()
    (want,) = torch.autograd.grad((act(xw) * features.clone()).sum(), xw)
    torch.testing.assert_close(gx, want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_an_input_changed_in_place_after_add_gelu_still_trains(approximate):
    # x += F.gelu(x + pos) trains in torch: GELU keeps the sum, not x.
    x0 = leaf((12, 8), torch.float32)
    pos = rand((8,), torch.float32, DEVICE)
    grads = []
    for gelu_of_sum in (
        lambda x: fusedkit.add_gelu(x, pos, approximate=approximate),
        lambda x: F.gelu(x + pos, approximate=approximate),
    ):
        x = x0 * 1
        x += gelu_of_sum(x)
        grads.append(torch.autograd.grad(x.sum(), x0)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1.3e-6, atol=1e-5)


# quick: one alpha (gradgradcheck is seconds interpreted)
@pytest.mark.parametrize("alpha", [-0.5, pytest.param(1, marks=pytest.mark.slow)])
def test_add_gelus_double_backward_flows_through_the_kept_sum(alpha):
    x, y = leaf((3, 4)), leaf((4,))  # small: gradgradcheck perturbs every element
    assert torch.autograd.gradgradcheck(lambda x, y: fusedkit.add_gelu(x, y, alpha=alpha), (x, y))


@triton.jit
def _relu_mul_math(a, b):
    return activations.relu(a) * b


@triton.jit
def _relu_mul_grad_math(grad, a, b):
    # torch's threshold_backward: no gradient where a <= 0 (NaN passes it)
    return tl.where(a <= 0, 0.0, grad * b), grad * activations.relu(a)


def test_a_new_gate_is_a_registry_entry_not_new_plumbing():
    # ReLU-gated MLPs: two small jit functions and two torch references make a gate with
    # everything the built-in ones have (one-launch backward, kept inputs, promotion, the
    # public elementwise call), as design.md's checklist says.
    relu_mul = fusedkit.register_gate(
        "relu_mul_test",
        _relu_mul_math,
        _relu_mul_grad_math,
        torch.relu,
        lambda g, v: torch.ops.aten.threshold_backward(g, v, 0),
        "relu",
    )
    try:
        assert relu_mul.needs == ((0, 1), (0,)) and "relu_mul_test" in fusedkit.registry.names()
        a, b = leaf((9, 7)), leaf((7,))
        g = rand((9, 7), F64, DEVICE)
        out = fusedkit.elementwise("relu_mul_test", a, b)
        assert_matches_reference(out, torch.relu(a.detach().cpu()) * b.detach().cpu())
        got = torch.autograd.grad(out, (a, b), g)
        want = torch.autograd.grad(torch.relu(a) * b, (a, b), g)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        a, b = leaf((3, 4)), leaf((4,))  # gradgradcheck perturbs every element
        assert torch.autograd.gradgradcheck(lambda a, b: fusedkit.elementwise("relu_mul_test", a, b), (a, b))
    finally:
        fusedkit.registry.unregister("relu_mul_test")
