"""fusedkit.advise and fusedkit.fuse: every site in a small ResNet block and in MLPs found,
with its bytes; the fused model gives the same outputs and gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import rand
from torch import nn

import fusedkit
from fusedkit import fusion
from fusedkit.bench.models import LLAMA_TINY

F32 = 4


class Bottleneck(nn.Module):
    """torchvision's Bottleneck, as it is written (the join: ``out += identity; relu(out)``)."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))  # conv -> bn -> relu: nothing fusedkit fuses
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class LlamaStyleMLP(nn.Module):
    def __init__(self, d=16, h=24):
        super().__init__()
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """A GPT-style MLP with a GeGLU gate and a bias + GELU at its end."""

    def __init__(self, d=16, h=32):
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.act = nn.GELU(approximate="tanh")
        self.value = nn.Linear(h, h)
        self.out = nn.Linear(h, d, bias=False)
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = self.act(self.fc(x))  # linear -> gelu_tanh
        g = F.gelu(h) * self.value(h)  # gelu * mul
        return F.gelu(self.out(g) + self.bias)  # add -> gelu


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Bottleneck()
        self.mlp = GeluMLP()
        self.llama = LlamaStyleMLP()

    def forward(self, images):
        y = self.block(images).mean((2, 3))
        return self.llama(self.mlp(torch.cat([y, y], 1)))


def _net():
    torch.manual_seed(0)
    return Net().to(DEVICE), rand((2, 8, 5, 5), torch.float32, DEVICE)


def test_advise_finds_every_site_with_its_bytes():
    net, images = _net()
    sites = fusedkit.advise(net, images)
    assert [(s.pattern, s.module) for s in sites] == [
        ("add -> relu", "block"),
        ("linear -> gelu_tanh", "mlp"),
        ("gelu * mul", "mlp"),
        ("add -> gelu", "mlp"),
        ("gated mlp (silu)", "llama"),
    ]
    # each saves the write and the read of its intermediate: the join's (2, 8, 5, 5), the
    # MLP's (2, 32) hidden activations and (2, 16) output, the gate's (2, 24)
    assert [s.bytes_saved for s in sites] == [
        2 * 2 * 8 * 25 * F32,
        2 * 2 * 32 * F32,
        2 * 2 * 32 * F32,
        2 * 2 * 16 * F32,
        2 * 2 * 24 * F32,
    ]
    assert sites[0].replacement.startswith("fusedkit.add_relu(")
    assert sites[1].replacement.startswith("fusedkit.matmul(") and "activation='gelu_tanh'" in sites[1].replacement
    assert "approximate" not in sites[2].replacement
    assert sites[4].replacement == (
        "fusedkit.gated_mlp(gelu_1, llama.gate_proj.weight, llama.up_proj.weight, llama.down_proj.weight, "
        "activation='silu')"
    )


def test_fuse_gives_the_same_outputs_and_gradients():
    net, images = _net()
    keys = list(net.state_dict())
    fused = fusedkit.fuse(net, images)
    assert fused is net and type(net) is Net and list(net.state_dict()) == keys  # the user's model
    assert len(fused.fusion_sites) == 5
    code = fusion.fused_code(net)
    for op in ("add_relu", "matmul", "gelu_mul", "add_gelu", "gated_mlp"):
        assert op in code
    assert code.count("self.block.relu(") == 1  # the join's ReLU is gone; bn1's stays
    net.eval()
    original = lambda x: Net.forward(net, x)  # the class's own forward
    torch.testing.assert_close(fused(images), original(images), rtol=1e-5, atol=1e-6)
    ours = torch.autograd.grad(fused(images).sum(), list(net.parameters()))
    theirs = torch.autograd.grad(original(images).sum(), list(net.parameters()))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert fusedkit.unfuse(net) is net and fusion.fused_code(net) is None and "fusion_sites" not in vars(net)


def test_a_chain_whose_intermediate_has_another_user_is_left_alone():
    class TwoUsers(nn.Module):
        def forward(self, x, y):
            s = x + y
            return torch.relu(s) + s.sum()

    x, y = rand((4, 3), torch.float32, DEVICE), rand((4, 3), torch.float32, DEVICE)
    assert fusedkit.advise(TwoUsers(), x, y) == []
    torch.testing.assert_close(fusedkit.fuse(TwoUsers(), x, y)(x, y), TwoUsers()(x, y))


def test_alpha_and_functional_forms():
    class Functional(nn.Module):
        def forward(self, x, y, w, b):
            h = F.relu(torch.add(x, y, alpha=2))
            return F.silu(F.linear(h, w, b))

    x, y = rand((4, 6), torch.float32, DEVICE), rand((4, 6), torch.float32, DEVICE)
    w, b = rand((5, 6), torch.float32, DEVICE), rand((5,), torch.float32, DEVICE)
    sites = fusedkit.advise(Functional(), x, y, w, b)
    assert [s.pattern for s in sites] == ["add -> relu", "linear -> silu"]
    assert "alpha=2" in sites[0].replacement
    torch.testing.assert_close(fusedkit.fuse(Functional(), x, y, w, b)(x, y, w, b), Functional()(x, y, w, b))


def test_transformers_mlps():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    x = rand((2, 5, 32), torch.float32, DEVICE)
    gpt2 = GPT2MLP(128, transformers.GPT2Config(n_embd=32, n_inner=128, n_head=4, activation_function="gelu_new"))
    llama = LlamaMLP(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_attention_heads=4, num_key_value_heads=4)
    )
    for model, pattern, hidden in ((gpt2, "linear -> gelu_tanh", 128), (llama, "gated mlp (silu)", 88)):
        model = model.to(DEVICE).eval()
        (site,) = fusedkit.advise(model, x)
        act = model.act if hasattr(model, "act") else model.act_fn
        hidden_states = rand((10, hidden), torch.float32, DEVICE)
        with fusedkit.MemoryCounterMode(display=False) as counter:
            act(hidden_states)
        # the activation's own ops: SiLU one kernel (its output written and read back),
        # transformers' gelu_new eight (each reading and writing the hidden activations)
        assert site.pattern == pattern and site.bytes_saved == counter.get_total_bytes()
        assert site.bytes_saved == (2 if pattern == "gated mlp (silu)" else 18) * 10 * hidden * F32
        want = model(x)
        torch.testing.assert_close(fusedkit.fuse(model, x)(x), want, rtol=1e-5, atol=1e-6)


def test_fuse_refuses_a_model_whose_outputs_change(monkeypatch):
    net, images = _net()
    monkeypatch.setattr(fusion, "add_relu", lambda x, y, alpha=1: torch.relu(x + y) + 1)
    with pytest.raises(fusedkit.FusedkitError, match="outputs differ"):
        fusedkit.fuse(net, images)
    assert net.training  # the check's eval mode is undone
    assert fusion.fused_code(net) is None  # and the fusion


def test_fuse_check_allows_a_few_roundings_past_the_tolerance_and_no_more():
    """A deep bf16 model's fused outputs move a few elements past the tolerance (one rounding
    where eager rounds twice, compounded); a wrong fusion moves many, or one far."""
    want = torch.linspace(-4, 4, 10_000, dtype=torch.bfloat16)
    tol = fusion.FUSE_TOLERANCE[torch.bfloat16]
    assert fusion._disagreement(want.clone(), want, tol) is None
    few = want.clone()
    few[:5] += 2 * tol * (1 + few[:5].abs())  # 5 of 10,000 (the share allowed: 10)
    assert fusion._disagreement(few, want, tol) is None
    many = want.clone()
    many[:11] += 2 * tol * (1 + many[:11].abs())
    assert "11 of 10000 elements" in fusion._disagreement(many, want, tol)
    far = want.clone()
    far[0] += 20 * tol * (1 + far[0].abs())
    assert "times that" in fusion._disagreement(far, want, tol)
    nan = want.clone()
    nan[3] = float("nan")
    assert "NaN" in fusion._disagreement(nan, want, tol)
    assert "shape" in fusion._disagreement(want[:5], want, tol)


def test_an_untraceable_model_is_named_in_a_warning():
    class DataDependent(nn.Module):
        def forward(self, x):
            return torch.relu(x) if x.sum() > 0 else x

    with pytest.warns(UserWarning, match="DataDependent: TraceError: symbolically traced"):
        assert fusedkit.advise(DataDependent(), rand((3,), torch.float32, DEVICE)) == []


class _ShapeIterating(nn.Module):  # iterates over a shape, as transformers' GPT-2 attention does
    def forward(self, x):
        return torch.relu(x.view(*x.shape[:-1], 2, -1) + 1).flatten(-2)


class _TrainingOnlyUntraceable(nn.Module):  # the same, in training mode only
    def forward(self, x):
        return _ShapeIterating.forward(self, x) if self.training else torch.relu(x + 1)


def _kept_whole_warnings(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if "cannot trace through" in str(w.message)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("attn", [_ShapeIterating, _TrainingOnlyUntraceable])
def test_a_submodule_fx_cannot_trace_is_kept_whole(attn, training):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.attn2, self.up = attn(), attn(), nn.Linear(8, 16)

        def forward(self, x):
            return F.gelu(self.up(self.attn2(self.attn(x)) + x))

    block, x = Block().to(DEVICE).train(training), rand((3, 8), torch.float32, DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sites = fusedkit.advise(block, x)
    (w,) = _kept_whole_warnings(caught)
    assert f"{attn.__name__} kept whole" in str(w.message) and "of Block" in str(w.message)
    assert w.filename == __file__  # (the warning points at the caller)
    # the linear -> gelu around them is found; the add -> relu inside is not looked for: the
    # model traces in both modes (a submodule that traces in one mode only is kept whole in
    # both, not mistaken for a forward reading self.training), as fuse traces it
    assert [(s.pattern, s.module) for s in sites] == [("linear -> gelu", "")]
    block.eval()
    want = block(x)
    block.train(training)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fusedkit.fuse(block, x)
    (w,) = _kept_whole_warnings(caught)
    assert f"{attn.__name__} kept whole" in str(w.message) and w.filename == __file__
    assert [s.pattern for s in fused.fusion_sites] == ["linear -> gelu"]
    block.eval()
    torch.testing.assert_close(fused(x), want)


@pytest.mark.slow  # the CLI in a subprocess over every report model (6 s on 2 cores)
def test_the_advise_command_on_the_report_models(tmp_path):
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers")
    out = tmp_path / "advice.json"
    run = subprocess.run(
        [sys.executable, "-m", "fusedkit", "advise", "--models", "llama_mlp", "--json", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    (site,) = data["sites"]
    assert site["model"] == "llama_mlp" and site["pattern"] == "gated mlp (silu)" and site["bytes_saved"] > 0
    (timing,) = data["timings"]
    assert timing["fused_forward_ms"] > 0 and timing["original_train_ms"] > 0
    assert "gated mlp (silu)" in run.stdout
    # the forwards' GPU busy times: the kernels' durations on a GPU, none elsewhere
    busy = (timing["original_forward_gpu_ms"], timing["fused_forward_gpu_ms"])
    if torch.cuda.is_available():
        assert all(ms > 0 for ms in busy)
    else:
        assert busy == (None, None)


def test_keyword_linear_shapes_it_cannot_take_and_in_place_targets():
    class Kw(nn.Module):
        def forward(self, x, w, b, v):
            h = F.relu(F.linear(x, weight=w, bias=b))  # keywords: x stays x
            g = F.relu(F.linear(h, v))  # a 1-D weight: not a matmul fusedkit takes
            z = h.clone()
            s = z.add_(h)  # in place on a fresh intermediate used again below
            return g, torch.relu(s), z

    x, w, b = (
        rand((4, 6), torch.float32, DEVICE),
        rand((5, 6), torch.float32, DEVICE),
        rand((5,), torch.float32, DEVICE),
    )
    v = rand((5,), torch.float32, DEVICE)
    sites = fusedkit.advise(Kw(), x, w, b, v)
    assert [s.pattern for s in sites] == ["linear -> relu"]
    assert sites[0].replacement.startswith("fusedkit.matmul(x, w.t(), b,")
    fused = fusedkit.fuse(Kw(), x, w, b, v)
    for got, want in zip(fused(x, w, b, v), Kw()(x, w, b, v)):
        torch.testing.assert_close(got, want)


def test_advise_leaves_the_model_and_inputs_as_they_were():
    net, images = _net()
    before = images.clone()
    stats = net.block.bn1.running_mean.clone(), int(net.block.bn1.num_batches_tracked)
    fusedkit.advise(net, images)
    fusedkit.fuse(net, images)
    assert torch.equal(images, before) and net.training
    assert torch.equal(net.block.bn1.running_mean, stats[0]) and int(net.block.bn1.num_batches_tracked) == stats[1]


def test_module_names_of_a_module_called_twice():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = LlamaStyleMLP()

        def forward(self, x):
            return self.mlp(self.mlp(x))

    x = rand((3, 16), torch.float32, DEVICE)
    assert [s.module for s in fusedkit.advise(Twice().to(DEVICE), x)] == ["mlp", "mlp"]


def test_a_forward_reading_self_training_is_fused_with_one_code_a_mode():
    # (functional dropout, as OPT's, Falcon's and Bloom's decoder layers have: a traced copy of
    # one mode would keep its dropout on, or off, in the other)
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Identity())

        def forward(self, x, r):
            return F.dropout(torch.relu(self.inner(x) + r), 0.5, training=self.training)

    model, x, r = Functional().eval(), rand((64,), torch.float32, DEVICE), rand((64,), torch.float32, DEVICE)
    assert fusedkit.fuse(model, x, r) is model
    assert [s.pattern for s in model.fusion_sites] == ["add -> relu"]
    assert "training = False" in fusion.fused_code(model) and "add_relu" in fusion.fused_code(model)
    for mode in (True, False, True):
        model.train(mode)
        assert ("training = True" in fusion.fused_code(model)) == mode
        torch.manual_seed(3)
        got = model(x, r)
        torch.manual_seed(3)
        torch.testing.assert_close(got, Functional.forward(model, x, r))
    model.train()
    model.inner.eval()  # (an inlined submodule set apart: the module's own forward runs)
    with pytest.warns(UserWarning, match="another mode"):
        torch.manual_seed(3)
        got = model(x, r)
    torch.manual_seed(3)
    torch.testing.assert_close(got, Functional.forward(model, x, r))


def test_the_report_gives_the_gpu_busy_time_saved():
    from fusedkit.bench.advice import format_advice

    timing = {
        "model": "m",
        "sites": 1,
        "bytes_saved": 10**6,
        "original_forward_ms": 1.0,
        "fused_forward_ms": 0.9,
        "original_train_ms": 3.0,
        "fused_train_ms": 2.5,
        "predicted_ms": 0.25,
        "original_forward_gpu_ms": 0.75,
        "fused_forward_gpu_ms": 0.5,
    }
    row = format_advice([], [timing], {}).splitlines()[-1].split()
    assert row[6:9] == ["0.250", "0.100", "0.250"]  # predicted, saved, GPU saved
    older = {k: v for k, v in timing.items() if "gpu" not in k}  # a record written before the busy times
    assert format_advice([], [older], {}).splitlines()[-1].split()[8] == "-"


# What a user's model does, the fused one does too (issue 46's hostile pass).


def test_optional_arguments_keyword_calls_and_functions():
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, x, residual=None, scale=1.0):
            if residual is not None:
                x = x + residual
            return torch.relu(self.lin(input=x)) * scale  # a submodule called by keyword

    model, x = Optional().to(DEVICE), rand((4, 6), torch.float32, DEVICE)
    (site,) = fusedkit.advise(model, x)
    assert site.pattern == "linear -> relu"
    fused = fusedkit.fuse(model, x)
    torch.testing.assert_close(fused(x), Optional.forward(model, x))
    # another call than the traced one runs the module's own forward
    torch.testing.assert_close(fused(x, residual=x, scale=2.0), Optional.forward(model, x, x, 2.0))

    def function(x, y):
        return F.relu(x + y)

    assert [s.pattern for s in fusedkit.advise(function, x, x)] == ["add -> relu"]
    with pytest.raises(fusedkit.FusedkitError, match="fuse\\(\\) takes an nn.Module") as err:
        fusedkit.fuse(function, x, x)
    assert isinstance(err.value, TypeError)


class _Cache:  # a KV cache's stand-in: an object the attention updates
    def __init__(self):
        self.seen = 0


class _CachedAttention(nn.Module):  # does not trace (updates the cache): kept whole
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cache=None, use_cache=False):
        if use_cache:
            cache.seen += x.shape[0]
        return self.proj(x)


class _Layer(nn.Module):  # a decoder layer as transformers calls it: keywords, a pair, a cache
    def __init__(self, reads_cache=False):
        super().__init__()
        self.attn, self.up, self.reads_cache = _CachedAttention(), nn.Linear(8, 16), reads_cache

    def forward(self, h, mask=None, *, pair, cache=None, use_cache=False):
        if isinstance(cache, _Cache):  # (a branch on the object's class goes as the call went)
            h = h * 2
        if self.reads_cache:
            h = h + cache.seen
        h = h + self.attn(h, cache=cache, use_cache=use_cache) * pair[0]
        if mask is not None:
            h = h * mask
        return F.gelu(self.up(h + pair[1]))


class _Model(nn.Module):
    def __init__(self, reads_cache=False):
        super().__init__()
        self.layer = _Layer(reads_cache)

    def forward(self, x, cache):
        return self.layer(x, pair=(x, -x), cache=cache, use_cache=True), cache.seen


def test_a_module_called_with_keywords_and_objects_is_fused_for_calls_like_it():
    """Tensors (in tuples too) are traced inputs, None and numbers fixed, an object handed on
    to a submodule kept whole an input: the layer is fused, and only a call of that shape runs
    the fused code; any other runs the layer's own forward."""
    model, x = _Model().to(DEVICE), rand((4, 8), torch.float32, DEVICE)
    with pytest.warns(UserWarning, match="_CachedAttention kept whole \\(it takes the _Cache argument\\)"):
        fusedkit.fuse(model, x, _Cache())
    assert [(s.pattern, s.module) for s in model.fusion_sites] == [("linear -> gelu", "layer")]
    assert "fusedkit_ops_matmul" in fusion.fused_code(model.layer).replace(".", "_")
    layer, calls = model.layer, []
    layer.register_forward_pre_hook(
        lambda m, a, k: calls.append(m._fusedkit_fused[1](a, k) is not None), with_kwargs=True
    )
    got, seen = model(x, _Cache())
    torch.testing.assert_close(got, _Layer.forward(layer, x, pair=(x, -x), cache=_Cache(), use_cache=True))
    assert seen == 4 and calls == [True]  # (the cache updated by the attention the fused code calls)
    mask = torch.ones_like(x)
    for args, kwargs in [
        ((x,), {"pair": (x, -x), "cache": _Cache(), "use_cache": False}),  # another fixed value
        ((x, mask), {"pair": (x, -x), "cache": _Cache(), "use_cache": True}),  # a tensor for None
        ((x,), {"pair": (x, -x, x), "cache": _Cache(), "use_cache": True}),  # a longer tuple
        ((x,), {"pair": (x, -x), "cache": object(), "use_cache": False}),  # another class
        ((x,), {"pair": (x, -x)}),  # keywords left out
    ]:
        calls.clear()
        torch.testing.assert_close(layer(*args, **kwargs), _Layer.forward(layer, *args, **kwargs))
        assert calls == [False]


def test_a_layer_using_an_object_argument_itself_or_returning_a_changed_class_is_left():
    """The traced code may only hand an object on to a submodule kept whole; and fx returns a
    dict subclass (transformers' ModelOutput) as a dict: either leaves the module unfused,
    named in the warning, its submodules looked into."""

    class Output(dict):
        pass

    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x):
            return Output(y=self.mlp(x))

    x = rand((4, 8), torch.float32, DEVICE)
    for model, why in [
        (_Model(reads_cache=True), "_Layer: its forward uses its _Cache argument 'cache' itself"),
        (Returns(), "Returns: its traced forward returns a dict where it returned Output"),
    ]:
        model = model.to(DEVICE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sites = fusedkit.advise(model, x, *([_Cache()] if isinstance(model, _Model) else []))
        assert any(why in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert [s.pattern for s in sites] == ([] if isinstance(model, _Model) else ["linear -> relu"])


class _PreNormBlock(nn.Module):  # a transformer block's residual joins, written three ways
    def __init__(self, width=16):
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Linear(width, width)
        self.ln, self.rms = nn.LayerNorm(width), nn.RMSNorm(width, eps=1e-6)
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x):
        h = x + self.attn(x)  # add -> nn.LayerNorm; h is the residual stream after it
        y = self.ln(h)
        h2 = torch.add(h, self.mlp(y), alpha=0.5)  # add -> F.rms_norm, alpha
        z = F.rms_norm(h2, (16,), self.w, 1e-5)
        return self.rms(z + h2) * 2 + h2  # add -> nn.RMSNorm


def test_residual_joins_and_their_norms_fuse_with_the_stream_kept():
    block, x = _PreNormBlock().to(DEVICE), rand((3, 5, 16), torch.float32, DEVICE).requires_grad_()
    sites = fusedkit.advise(block, x)
    assert [s.pattern for s in sites] == ["add -> layer_norm", "add -> rms_norm", "add -> rms_norm"]
    assert all(s.bytes_saved > 0 for s in sites) and "alpha=0.5" in sites[1].replacement
    want = block(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    fusedkit.fuse(block, x.detach())
    assert fusion.fused_code(block).count("add_") >= 3
    got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(got.square().sum(), x)[0], want_grad, rtol=1e-4, atol=1e-4)


def test_fused_norms_read_their_modules_eps_and_take_other_calls():
    class Block(nn.Module):  # a norm of two dims without parameters; a position embedding of one row
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(50, 16), nn.Embedding(32, 16)
            self.ln, self.ln2, self.f = (
                nn.LayerNorm(16),
                nn.LayerNorm((6, 16), elementwise_affine=False),
                nn.Linear(16, 16),
            )

        def forward(self, ids):
            h = self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)[None]))
            return self.ln2(h + self.f(h))

    block, ids = Block().to(DEVICE), torch.randint(0, 50, (1, 6), device=DEVICE)
    reference = copy.deepcopy(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fusedkit.fuse(block, ids)
    assert not [w for w in caught if "get_attr" in str(w.message)]  # (fx's, of a number read as one)
    assert [s.pattern for s in block.fusion_sites] == ["add -> layer_norm"] * 2
    assert "normalized_shape=[6, 16]" in block.fusion_sites[1].replacement
    other = torch.randint(0, 50, (3, 6), device=DEVICE)  # the position row now broadcasts
    torch.testing.assert_close(block(other), reference(other), rtol=1e-5, atol=1e-5)
    block.ln.eps = reference.ln.eps = 10.0  # a module's eps changed after fuse holds
    torch.testing.assert_close(block(other), reference(other), rtol=1e-5, atol=1e-5)


def test_a_decoder_with_eager_attention_fuses():
    # The cache each layer got, as it was then (the run fills it afterwards): the attention's
    # mask and the keys it adds agree when fuse runs the traced layer on it.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
    )
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    reference, ids = copy.deepcopy(model), torch.randint(0, 100, (2, 7), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusedkit.fuse(model, ids)
    assert [s.pattern for s in model.fusion_sites] == ["rms_norm", "add -> rms_norm", "gated mlp (silu)"] * 2
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_norm_fusedkit_would_change_is_left_and_named():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm, self.hooked = nn.Linear(8, 8), LlamaRMSNorm(8), nn.LayerNorm(8)

        def forward(self, x):
            h = x + self.proj(x)
            return self.norm(h), self.hooked(h + x)

    layer = Layer().to(DEVICE)
    layer.hooked.register_forward_hook(lambda *a: None)
    x = rand((4, 8), torch.bfloat16, DEVICE)  # (a float32 weight: LlamaRMSNorm returns float32)
    layer.proj.to(torch.bfloat16)
    layer.hooked.to(torch.bfloat16)  # (CUDA's layer_norm refuses a float32 weight with bf16 input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fusedkit.advise(layer, x) == []
    message = " ".join(str(w.message) for w in caught)
    assert (
        "add -> rms_norm in (its forward): it returns torch.float32 where fusedkit's norm gives torch.bfloat16"
        in message
    )
    assert "hooked has hooks" in message and transformers is not None


def test_sites_the_op_would_refuse_are_left_and_named():
    class Masks(nn.Module):
        def forward(self, a, mask, u, v):
            return F.silu(a) * mask, torch.relu(u + v)  # a bool gate (fusedkit takes it); uint8 (it does not)

    a, mask = rand((4, 6), torch.float32, DEVICE), rand((4, 6), torch.float32, DEVICE) > 0
    u = torch.randint(0, 100, (4, 6), dtype=torch.uint8, device=DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sites = fusedkit.advise(Masks(), a, mask, u, u)
    assert [s.pattern for s in sites] == ["silu * mul"]
    (w,) = [w for w in caught if "unfused" in str(w.message)]
    assert "add -> relu" in str(w.message) and "torch.uint8" in str(w.message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fusedkit.fuse(Masks(), a, mask, u, u)
    for got, want in zip(fused(a, mask, u, u), Masks()(a, mask, u, u)):
        torch.testing.assert_close(got, want)


def test_nan_outputs_and_a_half_precision_gate_in_a_float32_model():
    class Gate(nn.Module):
        def forward(self, a, b):
            return F.silu(a) * b  # float16 silu, promoted to float32 by b

    a = rand((64, 33), torch.float16, DEVICE) * 4
    b = rand((64, 33), torch.float32, DEVICE)
    b[0, 0] = float("nan")
    fused = fusedkit.fuse(Gate(), a, b)
    assert [s.pattern for s in fused.fusion_sites] == ["silu * mul"]
    torch.testing.assert_close(fused(a, b), Gate()(a, b), rtol=2e-2, atol=2e-2, equal_nan=True)


class _Join(nn.Module):
    def forward(self, x, r):
        x += r  # writes the caller's x, as torchvision's join writes its own intermediate
        return torch.relu(x)


def test_an_in_place_add_on_an_input_still_writes_it():
    x, r = rand((4, 5), torch.float32, DEVICE), rand((4, 5), torch.float32, DEVICE)
    assert fusedkit.advise(_Join(), x, r) == []  # the fused call would not write x
    fused = fusedkit.fuse(_Join(), x, r)
    mine, theirs = x.clone(), x.clone()
    torch.testing.assert_close(fused(mine, r), _Join()(theirs, r))
    torch.testing.assert_close(mine, theirs)  # the caller's x written in both


def test_hooks_and_weight_norm_keep_their_module():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.normed = torch.nn.utils.weight_norm(nn.Linear(6, 5))  # a forward pre-hook sets .weight
            self.hooked = nn.Linear(6, 5)

        def forward(self, x):
            return torch.relu(self.normed(x)) + F.gelu(self.hooked(x))

    torch.manual_seed(0)
    model, x = Head().to(DEVICE), rand((4, 6), torch.float32, DEVICE)
    fired = []
    model.hooked.register_forward_hook(lambda *args: fired.append(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fusedkit.fuse(model, x)
    assert fused.fusion_sites == []
    message = " ".join(str(w.message) for w in caught)
    assert "normed has hooks" in message and "hooked has hooks" in message
    fired.clear()
    with torch.no_grad():
        model.normed.weight_g.mul_(2)  # the pre-hook makes the weight from this on every call
    fused(x).sum().backward()
    assert fired == [1] and model.normed.weight_g.grad is not None
    torch.testing.assert_close(fused(x), Head.forward(model, x))


def test_a_parametrized_linear_is_left_and_named():
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).t()

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)
            parametrize.register_parametrization(self.lin, "weight", Symmetric())

        def forward(self, x):
            return torch.relu(self.lin(x))

    model, x = Head().to(DEVICE), rand((4, 5), torch.float32, DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = fusedkit.fuse(model, x)
    assert fused.fusion_sites == [] and any("lin is parametrized" in str(w.message) for w in caught)
    with torch.no_grad():
        model.lin.parametrizations.weight.original.add_(1)
    torch.testing.assert_close(fused(x), Head.forward(model, x))


def _tiny_transformers():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 8), device=DEVICE)
    special = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    # (the models report's two-layer decoder, LLaMA's and Gemma 2's alike)
    decoder = dict(LLAMA_TINY, **special)
    return {
        "gpt2": (
            transformers.GPT2LMHeadModel(
                transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32, **special)
            ),
            ids,
            ["add -> layer_norm", "linear -> gelu_tanh"] * 2,
        ),
        "llama": (
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**decoder)),
            ids,
            ["rms_norm", "add -> rms_norm", "gated mlp (silu)"] * 2,
        ),
        "bert": (
            transformers.BertForMaskedLM(
                transformers.BertConfig(
                    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=100
                )
            ),
            ids,
            # (its prediction head has a linear -> gelu too)
            ["add -> layer_norm", "linear -> gelu", "add -> layer_norm"] * 2 + ["linear -> gelu"],
        ),
        "gemma2": (
            _random_norms(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**decoder, head_dim=8))),
            ids,
            # (Gemma's RMSNorm, weight 1 + w: before and after the attention and the MLP)
            ["rms_norm", "rms_norm", "add -> rms_norm", "gated mlp (gelu_tanh)", "rms_norm"] * 2,
        ),
    }


def _random_norms(model):
    with torch.no_grad():  # (Gemma's norms start at weight 0, read as 1 + 0: a test of nothing)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "gemma2"])
def test_fuse_on_a_whole_transformers_model_returns_it(name, tmp_path):
    # The top level and the attention do not trace (ModelOutput, masks from data, caches):
    # fuse looks into them and fuses each layer whole around its attention (residual joins
    # with their norms, a composed RMSNorm, the MLP's activation) in place; the model keeps
    # its class, keys, generate and hooks.
    torch.manual_seed(0)
    model, ids, patterns = _tiny_transformers()[name]
    model = model.to(DEVICE).eval()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    with pytest.warns(UserWarning, match="unfused"):
        fused = fusedkit.fuse(model, ids)
    assert fused is model and type(model) is type(reference) and list(model.state_dict()) == keys
    assert [s.pattern for s in model.fusion_sites] == patterns
    for site in model.fusion_sites:  # run by the fused code of its module or of one holding it
        parts = site.module.split(".")
        assert any(fusion.fused_code(model.get_submodule(".".join(parts[:i]))) for i in range(len(parts) + 1))
    fired = []
    model.register_forward_hook(lambda *args: fired.append(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    assert fired == [1]
    if name != "bert":  # greedy decoding with the KV cache, token for token
        assert torch.equal(
            model.generate(ids[:1], max_new_tokens=4, do_sample=False),
            reference.generate(ids[:1], max_new_tokens=4, do_sample=False),
        )
    model.save_pretrained(tmp_path)
    assert type(reference).from_pretrained(tmp_path).state_dict().keys() == model.state_dict().keys()
    twin = copy.deepcopy(model)  # a copy runs its own parameters
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        assert not torch.equal(twin(ids).logits, model(ids).logits)


class _AnyRMSNorm(nn.Module):
    """An RMSNorm as other libraries write theirs, or a look-alike that computes something else."""

    def __init__(self, n, offset=False, eps_in_sqrt=True, dim=-1, bias=False):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(n) + 0.5), 1e-5
        self.offset, self.eps_in_sqrt, self.dim = offset, eps_in_sqrt, dim
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x, residual=None):
        x = x.float() if residual is None else x.float() + residual
        ms = x.pow(2).mean(self.dim, keepdim=True)
        h = x * torch.rsqrt(ms + self.eps) if self.eps_in_sqrt else x / (ms.sqrt() + self.eps)
        w = (1 + self.weight) if self.offset else self.weight
        return (h * w + (0 if self.bias is None else self.bias)).type_as(x)


def test_rms_norms_of_other_libraries_are_known_by_what_they_compute():
    # transformers copies one RMSNorm under many class names: fuse knows each by what its forward
    # computes on a probe (weight * x / rms, Gemma's (1 + weight) * x / rms), whatever it is
    # called, and leaves alone a module named so that computes something else on some input (its
    # eps elsewhere, over another dim), holds more than a weight, or is called with more than x.
    class Block(nn.Module):
        def __init__(self, call_residual=False, **kw):
            super().__init__()
            self.lin, self.norm, self.call_residual = nn.Linear(8, 8), _AnyRMSNorm(8, **kw), call_residual

        def forward(self, x):
            h = self.lin(x)
            return self.norm(h, x) if self.call_residual else self.norm(h)

    x = rand((3, 4, 8), torch.float32, DEVICE)
    for kw, weight in (({}, "norm.weight"), ({"offset": True}, "1.0 + norm.weight.float()")):
        model = Block(**kw).to(DEVICE)
        sites = fusedkit.advise(model, x)
        assert [s.pattern for s in sites] == ["rms_norm"] and weight in sites[0].replacement, kw
        want = model(x)
        torch.testing.assert_close(fusedkit.fuse(model, x)(x), want, rtol=1e-5, atol=1e-6)
        assert ("1.0 + " in fusion.fused_code(model)) == kw.get("offset", False)
    for kw in ({"eps_in_sqrt": False}, {"dim": 1}, {"bias": True}, {"call_residual": True}):
        model = Block(**kw).to(DEVICE)
        assert fusedkit.advise(model, x) == [], kw
        want = model(x)
        torch.testing.assert_close(fusedkit.fuse(model, x)(x), want, rtol=1e-5, atol=1e-6)


def test_gemmas_norm_weights_train_as_in_the_model():
    # Gemma's RMSNorm applies 1 + weight: the fused code makes that weight from the parameter
    # each call, and the gradient reaches the parameter as it does in Gemma's own forward.
    torch.manual_seed(0)
    model, ids, _ = _tiny_transformers()["gemma2"]
    model = model.to(DEVICE).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fusedkit.fuse(model, ids)
    norms = [[p for n, p in m.named_parameters() if "norm" in n] for m in (model, reference)]
    got, want = (torch.autograd.grad(m(ids).logits.square().mean(), ps) for m, ps in zip((model, reference), norms))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_fused_model_compiles_whole():
    # The fused forward is plain Python over the module: dynamo traces it without a break.
    net, images = _net()
    net.eval()
    want = net(images)
    fusedkit.fuse(net, images)
    torch._dynamo.reset()
    compiled = torch.compile(net, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(images), want, rtol=1e-5, atol=1e-6)


def test_a_call_spec_tells_calls_apart_by_sign_and_keeps_odd_keys_whole():
    from fusedkit.fusion_call import CallSpec

    t = torch.ones(2)
    spec = CallSpec((t, 0.0), {"flag": True})
    assert spec.inputs((t, 0.0), {"flag": True}) == (t,)
    for args, kwargs in [((t, -0.0), {"flag": True}), ((t, 0.0), {"flag": 1}), ((t, 0.0), {}), ((t,), {"flag": True})]:
        assert spec.inputs(args, kwargs) is None, (args, kwargs)
    # a dict keyed by other than strings is one object input (its class checked), not walked
    keyed = CallSpec((t, {torch.float32: t, float("nan"): t}), {})
    assert keyed.classes == [torch.Tensor, dict]
    assert keyed.inputs((t, {1: t}), {}) is not None and keyed.inputs((t, [t]), {}) is None


class _GatedSpellings(nn.Module):
    """Gated MLPs as models write them: modules (LLaMA), functions with biases, tanh GELU (Gemma)."""

    def __init__(self, d=12, h=20):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h), nn.Linear(d, h), nn.Linear(h, d)
        self.w_gate, self.w_up, self.w_down = (nn.Parameter(torch.randn(*s) / 4) for s in ((h, d), (h, d), (d, h)))
        self.act = nn.SiLU()

    def forward(self, x):
        a = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        g = F.gelu(F.linear(a, self.w_gate), approximate="tanh")
        return F.linear(F.linear(a, self.w_up) * g, self.w_down)  # (the product's operands either way round)


def test_gated_mlps_become_one_gated_mlp_call_outputs_and_gradients_equal():
    torch.manual_seed(0)
    model, x = _GatedSpellings().to(DEVICE), rand((3, 4, 12), torch.float32, DEVICE)
    want = _output_and_grads(model, x)
    sites = fusedkit.advise(model, x)
    assert [s.pattern for s in sites] == ["gated mlp (silu)", "gated mlp (gelu_tanh)"]
    assert sites[0].replacement == (
        "fusedkit.gated_mlp(x, gate_proj.weight, up_proj.weight, down_proj.weight, activation='silu', "
        "bias=(gate_proj.bias, up_proj.bias, down_proj.bias))"
    )
    assert "activation='gelu', approximate='tanh'" in sites[1].replacement
    fused = fusedkit.fuse(model, x)
    code = fusion.fused_code(fused)
    assert code.count("gated_mlp(") == 2 and "silu" not in code.replace("activation = 'silu'", "")
    _assert_output_and_grads(fused, x, want)


def _output_and_grads(model, x) -> tuple:
    """``model(x)`` and the gradients of its sum of squares for every parameter."""
    y = model(x)
    return y, torch.autograd.grad(y.square().sum(), list(model.parameters()))


def _assert_output_and_grads(model, x, want: tuple) -> None:
    """``model(x)`` and its gradients (:func:`_output_and_grads`) are ``want``'s within float32 noise."""
    y, grads = _output_and_grads(model, x)
    torch.testing.assert_close(y, want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class _StackedGlu(nn.Module):
    """Gated MLPs whose gate and up projections are the halves of one layer, with no-op modules
    before the down projection: timm's GluMlp (``x1 * act(x2)``, Dropout(0), an Identity norm)
    and Phi-3's ``gate_up_proj`` (``up * act(gate)``, the gate's half first)."""

    def __init__(self, d=12, h=10):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * h), nn.Linear(h, d)
        self.act, self.drop, self.norm = nn.SiLU(), nn.Dropout(0.0), nn.Identity()
        self.gate_up_proj, self.down_proj = nn.Linear(d, 2 * h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        x1, x2 = self.fc1(x).chunk(2, dim=-1)
        x = self.fc2(self.norm(self.drop(x1 * self.act(x2))))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.gelu(gate))


def test_the_halves_of_one_projection_become_a_gated_mlp_on_views_of_its_weight():
    torch.manual_seed(0)
    model, x = _StackedGlu().to(DEVICE), rand((3, 4, 12), torch.float32, DEVICE)
    keys = list(model.state_dict())
    want = _output_and_grads(model, x)
    sites = fusedkit.advise(model, x)
    assert [s.pattern for s in sites] == ["gated mlp (silu)", "gated mlp (gelu)"]
    assert sites[0].replacement == (
        "fusedkit.gated_mlp(x, fc1.weight[10:20], fc1.weight[0:10], fc2.weight, activation='silu', "
        "bias=(fc1.bias[10:20], fc1.bias[0:10], fc2.bias))"
    )
    assert "gate_up_proj.weight[0:10], gate_up_proj.weight[10:20]" in sites[1].replacement
    fused = fusedkit.fuse(model, x)
    code = fusion.fused_code(fused)  # (the first through its dropout module, read as it runs)
    assert code.count("gated_mlp_through(") == code.count("gated_mlp(") == 1 and list(model.state_dict()) == keys
    _assert_output_and_grads(fused, x, want)
    # a hooked no-op stays: the gate alone is fused
    other = _StackedGlu().to(DEVICE)
    other.norm.register_forward_hook(lambda *a: None)
    assert [s.pattern for s in fusedkit.advise(other, x)] == ["silu * mul", "gated mlp (gelu)"]


def test_a_dropout_before_the_down_projection_is_read_as_the_fused_call_runs(monkeypatch):
    # The fused call takes the dropout module: gated_mlp where it drops nothing (p = 0, or eval
    # mode), the composition through it where it drops, whatever its p was at fuse time.
    torch.manual_seed(0)
    model, x = _StackedGlu().to(DEVICE), rand((3, 4, 12), torch.float32, DEVICE)
    fusedkit.fuse(model, x)
    calls = []
    monkeypatch.setattr(fusion, "gated_mlp", lambda *a, **k: calls.append(1) or fusedkit.gated_mlp(*a, **k))
    model(x)
    model.drop.p = 0.5
    assert calls == [1] and not torch.equal(model(x), model(x)) and calls == [1]  # (drops: composed)
    model.eval()
    want = copy.deepcopy(model)
    fusion.unfuse(want)
    torch.testing.assert_close(model(x), want(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]


def test_halves_by_slices_or_keywords_are_gates_alone():
    # Items of one result other than chunk's 0 and 1 (slices), or chunk by keywords: not crashes
    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 20), nn.Linear(10, 8)

        def forward(self, x):
            h = self.fc1(x)
            gate, up = torch.chunk(input=h, chunks=2, dim=-1)
            return self.fc2(h[..., :10] * F.silu(h[..., 10:])) + self.fc2(up * F.silu(gate))

    model, x = Sliced().to(DEVICE), rand((3, 8), torch.float32, DEVICE)
    assert [s.pattern for s in fusedkit.advise(model, x)] == ["silu * mul", "silu * mul"]


def test_a_gated_mlp_with_a_hooked_layer_or_a_shared_projection_keeps_its_layers():
    # A hook on a projection would stop running, and a projection read elsewhere would be
    # computed twice: the gate alone is fused (its layers stay).
    model, x = _LlamaLike().to(DEVICE), rand((5, 8), torch.float32, DEVICE)
    model.up_proj.register_forward_hook(lambda *a: None)
    assert [s.pattern for s in fusedkit.advise(model, x)] == ["silu * mul"]

    class Shared(_LlamaLike):
        def forward(self, x):
            up = self.up_proj(x)
            return self.down_proj(F.silu(self.gate_proj(x)) * up), up

    assert [s.pattern for s in fusedkit.advise(Shared().to(DEVICE), x)] == ["silu * mul"]


class _LlamaLike(nn.Module):
    def __init__(self, d=8, h=16):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(*s, bias=False) for s in ((d, h), (d, h), (h, d)))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def test_a_gate_that_broadcasts_against_up_is_fused_as_a_gate():
    # A one-wide gate (or up) projection broadcasts in the product: not a gated MLP's (gated_mlp
    # takes equal projections); the gate alone is fused.
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 1), nn.Linear(16, 24), nn.Linear(24, 16)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    model, x = Broadcast().to(DEVICE), rand((4, 16), torch.float32, DEVICE)
    want = model(x)
    assert [s.pattern for s in fusedkit.advise(model, x)] == ["silu * mul"]
    torch.testing.assert_close(fusedkit.fuse(model, x)(x), want, rtol=1e-5, atol=1e-6)


def test_a_submodule_hooked_or_replaced_after_fuse_makes_its_module_run_its_own_forward():
    # (found by a hostile pass: a LoRA-style wrapper put in a fused-away projection's place was
    # passed by, and a norm replaced by nn.Identity failed in the fused code)
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x, r):
            return self.down(F.gelu(self.up(self.norm(x + r))))

    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 0.5

    torch.manual_seed(0)
    model, x, r = Block().to(DEVICE), rand((4, 8), torch.float32, DEVICE), rand((4, 8), torch.float32, DEVICE)
    fusedkit.fuse(model, x, r)
    assert {s.pattern for s in model.fusion_sites} == {"add -> layer_norm", "linear -> gelu"}
    own = lambda: Block.forward(model, x, r)
    seen = []
    handle = model.up.register_forward_hook(lambda m, args, out: seen.append("up"))
    with pytest.warns(UserWarning, match="runs its own forward while that lasts"):
        torch.testing.assert_close(model(x, r), own())
    assert seen == ["up", "up"]  # (the fused forward fell back: the hook saw the call)
    handle.remove()
    model(x, r)
    assert seen == ["up", "up"]  # (fused again)
    stock_up = model.up
    model.up = Shifted(8, 16).to(DEVICE)
    model.up.load_state_dict(stock_up.state_dict())
    torch.testing.assert_close(model(x, r), own())  # (the wrapper's + 0.5 included)
    model.up = stock_up
    model.norm = nn.Identity()
    torch.testing.assert_close(model(x, r), own())
    with torch.nn.modules.module.register_module_forward_hook(lambda *a: seen.append("global")):
        model(x, r)
    assert "global" in seen


def test_a_foreign_rms_norm_on_float64_rows_is_left_as_it_computes_them_in_float32():
    # (LLaMA's RMSNorm upcasts to float32 only: fused in float64 it differed past float64's
    # tolerance, and fuse refused the whole model; found by a hostile pass)
    class CopiedRMSNorm(nn.Module):
        def __init__(self, n, eps=1e-6):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(n)), eps

        def forward(self, hidden_states):
            dtype = hidden_states.dtype
            hidden_states = hidden_states.to(torch.float32)
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = CopiedRMSNorm(8)

        def forward(self, x, r):
            return self.norm(x + r)

    x, r = rand((4, 8), torch.float32, DEVICE), rand((4, 8), torch.float32, DEVICE)
    assert [s.pattern for s in fusedkit.advise(Block().to(DEVICE), x, r)] == ["add -> rms_norm"]
    model = Block().to(DEVICE).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fusedkit.fuse(model, x.double(), r.double())
    assert model.fusion_sites == []
    assert "computes float64 rows in float32" in " ".join(str(w.message) for w in caught)


def test_a_linear_layer_written_out_is_a_linear_site():
    # (Falcon's FalconLinear: ``input @ self.weight.T``, then ``+ self.bias`` where it has one:
    # that sum is left, since it promotes, a float32 bias keeping an autocast product float32)
    class WrittenOut(nn.Linear):
        def forward(self, input):
            h = input @ self.weight.T
            return h if self.bias is None else h + self.bias

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.mid = WrittenOut(8, 16, bias=False), WrittenOut(16, 16, bias=False)
            self.biased, self.down = WrittenOut(16, 16), WrittenOut(16, 8)

        def forward(self, x):
            h = F.gelu(self.up(x))
            h = torch.relu(h @ self.mid.weight.t())
            wt = self.mid.weight.T
            h = F.silu(self.biased(torch.relu(h @ wt) + h @ wt))  # (a transpose read twice; a bias: left)
            return self.down(h)

    torch.manual_seed(0)
    model, x = Net().to(DEVICE), rand((4, 8), torch.float32, DEVICE)
    want = model(x)
    sites = fusedkit.advise(model, x)
    assert [(s.pattern, s.module) for s in sites] == [("linear -> gelu", ""), ("linear -> relu", "")]
    fusedkit.fuse(model, x)
    code = fusion.fused_code(model)
    assert code.count("fusedkit_ops_matmul") == 2 and code.count(" @ ") == 4  # (h @ wt twice, biased's, down's)
    torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_fused_module_follows_changes_to_what_its_code_took_as_it_was():
    # (a second hostile pass: a forward set on the instance, as accelerate's offloading does; a
    # class swapped; a parameter that was None given one; a functional dropout's probability
    # changed; each in a deep copy alone; a first fallback inside torch.compile)
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.p = nn.Linear(8, 16, bias=False), nn.Linear(16, 8), 0.25

        def forward(self, x):
            return self.down(F.dropout(F.gelu(self.up(x)), self.p, training=self.training))

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model, x = Block().to(DEVICE), rand((4, 8), torch.float32, DEVICE)
    fusedkit.fuse(model, x)
    assert [s.pattern for s in model.fusion_sites] == ["linear -> gelu"]

    def agrees(m):
        torch.manual_seed(4)
        got = m(x)
        torch.manual_seed(4)
        torch.testing.assert_close(got, Block.forward(m, x))

    copied = copy.deepcopy(model)
    copied.up.forward = lambda h: 3 * nn.Linear.forward(copied.up, h)
    with pytest.warns(UserWarning, match="runs its own forward"):
        agrees(copied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the original is its own: fused, no warning)
        agrees(model)
    for change, undo in (
        (lambda: setattr(model.up, "__class__", Doubled), lambda: setattr(model.up, "__class__", nn.Linear)),
        (
            lambda: setattr(model.up, "bias", nn.Parameter(torch.ones(16, device=DEVICE))),
            lambda: setattr(model.up, "bias", None),
        ),
        (lambda: setattr(model, "p", 0.0), lambda: setattr(model, "p", 0.25)),
    ):
        change()
        model.train()
        with pytest.warns(UserWarning, match="runs its own forward"):
            agrees(model)
        model.eval()
        agrees(model)
        undo()
        agrees(model)  # (fused again: the next change warns again)
        assert not model.__dict__["_fusedkit_fused"][2].changed(model)
    handle = model.up.register_forward_hook(lambda m, args, out: out * 2)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # (no warning traced)
    torch.testing.assert_close(compiled(x), Block.forward(model, x))
    handle.remove()


def test_a_mode_set_apart_at_fuse_time_and_a_held_flag_are_followed():
    # (a third review: a dropout module evaluated inside a training block when fused gave one
    # code for both modes, without dropout; an int attribute the traced code holds, changed)
    class Drop(nn.Module):
        def forward(self, h):
            return F.dropout(h, 0.5, training=self.training)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.drop, self.k = nn.Linear(8, 16), nn.Linear(16, 8), Drop(), 2

        def forward(self, x):
            return self.down(self.drop(F.gelu(self.up(x))) * self.k)

    torch.manual_seed(0)
    model, x = Block().to(DEVICE).train(), rand((4, 8), torch.float32, DEVICE)
    model.drop.eval()
    fusedkit.fuse(model, x)

    def agrees():
        torch.manual_seed(5)
        got = model(x)
        torch.manual_seed(5)
        torch.testing.assert_close(got, Block.forward(model, x))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for train, drop_train in ((True, False), (True, True), (False, False)):
            model.train(train)
            model.drop.train(drop_train)
            agrees()
        model.k = 3
        agrees()
