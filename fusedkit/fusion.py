"""Where fusedkit would fuse a model, and the model with it fused: :func:`advise` and :func:`fuse`.

The model is traced with ``torch.fx`` (activation modules, fusedkit's own and any
submodule fx cannot trace through kept whole); each chain fusedkit has one kernel for is a
:class:`FusionSite`:

- ``add -> relu`` (``out += identity; relu(out)``, ``F.relu(a + b)``): ``fusedkit.add_relu``;
- ``linear -> act`` (``nn.Linear``, ``F.linear`` or ``torch.addmm``, then ReLU, GELU, tanh
  GELU or SiLU): ``fusedkit.matmul`` with the activation in its epilogue;
- ``gated mlp`` (``down(act(gate(x)) * up(x))``: three linear layers on one ``x`` around a SiLU
  or GELU gate, LLaMA's and Gemma's MLP): ``fusedkit.gated_mlp``;
- ``silu * mul`` / ``gelu * mul`` (any other SwiGLU or GeGLU gate, or one whose layers have
  hooks): ``fusedkit.silu_mul`` / ``fusedkit.gelu_mul``;
- ``add -> gelu`` (a bias or residual before a GELU): ``fusedkit.add_gelu``;
- ``add -> layer_norm`` / ``add -> rms_norm`` (a residual join and the norm that reads it:
  ``nn.LayerNorm``, ``nn.RMSNorm``, ``F.layer_norm``, ``F.rms_norm``, transformers'
  ``LlamaRMSNorm`` family): ``fusedkit.add_layer_norm`` / ``fusedkit.add_rms_norm``, whose
  ``h`` stands for the sum wherever else the residual stream goes;
- ``rms_norm`` (an RMSNorm computed by several ops, ``LlamaRMSNorm``): ``fusedkit.rms_norm``.

A chain qualifies when its first op's result has no other user (a residual join's sum may
have others: the fused call returns it). ``bytes_saved`` is what the
fused kernel does not move in one forward pass, by :class:`fusedkit.MemoryCounterMode`'s
model at the example inputs' shapes: every op of the chain's bytes, less those of the one op
whose reads and writes the fused kernel makes (the linear or the add; a gate's mul). For a
one-kernel activation that is the intermediate written and read back (twice its bytes); an
activation module computed by several ops (transformers' ``NewGELUActivation``: eight) saves
each of their round trips.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import operator
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.modules import module as _module_hooks
from torch.nn.utils import parametrize

from . import nn as fnn
from .dispatch import GATED_ACTIVATIONS, norm_dtype
from .errors import FusedkitError, SignatureError, TracingError
from .fusion_call import FIXED_TYPES, CallSpec
from .memory import MemoryCounterMode
from .ops import (
    add_gelu,
    add_layer_norm,
    add_relu,
    add_rms_norm,
    gated_mlp,
    gelu_mul,
    matmul,
    rms_norm,
    silu_mul,
)
from .registry import FLOAT_DTYPES, OPERAND_DTYPES, get
from .runtime.matmul import MATMUL_DTYPES, torch_activation

__all__ = ["FusionSite", "advise", "fuse", "unfuse"]

#: Activation modules of other libraries kept whole by the tracer, by class name, and the
#: activation each computes (transformers' GPT-2 ``gelu_new`` is ``NewGELUActivation``).
FOREIGN_ACTIVATIONS = {
    "NewGELUActivation": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "GELUActivation": "gelu",
    "SiLUActivation": "silu",
}
#: How an RMSNorm module of another library applies its weight, by module (:func:`_rms_norm_form`),
#: learnt again by each trace (a module changed between two ``fuse`` calls is probed again).
_RMS_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rms_norm_form(m: torch.nn.Module) -> tuple[str, str] | None:
    """``(form, eps attribute)`` of an RMSNorm module of another library (its class name ends in
    ``RMSNorm``; one parameter, ``weight``, no buffers or submodules): form "weight", ``weight *
    x / rms(x)`` (LLaMA's, copied by transformers under many class names), or "offset", ``(1 +
    weight) * x / rms(x)`` (Gemma's), with its eps in ``variance_epsilon`` or ``eps``; None where it
    is neither. Learnt from the module's own forward (hooks not run, autocast off) on rows of
    three scales, one near ``sqrt(eps)`` where the eps shows, in a 3-D input (a norm over
    another dim differs there)."""
    if not type(m).__name__.endswith("RMSNorm") or isinstance(m, torch.nn.RMSNorm):
        return None
    params = dict(m.named_parameters())
    weight = params.get("weight")
    attr = next((a for a in ("variance_epsilon", "eps") if isinstance(getattr(m, a, None), float)), None)
    if (
        list(params) != ["weight"]
        or next(m.buffers(), None) is not None
        or next(m.children(), None) is not None
        or weight.dim() != 1
        or not weight.is_floating_point()
        or weight.is_meta
        or attr is None
    ):
        return None
    eps = getattr(m, attr)
    x = torch.randn(3, 2, weight.shape[0], generator=torch.Generator().manual_seed(0))
    x = (x * torch.tensor([1.0, eps**0.5, 100.0]).view(3, 1, 1)).to(weight.device)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    try:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            out = type(m).forward(m, x).float()
    except Exception:  # (a forward of other arguments: not one of these)
        return None
    w = weight.detach().float()
    for form, want in (("weight", w * h), ("offset", (1 + w) * h)):
        if out.shape == want.shape and torch.allclose(out, want, rtol=1e-5, atol=0):
            return form, attr
    return None


_RELU_FUNCTIONS = (torch.relu, torch.relu_, F.relu)
_ADD_FUNCTIONS = (operator.add, torch.add)
_IN_PLACE_ADDS = (operator.iadd, torch.Tensor.add_)


@dataclass(frozen=True)
class FusionSite:
    """One chain of ops fusedkit runs as one kernel."""

    pattern: str  # e.g. "add -> relu"
    module: str  # the qualified name of the module holding it ("" for the model itself)
    bytes_saved: int  # per forward pass, at the example inputs' shapes
    replacement: str  # the fusedkit call that replaces it
    nodes: tuple = field(default=(), compare=False, repr=False)  # the traced graph's nodes, first to last


def _in_place_method(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


class _Proxy(fx.Proxy):
    """fx's proxy, tracing ``x += y`` (and the other augmented assignments) as the in-place op:
    fx's own falls back to ``x = x + y``, and a traced copy would no longer write ``x`` (the
    caller's tensor, where ``x`` is an input)."""


for _name_ in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"):
    setattr(_Proxy, f"__i{_name_}__", _in_place_method(getattr(operator, f"i{_name_}")))
del _name_


class _ObjectProxy(_Proxy):
    """A traced input that is no tensor (transformers' KV cache): ``isinstance`` sees the
    class of the call's object, so a branch on it goes the way the call went."""

    def __init__(self, node: fx.Node, tracer, cls: type):
        super().__init__(node, tracer)
        self._cls = cls

    @property
    def __class__(self):  # (isinstance reads it where the proxy's own type does not match)
        return self._cls


def _has_hooks(m: torch.nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own (``weight_norm``'s pre-hook, a
    user's): inlined or fused away, they would no longer run."""
    return any(
        getattr(m, attr, None)
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )


class _Tracer(fx.Tracer):
    """``torch.fx``'s tracer, keeping activation modules (ours and transformers') whole, and
    the submodules of the classes in ``whole``. An error raised inside a submodule's forward
    carries that submodule (``FAILED_IN``), the innermost one it passed through. With a
    ``call``, the root's forward is traced as that call made it (its inputs the
    placeholders, its fixed values as they were)."""

    def __init__(self, whole: frozenset = frozenset(), call: CallSpec | None = None):
        super().__init__()
        self.whole = whole
        self.call = call
        self.takers: dict[type, str] = {}  # classes kept whole as they take an object: its class

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        if self.call is None or not is_module:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        call = self.call
        inputs = []
        for name, cls in zip(call.names, call.classes):
            node = self.create_node("placeholder", name, (), {})
            inputs.append(self.proxy(node) if cls is torch.Tensor else _ObjectProxy(node, self, cls))

        def forward(root, *inputs):
            args, kwargs = call.rebuild(inputs)
            return root_fn(root, *args, **kwargs)

        return forward, [self.root, *inputs]

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return (
            type(m) in self.whole
            or type(m).__name__ in FOREIGN_ACTIVATIONS
            or _RMS_FORMS.get(m) is not None
            or isinstance(m, (fnn.LinearReLU, fnn.AddReLU, fnn.SwiGLU))
            or _has_hooks(m)
            or super().is_leaf_module(m, qualname)
        )

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        taken = _objects_in((args, kwargs))
        if taken:
            # an object argument (a KV cache) is handed on to a submodule that runs its own
            # forward: kept whole, as a module fx cannot trace through is
            self.takers[type(m)] = taken[0]
            return self.create_proxy("call_module", self.path_of_module(m), args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, FAILED_IN):  # (the innermost module sees the error first)
                setattr(exc, FAILED_IN, m)
            raise


def _objects_in(values) -> list[str]:
    """The classes of the object inputs (:class:`_ObjectProxy`) among ``values``."""
    leaves = torch.utils._pytree.tree_leaves(values)
    return [v.__class__.__name__ for v in leaves if isinstance(v, _ObjectProxy)]


#: The attribute of a tracing error naming the submodule it was raised in.
FAILED_IN = "_fusedkit_failed_in"


def _forward_params(model) -> list | None:
    """The parameters of the forward fx traces (the class's, without ``self``; a function's
    own), or None where Python cannot tell them."""
    module = isinstance(model, torch.nn.Module)
    try:
        return list(inspect.signature(type(model).forward if module else model).parameters.values())[module:]
    except (TypeError, ValueError):
        return None


def _concrete_args(model, example_inputs) -> dict:
    """The arguments the trace fixes: those the example call passes as None and those it
    leaves at a default that is no tensor (``forward(x, residual=None)`` traced as called,
    where a proxy for ``residual`` would take the ``is not None`` branch)."""
    fixed = {}
    for i, p in enumerate(_forward_params(model) or ()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if i < len(example_inputs):
            if example_inputs[i] is None:
                fixed[p.name] = None
        elif p.default is not p.empty and not isinstance(p.default, torch.Tensor):
            fixed[p.name] = p.default
    return fixed


def _title(model) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", repr(model))


def _trace(
    model, whole: frozenset = frozenset(), concrete: dict | None = None, call: CallSpec | None = None
) -> tuple[fx.GraphModule, frozenset]:
    """The traced model, and the classes of the submodules kept whole. A submodule fx cannot
    trace through (transformers' GPT-2 attention iterates over a shape) is kept whole, a
    ``call_module`` node, with every module of its class (one retrace per class, not per
    layer), and traced around: their ops are not searched (the warning of :func:`advise` and :func:`fuse` says so).
    ``whole``: classes to keep whole from the start; ``call``: the call traced (a module's)."""
    whole = set(whole)
    if isinstance(model, torch.nn.Module):  # (learnt before the trace: fx makes parameters proxies in it)
        for m in model.modules():
            _RMS_FORMS[m] = _rms_norm_form(m)
    while True:
        tracer = _Tracer(frozenset(whole), call)
        try:
            graph = tracer.trace(model, concrete or None)
            break
        except Exception as exc:  # data-dependent control flow, unsupported Python: fx's own errors
            failed = getattr(exc, FAILED_IN, None)
            if failed is not None and failed is not model and type(failed) not in whole:
                whole.add(type(failed))
                continue
            raise TracingError(
                f"torch.fx cannot trace {_title(model)}: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''} (advise and fuse read the traced "
                "graph; pass a submodule that traces, e.g. the MLP)"
            ) from exc
    gm = fx.GraphModule(tracer.root, graph, _title(model))
    gm.meta["takers"] = tracer.takers
    return gm, frozenset(whole | set(tracer.takers))


def _activation(node: fx.Node, modules: dict) -> str | None:
    """The activation ``node`` computes on its first argument ("relu", "gelu", "gelu_tanh",
    "silu"), or None."""
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, torch.nn.ReLU):
            return "relu"
        if isinstance(m, torch.nn.GELU):
            return "gelu" if m.approximate == "none" else "gelu_tanh"
        if isinstance(m, torch.nn.SiLU):
            return "silu"
        return FOREIGN_ACTIVATIONS.get(type(m).__name__)
    if node.op == "call_function":
        if node.target in _RELU_FUNCTIONS:
            return "relu"
        if node.target is F.gelu:
            return "gelu" if node.kwargs.get("approximate", "none") == "none" else "gelu_tanh"
        if node.target is F.silu:
            return "silu"
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return "relu"
    return None


def _arg(node: fx.Node, index: int, name: str, default=None):
    """A call's argument by position or keyword."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _fresh(value, node: fx.Node) -> bool:
    """Whether ``value`` is an intermediate only ``node`` uses: an in-place op on it changes
    nothing anyone else sees (not an input, a parameter, or a tensor used again)."""
    return (
        isinstance(value, fx.Node)
        and value.op in ("call_function", "call_method", "call_module")
        and len(value.users) == 1
    )


def _add_operands(node: fx.Node):
    """``(x, y, alpha)`` of an elementwise add node, or None. An in-place add qualifies when
    its target is a fresh intermediate (the fused result replaces it)."""
    if node.op == "call_function" and node.target in (*_ADD_FUNCTIONS, *_IN_PLACE_ADDS):
        if set(node.kwargs) - {"other", "alpha"} or len(node.args) + len(node.kwargs) < 2:
            return None
        x = _arg(node, 0, "input")
        if node.target in _IN_PLACE_ADDS and not _fresh(x, node):
            return None  # (``x += r`` on an input or a tensor used again: the fused call would not write it)
        return x, _arg(node, 1, "other"), node.kwargs.get("alpha", 1)
    if node.op == "call_method" and node.target in ("add", "add_") and not set(node.kwargs) - {"other", "alpha"}:
        x, y = node.args[0], _arg(node, 1, "other")
        if y is None or (node.target == "add_" and not _fresh(x, node)):
            return None
        return x, y, node.kwargs.get("alpha", 1)
    return None


def _shape(value):
    meta = value.meta.get("tensor_meta") if isinstance(value, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _transposed_weight(node) -> fx.Node | None:
    """The 2-D parameter ``node`` is the transpose of (``w.T``, ``w.t()``), used only there; else None."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] == ("T",):
        w = node.args[0]
    elif node.op == "call_method" and node.target == "t" and len(node.args) == 1:
        w = node.args[0]
    else:
        return None
    shape = _shape(w)
    return w if isinstance(w, fx.Node) and w.op == "get_attr" and shape is not None and len(shape) == 2 else None


def _matmul_by_transpose(node: fx.Node):
    """``(x, w)`` of ``x @ w.T`` (``operator.matmul`` or ``torch.matmul``: a linear layer written
    out, as Falcon's ``FalconLinear`` is), ``w`` a 2-D parameter; else None."""
    if node.op != "call_function" or node.target not in (operator.matmul, torch.matmul) or node.kwargs:
        return None
    if len(node.args) != 2:
        return None
    w = _transposed_weight(node.args[1])
    return None if w is None else (node.args[0], w)


def _linear_parts(node: fx.Node) -> tuple:
    """The node besides ``node`` that a written-out linear layer's site replaces (the weight's
    transpose); none for the other forms."""
    return (node.args[1],) if _matmul_by_transpose(node) is not None else ()


def _linear_operands(node: fx.Node, modules: dict):
    """``(x, weight_or_attr, bias_or_attr, transposed)`` of a linear layer node that
    ``fusedkit.matmul`` takes (a 2-D weight, a bias of one value per output), or None: an
    ``nn.Linear`` (its weight is read transposed), ``F.linear``, a plain ``torch.addmm``, or a
    linear layer written out without a bias, ``x @ w.T``. (With ``+ b`` after it, the sum
    promotes: a float32 bias keeps an autocast product float32, where the fused call's result
    is autocast's dtype; that form is left.)"""
    written = _matmul_by_transpose(node)
    if written is not None:
        return written[0], written[1], None, True
    if (
        node.op == "call_module"
        and type(modules[node.target]) is torch.nn.Linear
        and "forward" not in vars(modules[node.target])  # (a forward set on the instance runs as itself)
    ):
        m = modules[node.target]
        x = _arg(node, 0, "input")  # (``self.lin(input=x)``)
        return x, f"{node.target}.weight", f"{node.target}.bias" if m.bias is not None else None, True
    if node.op == "call_function" and node.target is F.linear:
        x, w, b = _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")
        ws, bs = _shape(w), _shape(b)
        if ws is None or len(ws) != 2 or (b is not None and bs != ws[:1]):
            return None
        return x, w, b, True
    if node.op == "call_function" and node.target is torch.addmm and not node.kwargs and len(node.args) == 3:
        bias, x, w = node.args
        ws, bs = _shape(w), _shape(bias)
        if ws is None or bs != ws[1:]:
            return None
        return x, w, bias, False
    return None


@dataclass(frozen=True)
class _Norm:
    """A normalisation node as fusedkit's norm takes it: ``weight`` and ``bias`` as qualified
    attribute names (or None), ``eps`` a number or None (torch's default)."""

    rms: bool
    x: fx.Node
    shape: tuple
    weight: str | None
    bias: str | None
    eps: float | None
    composed: bool  # computed by several ops (a module of other code): fused alone, it saves bytes
    eps_attr: str | None = None  # the module's own eps, read when the fused code runs
    offset: bool = False  # the weight applied as ``1.0 + weight.float()`` (Gemma's)


def _norm(node: fx.Node, modules: dict) -> _Norm | None:
    """The normalisation ``node`` computes, or None: ``nn.LayerNorm`` and ``nn.RMSNorm`` (their
    own forwards), other libraries' RMSNorm modules (:func:`_rms_norm_form`), ``F.layer_norm`` and
    ``F.rms_norm`` on parameters (or none) and a constant ``eps``."""
    if node.op == "call_module":
        m = modules[node.target]
        if parametrize.is_parametrized(m):
            return None
        x = _arg(node, 0, "input", _arg(node, 0, "hidden_states"))
        weight = f"{node.target}.weight" if getattr(m, "weight", None) is not None else None
        if isinstance(m, torch.nn.LayerNorm) and type(m).forward is torch.nn.LayerNorm.forward:
            bias = f"{node.target}.bias" if m.bias is not None else None
            return _Norm(False, x, tuple(m.normalized_shape), weight, bias, m.eps, False, f"{node.target}.eps")
        if isinstance(m, torch.nn.RMSNorm) and type(m).forward is torch.nn.RMSNorm.forward:
            return _Norm(True, x, tuple(m.normalized_shape), weight, None, m.eps, False, f"{node.target}.eps")
        form = _RMS_FORMS.get(m)
        if form is not None and len(node.args) + len(node.kwargs) == 1:  # (x alone, as probed)
            shape, eps = tuple(m.weight.shape), float(getattr(m, form[1]))
            return _Norm(True, x, shape, weight, None, eps, True, f"{node.target}.{form[1]}", form[0] == "offset")
        return None
    if node.op == "call_function" and node.target in (F.layer_norm, torch.layer_norm, F.rms_norm, torch.rms_norm):
        rms = node.target in (F.rms_norm, torch.rms_norm)
        x, shape, weight = _arg(node, 0, "input"), _arg(node, 1, "normalized_shape"), _arg(node, 2, "weight")
        bias = None if rms else _arg(node, 3, "bias")
        eps = _arg(node, 3 if rms else 4, "eps", None if rms else 1e-5)
        attrs = [
            None if a is None else a.target if isinstance(a, fx.Node) and a.op == "get_attr" else False
            for a in (weight, bias)
        ]
        if False in attrs or not isinstance(eps, (int, float, type(None))) or isinstance(shape, fx.Node):
            return None
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return _Norm(rms, x, shape, attrs[0], attrs[1], eps, False)
    return None


def _norm_refusal(norm: _Norm, node: fx.Node, h_dtype) -> str | None:
    """Why fusedkit's norm would not stand in for ``node``: an input dtype it does not take, or
    another result dtype (a foreign RMSNorm returns its weight's and input's promoted dtype)."""
    if h_dtype not in FLOAT_DTYPES:
        return f"fusedkit's norms do not take {h_dtype} input"
    if norm.composed and h_dtype == torch.float64:
        # (LLaMA's RMSNorm, and its copies, upcast to float32 only: float64 rows in float32)
        return "it computes float64 rows in float32, where fusedkit's norm computes them in float64"
    want, ours = _dtype(node), norm_dtype(h_dtype, node.meta.get("device", "cpu"), norm.rms)
    if want is not None and want != ours:
        return f"it returns {want} where fusedkit's norm gives {ours}"
    return None


def _in_place(node: fx.Node, modules: dict) -> bool:
    """Whether an activation node writes its input (``inplace=True``, ``relu_``)."""
    if node.op == "call_module":
        return bool(getattr(modules[node.target], "inplace", False))
    return node.kwargs.get("inplace", False) or node.target in (torch.relu_, "relu_")


def _only_user(node: fx.Node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _owner(node: fx.Node) -> list[str]:
    """The qualified name of the module ``node`` runs in, as parts (its values: the keys of a
    module called twice carry fx's ``@1`` suffix)."""
    stack = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module":
        stack = [p for p in stack if p != node.target]
    return stack[-1].split(".") if stack else []


def _common_module(*nodes: fx.Node) -> str:
    paths = [_owner(n) for n in nodes]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


class _Propagate(ShapeProp):
    """``ShapeProp``, keeping also the modelled bytes each node's ops move (``meta["bytes"]``)."""

    def run_node(self, n: fx.Node):
        with MemoryCounterMode(display=False) as counter:
            result = super().run_node(n)
        n.meta["bytes"] = counter.get_total_bytes()
        if isinstance(result, torch.Tensor):
            n.meta["device"] = result.device.type
        return result


def _bytes_saved(nodes: tuple, kept: fx.Node) -> int:
    """What fusing ``nodes`` saves: all their bytes but those of ``kept``, the op whose reads
    and writes the fused kernel makes."""
    return sum(n.meta.get("bytes", 0) for n in nodes) - kept.meta.get("bytes", 0)


def _name(arg) -> str:
    """A call's argument as the replacement shows it: a node's name, a parameter's qualified
    name, or a constant."""
    return arg.name if isinstance(arg, fx.Node) else arg if isinstance(arg, str) else repr(arg)


def _dtype(value):
    meta = value.meta.get("tensor_meta") if isinstance(value, fx.Node) else None
    return getattr(meta, "dtype", None)


def _refusal(pattern, call: str, kernel: str | None, operands, last: fx.Node, modules: dict, nodes) -> str | None:
    """Why ``fusedkit.<call>`` (the registry's ``kernel``; the matmul: None) would not take
    this site, or None: a module fused away that has hooks (they would stop firing), or
    operand dtypes the call refuses (advise lists only what fuse rewrites)."""
    for n in nodes:
        if n.op == "call_module" and _has_hooks(modules[n.target]):
            return f"{n.target} has hooks, which would no longer run"
    if pattern.startswith("linear"):
        dtype = _dtype(nodes[0])
        return None if dtype is None or dtype in MATMUL_DTYPES else f"fusedkit.matmul does not take {dtype}"
    for value in operands:
        dtype = _dtype(value)
        if dtype is not None and dtype not in OPERAND_DTYPES:
            return f"fusedkit.{call} does not take a {dtype} operand"
    result = _dtype(last)
    if result is not None and result not in get(kernel).dtypes:
        return f"fusedkit.{call} does not give {result} results"
    return None


def _find(gm: fx.GraphModule, declined: list) -> list[FusionSite]:
    """The sites of ``gm``; those fusedkit's call would not take go to ``declined`` as
    (pattern, module, why)."""
    modules = dict(gm.named_modules())
    sites, used = [], set()
    for node in gm.graph.nodes:
        if node in used:
            continue
        found = _norm_site(node, modules, used, declined)
        if found is not None:
            sites.append(found)
            used.update(found.nodes)
            continue
        user = _only_user(node)
        if user is None or user in used:
            continue
        # A linear layer on flattened rows whose result is viewed back before the activation
        # (transformers' Conv1D: addmm, then view): the view stays, the matmul takes the epilogue.
        linear = _linear_operands(node, modules)
        middle = (user,) if linear is not None and _is_reshape(user) else ()
        last = _only_user(user) if middle else user
        act = None if last is None else _activation(last, modules)
        add = _add_operands(node)
        site = None
        if linear is not None and act is not None and not _feeds_gate(last, act):
            x, w, b, transposed = linear
            then = f", then {user.name}" if middle else ""
            site = (
                f"linear -> {act}",
                f"fusedkit.matmul({_name(x)}, {_name(w)}{'.t()' if transposed else ''}, "
                f"{_name(b)}, activation={act!r}){then}",
            )
            call, kernel, operands = "matmul", None, (x,)
        elif middle:
            continue
        elif add is not None and act in ("relu", "gelu", "gelu_tanh"):
            x, y, alpha = add
            call = "add_relu" if act == "relu" else "add_gelu"
            extra = "" if act != "gelu_tanh" else ", approximate='tanh'"
            extra = (f", alpha={alpha!r}" if alpha != 1 else "") + extra
            site = (f"add -> {act}", f"fusedkit.{call}({_name(x)}, {_name(y)}{extra})")
            kernel = f"add_{act}" if act != "relu" else call  # (the registry's entry)
            operands = (x, y)
        elif act is None and _activation(node, modules) in ("silu", "gelu", "gelu_tanh") and _is_mul(user):
            gate = _activation(node, modules)
            other = user.args[1] if user.args[0] is node else user.args[0]
            if other is node or (_in_place(node, modules) and not _fresh(node.args[0], node)):
                continue  # (an in-place activation whose input is used again: the rewrite would not mutate it)
            gated = _gated_site(node, user, other, gate, modules)
            if gated is not None and not (used & set(gated.nodes)):
                sites.append(gated)
                used.update(gated.nodes)
                continue
            call = "silu_mul" if gate == "silu" else "gelu_mul"
            extra = ", approximate='tanh'" if gate == "gelu_tanh" else ""
            site = (f"{gate} * mul", f"fusedkit.{call}({_name(node.args[0])}, {_name(other)}{extra})")
            kernel = f"{gate}_mul"  # (the registry's entry)
            operands = (node.args[0], other)
        elif linear is None and act is not None and node.op == "call_module":
            if isinstance(modules[node.target], torch.nn.Linear):  # (a parametrized one's class is a subclass)
                declined.append((f"linear -> {act}", _common_module(node, last), f"{node.target} is parametrized"))
            continue
        if site is None:
            continue
        nodes = (node, *middle, last)
        why = _refusal(site[0], call, kernel, operands, last, modules, nodes)
        if why is not None:
            declined.append((site[0], _common_module(node, last), why))
            continue
        used.update(nodes)
        used.update(_linear_parts(node) if site[0].startswith("linear") else ())
        kept = last if site[0].endswith("* mul") else node
        sites.append(FusionSite(site[0], _common_module(node, last), _bytes_saved(nodes, kept), site[1], nodes))
    return sites


class _Gated(NamedTuple):
    """A gated MLP's parts (:func:`_gated_parts`): ``x``; the gate's, the up's and the down
    projection's ``(x, weight, bias, transposed)`` (:func:`_linear_operands`), the gate's and
    the up's with ``rows``, the slice of a stacked projection's output features each reads
    (None: a layer of its own); and the nodes the site replaces."""

    x: fx.Node
    gate: tuple
    up: tuple
    down: tuple
    rows: tuple
    nodes: tuple


def _gated_parts(act: fx.Node, mul: fx.Node, other, modules: dict) -> _Gated | None:
    """``down(act(gate(x)) * up(x))`` around the gate ``act * other`` (``mul``), as the models
    write it: the gate and up projections two linear layers on one ``x`` (LLaMA's MLP) or the
    halves of one (``chunk(2, dim=-1)``: timm's ``GluMlp``, Phi-3's ``gate_up_proj``), no-op
    modules between the product and the down projection (timm's ``Dropout(0)`` and
    ``Identity`` norm), each intermediate used only by the next op; None where any part
    differs."""
    down_lin, passes = mul, []
    while True:
        down_lin = _only_user(down_lin)
        if down_lin is None or not _no_op(down_lin, modules):
            break
        passes.append(down_lin)
    if not all(isinstance(n, fx.Node) for n in (act.args[0], other, down_lin)):
        return None
    down = _linear_operands(down_lin, modules)
    if down is None or down[0] is not (passes[-1] if passes else mul):
        return None
    halves = _halves(act.args[0], other, modules)
    if halves is not None:
        lin, chunk, parts, rows = halves
        nodes = (lin, chunk, act.args[0], other)
    else:
        parts = [_linear_operands(n, modules) for n in (act.args[0], other)]
        if None in parts or parts[0][0] is not parts[1][0]:
            return None
        rows, nodes = (None, None), (act.args[0], other)
    if _only_user(act.args[0]) is not act or _only_user(other) is not mul or not isinstance(parts[0][0], fx.Node):
        return None
    if _shape(act.args[0]) is None or not _shape(act.args[0]) == _shape(other) == _shape(mul):
        return None  # (a gate or up projection that broadcasts against the other)
    return _Gated(parts[0][0], parts[0], parts[1], down, rows, (*nodes, act, mul, *passes, down_lin))


def _no_op(node: fx.Node, modules: dict) -> bool:
    """A node the gated MLP may pass between its product and its down projection: an
    ``nn.Identity`` or an ``nn.Dropout`` without hooks (a dropout module is read as the fused
    call runs: :func:`gated_mlp_through`), or ``F.dropout`` of probability 0."""
    if node.op == "call_module":
        m = modules[node.target]
        return not _has_hooks(m) and type(m) in (torch.nn.Identity, torch.nn.Dropout)
    return node.op == "call_function" and node.target is F.dropout and _arg(node, 1, "p", 0.5) == 0


def gated_mlp_through(x, w_gate, w_up, w_down, *drops, activation, approximate, bias):
    """``fusedkit.gated_mlp`` where the dropout modules ``drops`` between its product and its down
    projection drop nothing now (probability 0, or eval mode: read as the call runs, so that a
    probability set after ``fuse`` holds); else the composition through them."""
    if all(d.p == 0 or not d.training for d in drops):
        return gated_mlp(x, w_gate, w_up, w_down, activation=activation, approximate=approximate, bias=bias)
    b_gate, b_up, b_down = bias or (None, None, None)
    act = GATED_ACTIVATIONS[(activation, approximate)]
    h = torch_activation(F.linear(x, w_gate, b_gate), act) * F.linear(x, w_up, b_up)
    for drop in drops:
        h = drop(h)
    return F.linear(h, w_down, b_down)


def _halves(gate_in, up_in, modules: dict):
    """``(linear, chunk, (gate_operands, up_operands), (gate_rows, up_rows))`` where the gate and
    up projections are the two halves of one ``nn.Linear``'s output (``chunk(2, dim=-1)``, in
    either order), or None."""
    picks = [n.args if isinstance(n, fx.Node) and n.target is operator.getitem else None for n in (gate_in, up_in)]
    if None in picks or picks[0][0] is not picks[1][0] or not all(type(p[1]) is int for p in picks):
        return None  # (items of one result, by int: not slices, lists)
    if sorted(p[1] for p in picks) != [0, 1]:
        return None
    chunk = picks[0][0]
    if not (
        isinstance(chunk, fx.Node)
        and (chunk.op, chunk.target) in (("call_method", "chunk"), ("call_function", torch.chunk))
    ):
        return None
    lin = _arg(chunk, 0, "input")
    if not (
        isinstance(lin, fx.Node)
        and _arg(chunk, 1, "chunks") == 2
        and _arg(chunk, 2, "dim", 0) in (-1, len(_shape(lin) or ()) - 1)
        and len(chunk.users) == 2
    ):
        return None
    operands = _linear_operands(lin, modules)
    out = _shape(lin)
    if operands is None or not operands[3] or _only_user(lin) is not chunk or not out or out[-1] % 2:
        return None  # (a weight stored (in, out), or an odd width: chunk's halves differ)
    half = out[-1] // 2
    rows = [slice(half * i, half * (i + 1)) for i in (picks[0][1], picks[1][1])]
    return lin, chunk, (operands, operands), tuple(rows)


def _gated_site(act: fx.Node, mul: fx.Node, other, gate: str, modules: dict) -> FusionSite | None:
    """A whole gated MLP around the gate ``act * other`` (``mul``; :func:`_gated_parts`) as one
    ``fusedkit.gated_mlp``; None where it is not one, or where ``gated_mlp`` would drop a hook
    or refuse a dtype (the gate alone is then fused). Its ``bytes_saved`` is the gate's: what
    the two GEMMs and the fused gate save, which ``gated_mlp`` runs past ``GATED_GEMM_MAX_M``
    rows (fewer rows save more: one GEMM writes neither projection for inference)."""
    parts = _gated_parts(act, mul, other, modules)
    if parts is None:
        return None
    if any(n.op == "call_module" and _has_hooks(modules[n.target]) for n in parts.nodes):
        return None
    if _dtype(parts.nodes[0]) not in MATMUL_DTYPES or _dtype(parts.nodes[-1]) not in MATMUL_DTYPES:
        return None
    order = {n: i for i, n in enumerate(act.graph.nodes)}
    nodes = tuple(sorted(parts.nodes, key=order.__getitem__))

    def rows(name, r):
        return name if r is None or name is None else f"{name}[{r.start}:{r.stop}]"

    projections = (parts.gate, parts.up, parts.down)
    weights = [f"{rows(_name(w), r)}{'' if t else '.t()'}" for (_, w, _, t), r in zip(projections, (*parts.rows, None))]
    biases = [rows(_name(b), r) if b is not None else None for (*_, b, _), r in zip(projections, (*parts.rows, None))]
    approximate = ", approximate='tanh'" if gate == "gelu_tanh" else ""
    bias = "" if biases == [None] * 3 else f", bias=({', '.join(map(str, biases))})"
    activation = "silu" if gate == "silu" else "gelu"
    replacement = (
        f"fusedkit.gated_mlp({_name(parts.x)}, {', '.join(weights)}, activation={activation!r}{approximate}{bias})"
    )
    where = _common_module(*nodes)
    return FusionSite(f"gated mlp ({gate})", where, _bytes_saved((act, mul), mul), replacement, nodes)


def _nbytes(node) -> int:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    if meta is None or not hasattr(meta, "shape"):
        return 0
    return math.prod(meta.shape) * meta.dtype.itemsize


def _attr_bytes(gm_modules: dict, name: str | None) -> int:
    if name is None:
        return 0
    owner, _, attr = name.rpartition(".")
    t = getattr(gm_modules[owner], attr, None)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _norm_site(node: fx.Node, modules: dict, used: set, declined: list) -> FusionSite | None:
    """``add -> norm`` (a residual join whose sum a norm reads: the sum's other users take
    the fused call's ``h``) or a norm computed by several ops alone (transformers' RMSNorm),
    as a site; one fusedkit's norm would not take goes to ``declined``."""
    add = _add_operands(node) if node.target not in (*_IN_PLACE_ADDS, "add_") else None
    if add is not None:
        x, y, alpha = add
        reads = ((u, _norm(u, modules)) for u in node.users if u not in used)
        norm_node, norm = next(((u, nm) for u, nm in reads if nm is not None and nm.x is node), (None, None))
        if norm_node is None or not all(isinstance(v, fx.Node) and _shape(v) == _shape(node) for v in (x, y)):
            return None
        nodes = (node, norm_node)
    else:
        norm = _norm(node, modules) if node.op == "call_module" else None
        if norm is None or not norm.composed:
            return None  # (a norm of one op already alone: nothing to save)
        nodes = (node,)
    kind = "rms_norm" if norm.rms else "layer_norm"
    pattern = f"add -> {kind}" if add is not None else kind
    where = _common_module(*nodes)
    hooked = [n.target for n in nodes if n.op == "call_module" and _has_hooks(modules[n.target])]
    why = (
        f"{hooked[0]} has hooks, which would no longer run"
        if hooked
        else _norm_refusal(norm, nodes[-1], _dtype(norm.x))
    )
    if why is None and add is not None and any(_dtype(v) not in FLOAT_DTYPES for v in (x, y)):
        why = "its operands are not all floating"
    if why is not None:
        declined.append((pattern, where, why))
        used.add(nodes[-1])  # (the norm alone would be declined for the same reason)
        return None
    weight = f"1.0 + {norm.weight}.float()" if norm.offset else norm.weight
    params = ", ".join(p for p in (weight, norm.bias if not norm.rms else None) if p) or "None"
    eps = "" if norm.eps is None else f", eps={norm.eps!r}"
    if add is not None:
        extra = f", alpha={alpha!r}" if alpha != 1 else ""
        extra += f", normalized_shape={list(norm.shape)}" if norm.weight is None and norm.bias is None else ""
        replacement = f"fusedkit.add_{kind}({_name(x)}, {_name(y)}, {params}{eps}{extra})"
    else:
        replacement = f"fusedkit.rms_norm({_name(norm.x)}, {list(norm.shape)}, {params}{eps})"
    # what the fused call does not move: the norm's reads of h and intermediates (the add's
    # own reads and write and the norm's output and parameters stay)
    minimal = _nbytes(nodes[-1]) + _attr_bytes(modules, norm.weight) + _attr_bytes(modules, norm.bias)
    saved = nodes[-1].meta.get("bytes", 0) - minimal - (_nbytes(norm.x) if add is None else 0)
    return FusionSite(pattern, where, max(saved, 0), replacement, nodes)


def _feeds_gate(act_node: fx.Node, act: str) -> bool:
    """Whether a SiLU or GELU feeds a mul: a gate's, which silu_mul / gelu_mul take (keeping less
    for the backward than the activation in the matmul's epilogue, saving the same bytes)."""
    return act in ("silu", "gelu", "gelu_tanh") and _is_mul(_only_user(act_node))


def _is_reshape(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in ("view", "reshape")) or (
        node.op == "call_function" and node.target is torch.reshape
    )


def _is_mul(node: fx.Node | None) -> bool:
    return node is not None and (
        (
            node.op == "call_function"
            and node.target in (operator.mul, torch.mul)
            and len(node.args) == 2
            and not node.kwargs
        )
        or (node.op == "call_method" and node.target == "mul" and len(node.args) == 2)
    )


@contextlib.contextmanager
def _mode(model: torch.nn.Module, training: bool):
    """``model`` in train or eval mode for a while; every submodule's own mode restored after
    (a function: nothing to set)."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, was in modes.items():
            m.train(was)


def _copies(inputs):
    """The example inputs (a tuple or a dict), tensors cloned: a model that writes its inputs
    in place leaves the caller's as they were, and every run sees the same values."""
    return torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, inputs)


def _run(model: torch.nn.Module, args, kwargs):
    """``model``'s output on copies of the example, in eval mode without gradients."""
    with _mode(model, False), torch.no_grad():
        return model(*_copies(args), **_copies(kwargs))


def _traced(
    model: torch.nn.Module, example_inputs, whole: frozenset = frozenset(), call: CallSpec | None = None
) -> tuple[fx.GraphModule, list[FusionSite], frozenset]:
    """The traced model, its sites and the classes kept whole (``whole`` from the start);
    shapes are learnt by one run in eval mode without gradients, on copies of the inputs
    (batch statistics, the random stream and the inputs stay as they were). A module is
    traced from ``call``, a function from ``example_inputs``; ``gm.meta["output"]`` is the
    structure of what the traced code returns."""
    if call is None:
        gm, whole = _trace(model, whole, _concrete_args(model, example_inputs))
        inputs = _copies(example_inputs)
    else:
        gm, whole = _trace(model, whole, call=call)
        inputs = _call_inputs(model, gm, call)
    with _mode(model, False), torch.no_grad():
        try:
            gm.meta["output"] = _structure(_Propagate(gm).propagate(*inputs))
        except Exception as exc:  # (the traced code on the example: fx's own limits, not the model's)
            raise TracingError(
                f"{_title(model)}: its traced code failed on the example: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"
            ) from exc
    declined = []
    sites = _find(gm, declined)
    gm.meta["declined"] = declined
    return gm, sites, whole


def _call_inputs(model, gm: fx.GraphModule, call: CallSpec) -> list:
    """Copies of ``call``'s inputs to run ``gm`` on (the objects deep copies: the attention
    updates a cache). ``TracingError`` where the traced code uses an object itself (a method
    call, an attribute: only a submodule kept whole may take it) or it cannot be copied."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = []
    for node, cls, value in zip(placeholders, call.classes, call.example):
        if cls is torch.Tensor:
            inputs.append(value.clone())
            continue
        if any(user.op != "call_module" for user in node.users):
            raise TracingError(
                f"{_title(model)}: its forward uses its {cls.__name__} argument {node.target!r} itself "
                "(fusedkit passes such an argument on to a submodule it keeps whole, and no further)"
            )
        try:
            inputs.append(copy.deepcopy(value))
        except Exception as exc:
            raise TracingError(f"{_title(model)}: its {cls.__name__} argument cannot be copied: {exc}") from None
    return inputs


def _structure(value):
    """The containers, their classes and keys, and the tensors' places in a returned value."""
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_structure(v) for v in value)
    if isinstance(value, dict):
        return type(value), tuple((k, _structure(v)) for k, v in value.items())
    return type(value)


def _declined(gm: fx.GraphModule) -> list[str]:
    """The chains :func:`_find` left in ``gm``, and why, as the warning lists them."""
    return [f"{pattern} in {module or '(its forward)'}: {why}" for pattern, module, why in gm.meta["declined"]]


def _rewrite_norm(gm: fx.GraphModule, site: FusionSite) -> None:
    """An ``add -> norm`` site becomes one ``add_*_norm`` call after the add (its ``h`` for the
    sum's other users, ``y`` for the norm's); a composed norm one ``rms_norm`` call."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    *add, norm_node = site.nodes
    norm = _norm(norm_node, modules)
    with graph.inserting_before(add[0].next if add else norm_node):  # (nodes in the order made)
        weight = graph.get_attr(norm.weight) if norm.weight else None
        if norm.offset:  # (Gemma's weight, as its forward makes it: a tiny tensor a call)
            weight = graph.call_function(operator.add, (1.0, graph.call_method("float", (weight,))))
        bias = graph.get_attr(norm.bias) if norm.bias else None
        # (a module's eps read as the code runs: one changed after fuse holds; through getattr on
        # the module, as fx's get_attr is for modules, parameters and buffers, not numbers)
        eps = norm.eps
        if norm.eps_attr:
            owner, attr = norm.eps_attr.rsplit(".", 1)
            eps = graph.call_function(getattr, (graph.get_attr(owner), attr))
        eps = {"eps": eps}
        if add:
            x, y, alpha = _add_operands(add[0])
            kw = {**eps, "alpha": alpha, "normalized_shape": norm.shape}
            if norm.rms:
                new = graph.call_function(add_rms_norm, (x, y, weight), kw)
            else:
                new = graph.call_function(add_layer_norm, (x, y, weight, bias), kw)
            out = graph.call_function(operator.getitem, (new, 0))
            h = graph.call_function(operator.getitem, (new, 1))
            out.meta, h.meta = dict(norm_node.meta), dict(add[0].meta)
        else:
            out = graph.call_function(rms_norm, (norm.x, norm.shape, weight), eps)
            out.meta = dict(norm_node.meta)
    norm_node.replace_all_uses_with(out)
    graph.erase_node(norm_node)
    if add:
        add[0].replace_all_uses_with(h)
        graph.erase_node(add[0])


def _rewrite_gated(gm: fx.GraphModule, site: FusionSite) -> None:
    """A gated MLP's nodes (:func:`_gated_site`) as one ``fusedkit.gated_mlp`` call."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    mul = next(n for n in site.nodes if _is_mul(n))  # (the product: the activation is one operand)
    act, other = sorted(mul.args, key=lambda n: _activation(n, modules) is None)
    gate, parts = _activation(act, modules), _gated_parts(act, mul, other, modules)
    with graph.inserting_before(parts.nodes[-1]):
        operands = []
        for (_, w, b, transposed), rows in zip((parts.gate, parts.up, parts.down), (*parts.rows, None)):
            w = graph.get_attr(w) if isinstance(w, str) else w
            b = graph.get_attr(b) if isinstance(b, str) else b
            if rows is not None:  # (a half of a stacked projection: views of its weight and bias)
                w = graph.call_function(operator.getitem, (w, rows))
                b = None if b is None else graph.call_function(operator.getitem, (b, rows))
            operands.append((w if transposed else graph.call_method("t", (w,)), b))
        biases = tuple(b for _, b in operands)
        kwargs = {
            "activation": "silu" if gate == "silu" else "gelu",
            "approximate": "tanh" if gate == "gelu_tanh" else "none",
            "bias": None if biases == (None, None, None) else biases,
        }
        # (dropout modules passed over are read as the fused call runs)
        drops = [
            graph.get_attr(n.target)
            for n in parts.nodes
            if n.op == "call_module" and type(modules[n.target]) is torch.nn.Dropout
        ]
        call = gated_mlp_through if drops else gated_mlp
        new = graph.call_function(call, (parts.x, *(w for w, _ in operands), *drops), kwargs)
    new.meta = dict(parts.nodes[-1].meta)
    parts.nodes[-1].replace_all_uses_with(new)
    for n in reversed(parts.nodes):
        graph.erase_node(n)


def _rewrite(gm: fx.GraphModule, site: FusionSite) -> None:
    if "norm" in site.pattern:
        _rewrite_norm(gm, site)
        return
    if site.pattern.startswith("gated"):
        _rewrite_gated(gm, site)
        return
    first, *middle, last = site.nodes
    modules = dict(gm.named_modules())
    graph = gm.graph
    parts = _linear_parts(first) if site.pattern.startswith("linear") else ()
    with graph.inserting_before(middle[0] if middle else last):
        if site.pattern.startswith("linear"):
            x, w, b, transposed = _linear_operands(first, modules)
            w = graph.get_attr(w) if isinstance(w, str) else w
            b = graph.get_attr(b) if isinstance(b, str) else b
            if transposed:
                w = graph.call_method("t", (w,))
            new = graph.call_function(matmul, (x, w, b), {"activation": site.pattern.split(" -> ")[1]})
        elif site.pattern.startswith("add"):
            x, y, alpha = _add_operands(first)
            act = site.pattern.split(" -> ")[1]
            if act == "relu":
                new = graph.call_function(add_relu, (x, y), {"alpha": alpha})
            else:
                new = graph.call_function(
                    add_gelu, (x, y), {"alpha": alpha, "approximate": "tanh" if act == "gelu_tanh" else "none"}
                )
        else:
            other = last.args[1] if last.args[0] is first else last.args[0]
            if site.pattern.startswith("silu"):
                new = graph.call_function(silu_mul, (first.args[0], other))
            else:
                approximate = "tanh" if site.pattern.startswith("gelu_tanh") else "none"
                new = graph.call_function(gelu_mul, (first.args[0], other), {"approximate": approximate})
    if middle:  # the view now reads the fused result, and stands for the activation's
        (view,) = middle
        new.meta = dict(first.meta)
        view.replace_input_with(first, new)
        last.replace_all_uses_with(view)
    else:
        new.meta = dict(last.meta)
        last.replace_all_uses_with(new)
    graph.erase_node(last)
    graph.erase_node(first)
    for part in parts:  # (a written-out linear layer's transpose, now unread)
        if not part.users:
            graph.erase_node(part)


#: How far the fused model's outputs may be from the original's, by dtype: a few roundings of
#: each fused op, compounded over the layers after it.
FUSE_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4, torch.float64: 1e-10}
#: Of a deep model's outputs, the share that may fall outside ``FUSE_TOLERANCE`` (none by more
#: than ``FUSE_OUTLIER`` times it): a fused op rounds once where eager rounds after each op, and
#: over 16 bf16 LLaMA layers that moved 2,191 of 65.5 million logits past 0.05 (the largest by
#: 0.086), where a wrong fusion (an eps, a weight, a sign) moves most of them.
FUSE_OUTLIERS = 1e-3
FUSE_OUTLIER = 16


def _fused_graph(model: torch.nn.Module, call: CallSpec, returned) -> tuple[fx.GraphModule, list, list, frozenset]:
    """``model`` traced from ``call`` in both modes, its sites rewritten: (graph, sites, notes,
    the classes kept whole), notes saying what it keeps whole and leaves unfused. Where its
    forward reads ``self.training`` itself (functional dropout: OPT's, Falcon's, Bloom's
    decoder layers), the graph of the other mode, fused alike, is ``gm.meta["other mode"]``.
    ``TracingError`` where it does not trace, where the traced code returns other than the
    module did (``returned``, by :func:`_structure`: fx makes a ``ModelOutput`` a dict), or
    where the two modes' codes differ in their sites."""
    with _mode(model, model.training):  # (every submodule in one mode: a mode's code is the mode's)
        gm, sites, whole = _traced(model, None, call=call)
    with _mode(model, not model.training):
        other, both = _trace(model, whole, call=call)
    if both != whole:
        # (a submodule that traces in one mode only: the tracer's limit, not a forward
        # reading self.training; kept whole in both)
        with _mode(model, model.training):
            gm, sites, whole = _traced(model, None, both, call)
        with _mode(model, not model.training):
            other, _ = _trace(model, whole, call=call)
    if gm.meta["output"] != returned:
        got, want = _kind(gm.meta["output"]), _kind(returned)
        raise TracingError(f"{_title(model)}: its traced forward returns {got} where it returned {want}")
    gm.meta["other mode"] = None
    if other.code != gm.code:  # (it reads self.training outside a module: one code a mode)
        with _mode(model, not model.training):
            other, other_sites, _ = _traced(model, None, whole, call)
        if [(s.pattern, s.module) for s in other_sites] != [(s.pattern, s.module) for s in sites]:
            raise TracingError(
                f"{type(model).__name__}'s forward reads self.training outside a module, and its "
                "train and eval codes have different sites"
            )
        for site in other_sites:
            _rewrite(other, site)
        other.graph.lint()
        other.recompile()
        gm.meta["other mode"] = other
    for site in sites:
        _rewrite(gm, site)
    gm.graph.lint()
    gm.recompile()
    takers = gm.meta["takers"]
    notes = _declined(gm) + [
        f"{cls.__name__} kept whole ("
        + (f"it takes the {takers[cls]} argument" if cls in takers else "torch.fx cannot trace through it")
        + ")"
        for cls in sorted(whole, key=str)
    ]
    return gm, sites, notes, whole


def _snapshot(value):
    """``value`` with its objects (neither tensors nor fixed values) deep-copied, where they copy."""
    if isinstance(value, torch.Tensor) or type(value) in FIXED_TYPES:
        return value
    if type(value) in (tuple, list):
        return type(value)(_snapshot(v) for v in value)
    if type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:  # (one that does not copy: _call_inputs says so if a trace needs it)
        return value


def _kind(structure) -> str:
    cls = structure[0] if isinstance(structure, tuple) else structure
    return "a dict" if cls is fx.immutable_collections.immutable_dict else cls.__name__


def _record_calls(model: torch.nn.Module, args, kwargs) -> tuple[dict, dict, object]:
    """The first call of every module in one run of ``model`` (eval mode, no gradients, copies
    of the inputs), the structure of what each returned, and the model's output."""
    calls, returned = {}, {}

    def before(module, a, k):
        if module not in calls:  # (its objects as they are now: a KV cache fills as the run goes on)
            calls[module] = (_snapshot(a), _snapshot(k))

    def after(module, a, out):
        returned.setdefault(module, _structure(out))

    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(after) for m in model.modules()]
    try:
        out = _run(model, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, returned, out


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # (never called: their items are)


def _plan(model: torch.nn.Module, example_inputs, example_kwargs) -> tuple[list, list, object]:
    """Where fusedkit fuses ``model``: (plans: (qualified name, module, graph, sites, call) of the
    outermost modules that trace and have sites, notes: what stays unfused and why, the
    model's output on the example). A module that does not trace (the model included) is
    looked into: its children are planned from their own calls in the example run."""
    calls, returned, out = _record_calls(model, example_inputs, example_kwargs)
    plans, notes = [], []
    leaf = _Tracer()

    def visit(name: str, m: torch.nn.Module) -> None:
        if m is not model and leaf.is_leaf_module(m, name) and not isinstance(m, _CONTAINERS):
            return  # (torch.nn's own layers, activations: nothing inside to fuse)
        call = calls.get(m)
        if call is not None:
            try:
                spec = CallSpec.of(m, *call)
                gm, sites, kept, whole = _fused_graph(m, spec, returned.get(m))
            except TracingError as exc:
                why = str(exc).removeprefix("torch.fx cannot trace ").split(" (advise and fuse")[0]
                notes.append((type(m).__name__, why.removeprefix(f"{type(m).__name__}: ")))
            else:
                notes.extend((type(m).__name__, note) for note in kept)
                if sites:
                    plans.append((name, m, gm, sites, spec))
                # the modules it kept whole run their own forwards: look into them (the outermost)
                inside = [(n, sub) for n, sub in m.named_modules() if type(sub) in whole and sub is not m]
                for n, sub in inside:
                    if not any(n.startswith(f"{other}.") for other, _ in inside):
                        visit(f"{name}.{n}" if name else n, sub)
                return
        for child, sub in m.named_children():
            visit(f"{name}.{child}" if name else child, sub)

    visit("", model)
    return plans, notes, out


def _qualified(name: str, site: FusionSite) -> FusionSite:
    module = ".".join(p for p in (name, site.module) if p)
    return dataclasses.replace(site, module=module, nodes=())


def _warn_unfused(model, notes: list) -> None:
    """One warning: for each class, what fusedkit could not fuse in its forward and why (its
    submodules were looked into), with how many modules it concerns."""
    if notes:
        counts = collections.Counter(notes)
        listed = "; ".join(f"{cls} ({n}x): {why}" if n > 1 else f"{cls}: {why}" for (cls, why), n in counts.items())
        warnings.warn(f"fusedkit left parts of {_title(model)} unfused: {listed}", stacklevel=3)


def advise(model, *example_inputs, **example_kwargs) -> list[FusionSite]:
    """The chains of ``model`` that fusedkit runs as one kernel (see the module's docstring),
    with the bytes each saves at the example inputs' shapes, module by module in the order
    the modules are planned, each module's in the order they run. Runs the model once on the
    example (under ``torch.no_grad``) to learn them. Where a module does not trace (the
    model included), its submodules are looked into, as :func:`fuse` does; one warning says
    what stays unfused and why. ``model`` may be a function."""
    if not callable(model):
        raise SignatureError(f"advise() takes a module or a function, got {type(model).__name__}")
    if not isinstance(model, torch.nn.Module):
        gm, sites, _ = _traced(model, example_inputs)
        _warn_unfused(model, [(_title(model), note) for note in _declined(gm)])
        return sites
    plans, notes, _ = _plan(model, example_inputs, example_kwargs)
    _warn_unfused(model, notes)
    return [_qualified(name, site) for name, _, _, sites, _ in plans for site in sites]


def _fused_forward(self, *args, **kwargs):
    # A call of the traced call's shape (fusion_call.CallSpec) runs the fused code on this
    # module itself: parameters, parametrizations and buffers are read where they live now;
    # unless a submodule the code does not call changed since (_Inlined).
    codes, traced_inputs, inlined = self.__dict__["_fusedkit_fused"]
    inputs = traced_inputs(args, kwargs)
    if inputs is not None and not inlined.changed(self):
        return codes[self.training](self, *inputs)
    return type(self).forward(self, *args, **kwargs)


#: The attribute types a traced forward reads as constants (its module's numbers, flags, names).
_HELD = (int, float, bool, str)


class _Inlined:
    """What a fused module's code took as it was when traced: its submodules that the code does
    not call as modules (traced through, or fused away: an MLP whose projections are one
    ``gated_mlp`` call, a norm), each with its class, its instance ``forward`` (none), which of
    its parameters were None, and its hook dicts; and the numbers the code may hold as
    constants (the module's and those submodules' numbers, flags and names: a functional dropout's
    probability). One of them replaced (an adapter's or a quantised layer in its place), given
    a hook, a ``forward`` (accelerate's offloading), another class or a parameter, or a number
    changed, or a global module hook set, would be passed by: the module then runs its own
    forward (:meth:`changed`), warning once a change, and its fused code again once undone."""

    __slots__ = (
        "subs", "classes", "hooks", "places", "names", "modules", "owners", "keys", "values", "nones", "warned", "modes"
    )  # fmt: skip

    def __init__(self, m: torch.nn.Module, gm: fx.GraphModule, modes: bool = False):
        called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        # modes: its code is one a mode (it reads self.training), which its inlined submodules'
        # modes must then follow (set apart, they would run in its mode)
        self.warned, self.modes = False, modes
        self.subs, self.classes, self.hooks, self.places, self.names, nones = [], [], [], [], [], []
        # Each check is a map() in C and a list comparison (about a microsecond a call for a
        # LLaMA layer). Entries: (module, key of its instance dict, value): a number, flag or
        # name, and its own forward (None).
        entries = [(m, k, v) for k, v in vars(m).items() if type(v) in _HELD and k != "training"]
        leaf = _Tracer()  # (a layer fx calls, fused away: its numbers are read as the fused call runs)
        for path, sub in m.named_modules(remove_duplicate=False):
            if not path or any(path == c or path.startswith(c + ".") for c in called):
                continue  # (m's own hooks run as it is called; a called module's are its own)
            parent, _, name = path.rpartition(".")
            self.subs.append(sub)
            self.classes.append(type(sub))
            self.places.append(m.get_submodule(parent)._modules)
            self.names.append(name)
            self.hooks += [sub._forward_pre_hooks, sub._forward_hooks, sub._backward_pre_hooks, sub._backward_hooks]
            entries.append((sub, "forward", vars(sub).get("forward")))
            if not leaf.is_leaf_module(sub, path):  # (traced through: its numbers became constants)
                entries += [(sub, k, v) for k, v in vars(sub).items() if type(v) in _HELD and k != "training"]
            nones += [(sub._parameters, k) for k, v in sub._parameters.items() if v is None]
        self.modules, self.keys, self.values = (list(t) for t in zip(*entries)) if entries else ([], [], [])
        self.owners = [vars(o) for o in self.modules]
        self.nones = [list(t) for t in zip(*nones)] if nones else [[], []]
        self.nones.append([None] * len(nones))

    def __deepcopy__(self, memo):
        # The dicts it holds (_modules, _parameters, hook dicts) are values in its modules'
        # instance dicts, which a deep copy of the model copies with their modules; the instance
        # dicts themselves it takes from the copied modules (a copy of them would be stale).
        copied = _Inlined.__new__(_Inlined)
        memo[id(self)] = copied
        for name in _Inlined.__slots__:
            setattr(copied, name, copy.deepcopy(getattr(self, name), memo) if name != "owners" else None)
        copied.owners = [vars(o) for o in copied.modules]
        return copied

    def changed(self, m: torch.nn.Module) -> bool:
        params, names, unset = self.nones
        same = (
            not any(self.hooks)
            and not _module_hooks._global_forward_hooks
            and not _module_hooks._global_forward_pre_hooks
            and not _module_hooks._global_backward_hooks
            and not _module_hooks._global_backward_pre_hooks
            and list(map(type, self.subs)) == self.classes
            and list(map(dict.get, self.places, self.names)) == self.subs
            and list(map(dict.get, self.owners, self.keys)) == self.values
            and list(map(dict.get, params, names)) == unset
        )
        if same and (not self.modes or all(sub.training is m.training for sub in self.subs)):
            if self.warned:
                self.warned = False  # (a later change warns again)
            return False
        if not self.warned and not torch.compiler.is_compiling():
            self.warned = True
            warnings.warn(
                f"fusedkit: a submodule of {type(m).__name__} that its fused forward does not call "
                "was replaced, changed (a hook, a forward of its own, its class, a parameter, a "
                "number the fused code holds) or set to another mode, or a global module hook is "
                "set: it runs its own forward while that lasts (call fusedkit.fuse again to fuse "
                "it as it is)",
                UserWarning,
                stacklevel=3,
            )
        return True


def _install(m: torch.nn.Module, gm: fx.GraphModule, call: CallSpec) -> None:
    """Run ``gm``'s code as ``m``'s forward for calls of ``call``'s shape, on ``m``: ``m``
    keeps its class, hooks and state dict keys. Constants fx made attributes of the traced
    copy become attributes of ``m``."""
    other = gm.meta.get("other mode")
    for g, mode in ((gm, ""), (other, "other_mode_")) if other is not None else ((gm, ""),):
        for node in g.graph.nodes:
            if node.op == "get_attr" and not _resolves(m, node.target):
                name = f"_fusedkit_constant_{mode}{node.target.replace('.', '_')}"
                object.__setattr__(m, name, functools.reduce(getattr, node.target.split("."), g))
                node.target = name
        g.recompile()
    codes = {m.training: type(gm).forward}
    codes[not m.training] = type(gm).forward if other is None else type(other).forward
    m.__dict__["_fusedkit_fused"] = (codes, call.inputs, _Inlined(m, gm, modes=other is not None))
    m.__dict__["forward"] = types.MethodType(_fused_forward, m)


def _resolves(m: torch.nn.Module, target: str) -> bool:
    try:
        functools.reduce(getattr, target.split("."), m)
    except AttributeError:
        return False
    return True


def fused_code(m: torch.nn.Module) -> str | None:
    """The fused forward :func:`fuse` gave module ``m``, as Python source, or None."""
    fused = m.__dict__.get("_fusedkit_fused")
    return None if fused is None else inspect.getsource(fused[0][m.training])


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as it was before :func:`fuse`: every module's own forward again."""
    for m in model.modules():
        forward = m.__dict__.get("forward")
        if getattr(forward, "__func__", None) is _fused_forward:
            del m.__dict__["forward"]
        for key in [k for k in m.__dict__ if k == "_fusedkit_fused" or k.startswith("_fusedkit_constant_")]:
            del m.__dict__[key]
    model.__dict__.pop("fusion_sites", None)
    return model


def fuse(model: torch.nn.Module, *example_inputs, **example_kwargs) -> torch.nn.Module:
    """``model`` itself, with every :func:`advise` site run by its fusedkit call: each
    outermost module that traces (``torch.fx``) and holds sites runs its fused code as its
    forward, on its own parameters, so the model keeps its class, methods (``generate``),
    attributes, state dict keys, hooks and modes; ``model.fusion_sites`` lists the sites.
    Where a module does not trace (a transformers model's top level, its attention), its
    submodules are looked into; one warning says what stays unfused and why. A fused forward
    takes the calls it was traced from (tensors by position); any other call runs the
    module's own forward. Before it returns, the model's outputs on copies of the example
    are checked against those it gave before (eval mode, without gradients;
    ``FUSE_TOLERANCE`` of the loosest float dtype computed, autocast's where it is on, with
    ``FUSE_OUTLIERS`` of the elements allowed up to ``FUSE_OUTLIER`` times it; NaN and inf
    where it gave them): a difference undoes the fusion and raises ``FusedkitError``.
    :func:`unfuse` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise SignatureError(
            f"fuse() takes an nn.Module, got {type(model).__name__} (advise takes a function; "
            "fusedkit's ops can be called from it directly)"
        )
    unfuse(model)
    plans, notes, want = _plan(model, example_inputs, example_kwargs)
    _warn_unfused(model, notes)
    least = 0.0
    for _, m, gm, _, call in plans:
        _install(m, gm, call)
        least = max([least, *(FUSE_TOLERANCE.get(_dtype(n), 0) for n in gm.graph.nodes)])
    got = _run(model, example_inputs, example_kwargs)
    for w, g in zip(*(torch.utils._pytree.tree_flatten(v)[0] for v in (want, got))):
        if isinstance(w, torch.Tensor) and w.is_floating_point():
            err = _disagreement(g, w, max(_tolerance(w), least))
            if err:
                unfuse(model)
                raise FusedkitError(f"fuse(): the fused model's outputs differ from the model's: {err}")
    model.__dict__["fusion_sites"] = [_qualified(name, site) for name, _, _, sites, _ in plans for site in sites]
    return model


def _disagreement(got, want: torch.Tensor, tol: float) -> str | None:
    """Why ``got`` is not ``want`` within ``tol`` (absolute and relative), or None: another
    shape or dtype, NaN or inf elsewhere, more than ``FUSE_OUTLIERS`` of the elements outside
    ``tol``, or any outside ``FUSE_OUTLIER`` times it."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return f"{_describe(got)} where the model gave {_describe(want)}"
    g, w = got.detach().double(), want.detach().double()
    finite = torch.isfinite(w)
    if not torch.equal(finite, torch.isfinite(g)) or not torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()):
        return "NaN or inf where the model gave other values"
    excess = (g - w).abs()[finite] / (tol + tol * w.abs()[finite])
    outside = int((excess > 1).sum())
    if outside > FUSE_OUTLIERS * excess.numel() or (excess.numel() and excess.max() > FUSE_OUTLIER):
        return (
            f"{outside} of {excess.numel()} elements differ by more than {tol} (absolute and relative), "
            f"the farthest {float(excess.max()):.3g} times that"
        )
    return None


def _describe(t) -> str:
    return f"a {t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _tolerance(t: torch.Tensor) -> float:
    """``FUSE_TOLERANCE`` of ``t``'s dtype, or of autocast's where autocast computed it."""
    tol = FUSE_TOLERANCE.get(t.dtype, 0)
    if t.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(t.device.type):
        tol = max(tol, FUSE_TOLERANCE.get(torch.get_autocast_dtype(t.device.type), 0))
    return tol
