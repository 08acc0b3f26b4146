"""``torch.nn`` modules built on fusedkit's fused ops."""

from __future__ import annotations

import numbers

import torch
from torch import nn
from torch.nn.modules import module as _module

from .dispatch import MLP_ACTIVATIONS
from .errors import ArgumentError
from .ops import add_relu, gated_mlp, gelu_mul, layer_norm, linear_relu, mlp, rms_norm, silu_mul
from .runtime.layout import broadcast_shape
from .runtime.matmul import torch_activation

__all__ = ["LinearReLU", "AddReLU", "MLP", "SwiGLU", "GeGLU", "RMSNorm", "LayerNorm"]


def _rename_keys(state_dict: dict, prefix: str, names: dict, transpose_weights: bool = False) -> None:
    """A load pre-hook's work: the keys under ``prefix`` whose first part another model's
    module names (``names``: its name -> this module's) renamed to this module's, with 2-D
    weights transposed where that model stores them (in, out) (``Conv1D``)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        head, _, rest = key[len(prefix) :].partition(".")
        target = f"{prefix}{names.get(head)}.{rest}"
        # (both names present: the other model's key stays, and a strict load reports it unexpected)
        if head in names and rest and target not in state_dict:
            value = state_dict.pop(key)
            state_dict[target] = value.t() if transpose_weights and rest == "weight" and value.dim() == 2 else value


class LinearReLU(nn.Linear):
    """Drop-in for ``nn.Sequential(nn.Linear(in, out), nn.ReLU())`` with one fused kernel.

    Same parameters (``weight`` (out, in), ``bias`` (out,)) and initialisation as
    ``nn.Linear``, so it loads an ``nn.Linear`` state_dict; works with ``.to()``
    and autograd. Input (..., in_features) -> output (..., out_features).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_relu(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> LinearReLU:
        """A new LinearReLU holding a copy of ``linear``'s weight and bias."""
        m = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        m.load_state_dict(linear.state_dict())
        return m


class AddReLU(nn.Module):
    """A residual join: ``relu(x + alpha * residual)`` in one kernel (``fusedkit.add_relu``).

    ``residual`` may be a tensor or a Python number, as for ``fusedkit.add_relu``; any dtype
    it takes (integer tensors with the default ``alpha=1``). ``inplace=True`` writes into
    ``x`` (as ``out=x``, bumping its version as torch's in-place ops do) when no gradient is
    needed and the result has ``x``'s shape and dtype, saving an allocation; otherwise it
    returns a new tensor.
    """

    def __init__(self, alpha: float | int = 1, inplace: bool = False):
        super().__init__()
        self.alpha = alpha
        self.inplace = inplace

    def forward(self, x: torch.Tensor, residual: torch.Tensor | float | int) -> torch.Tensor:
        if self.inplace and isinstance(x, torch.Tensor) and self._can_write(x, residual):
            return add_relu(x, residual, alpha=self.alpha, out=x)
        return add_relu(x, residual, alpha=self.alpha)

    @staticmethod
    def _can_write(x: torch.Tensor, residual) -> bool:
        if not isinstance(residual, (torch.Tensor, numbers.Real)) or isinstance(residual, bool):
            return False  # add_relu raises its own error for it
        is_tensor = isinstance(residual, torch.Tensor)
        grad = torch.is_grad_enabled() and (x.requires_grad or (is_tensor and residual.requires_grad))
        shape = broadcast_shape([x.shape, residual.shape]) if is_tensor else tuple(x.shape)
        return (
            not grad
            and shape == tuple(x.shape)
            and not (x.is_inference() and not torch.is_inference_mode_enabled())
            and torch.result_type(x, residual) == x.dtype
        )

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, inplace={self.inplace}"


class MLP(nn.Module):
    """``fc2(act(fc1(x)))`` through :func:`fusedkit.mlp`: the up-projection's bias and activation
    in its GEMM, the activation's gradient and ``fc1``'s bias gradient in the backward GEMM's
    epilogue (``recompute=True``: only ``x`` kept for the backward).

    ``fc1`` is ``nn.Linear(in_features, hidden_features)`` and ``fc2``
    ``nn.Linear(hidden_features, out_features or in_features)``, each with a bias when ``bias``:
    the state dict keys of timm's ``Mlp`` (``fc1.weight``, ``fc1.bias``, ``fc2.weight``,
    ``fc2.bias``), whose state dicts load as they are; transformers' ``GPT2MLP`` state dicts
    load too (``c_fc`` and ``c_proj``, ``Conv1D`` weights stored (in, out): transposed into
    ``fc1`` and ``fc2`` as they load). ``activation``: "gelu" (``approximate``
    "none" or "tanh"), "relu" or "silu". Where a hook is registered on ``fc1`` or ``fc2`` (or
    a global module hook: tensor parallelism's ``parallelize_module`` registers some), or a
    projection was replaced by another layer, the two run as modules and the activation as
    PyTorch's, so every hook and layer sees its call; parametrizations apply either way.
    Follows ``torch.autocast`` as ``nn.Linear`` does.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        out_features: int | None = None,
        activation: str = "gelu",
        approximate: str = "none",
        bias: bool = True,
        recompute: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.fc1 = nn.Linear(in_features, hidden_features, **kw)
        self.fc2 = nn.Linear(hidden_features, out_features or in_features, **kw)
        self.activation, self.approximate, self.recompute = activation, approximate, recompute
        # (checked now, on meta tensors: a bad name fails at construction, not at the first call)
        probe = [torch.empty(s, device="meta") for s in ((1, 1), (1, 1), (1, 1))]
        mlp(probe[0], probe[1], None, probe[2], None, activation=activation, approximate=approximate)
        self.register_load_state_dict_pre_hook(self._gpt2_keys)

    #: GPT-2's names for the two projections (``Conv1D``: weight (in, out)), loaded as this module's.
    GPT2_NAMES = {"c_fc": "fc1", "c_proj": "fc2"}

    @classmethod
    def _gpt2_keys(cls, module, state_dict, prefix, *args) -> None:
        _rename_keys(state_dict, prefix, cls.GPT2_NAMES, transpose_weights=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        if _runs_as_modules(fc1, fc2):
            return fc2(torch_activation(fc1(x), MLP_ACTIVATIONS[(self.activation, self.approximate)]))
        return mlp(
            x,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            fc2.bias,
            activation=self.activation,
            approximate=self.approximate,
            recompute=self.recompute,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.fc1.in_features}, hidden_features={self.fc1.out_features}, "
            f"out_features={self.fc2.out_features}, activation={self.activation!r}, "
            f"approximate={self.approximate!r}, bias={self.fc1.bias is not None}, recompute={self.recompute}"
        )


def _runs_as_modules(*layers: nn.Module) -> bool:
    """Whether ``layers`` must each be called as a module: one does not run ``nn.Linear``'s own
    forward (an adapter or quantised layer in its place, a forward set on the instance; a
    parametrized ``nn.Linear``'s weight is read as usual) or a hook would see its call, its own
    or a global one."""
    if (
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
    ):
        return True
    return any(
        not isinstance(m, nn.Linear)
        or type(m).forward is not nn.Linear.forward  # (a subclass's own forward, parametrized or not)
        or "forward" in vars(m)  # (a forward set on the instance: an offloading or adapter wrapper)
        or m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        for m in layers
    )


class SwiGLU(nn.Module):
    """The LLaMA MLP, ``down(silu(gate(x)) * up(x))``, through :func:`fusedkit.gated_mlp`: at
    decode sizes the gate and up projections are one GEMM with ``silu(gate) * up`` in its
    epilogue; for training it keeps ``x``, the gate and up projections where eager keeps four
    tensors of the hidden size (``recompute=True``: ``x`` only).

    ``gate`` and ``up`` are ``nn.Linear(in_features, hidden_features)``, ``down`` is
    ``nn.Linear(hidden_features, in_features)``, each with a bias when ``bias``; state dict
    keys ``gate.weight``, ``up.weight``, ``down.weight`` (and ``.bias``). A LLaMA-style MLP's
    state dict (``gate_proj``, ``up_proj``, ``down_proj``, as transformers' ``LlamaMLP``
    names them) loads as it is, and so does one with the gate and up projections stacked in
    one ``gate_up_proj`` (transformers' ``Phi3MLP``, vLLM: the gate's rows first), split as it
    loads. Input (..., in_features) -> output (..., in_features); follows ``torch.autocast``
    as ``nn.Linear`` does. Where a hook is registered on a projection (or a global module
    hook), or a projection was replaced by another layer (an adapter's), the three run as
    modules and the gate as one kernel (``fusedkit.silu_mul``), so every hook and layer sees
    its call; parametrizations apply either way.
    """

    #: The LLaMA MLP's names for the three projections, loaded as this module's.
    LLAMA_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    activation, approximate = "silu", "none"

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        recompute: bool = False,
    ):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate = nn.Linear(in_features, hidden_features, **kw)
        self.up = nn.Linear(in_features, hidden_features, **kw)
        self.down = nn.Linear(hidden_features, in_features, **kw)
        self.recompute = recompute
        self.register_load_state_dict_pre_hook(self._llama_keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate, self.up, self.down
        if _runs_as_modules(gate, up, down):
            return down(self._gate(gate(x), up(x)))
        biases = (gate.bias, up.bias, down.bias)
        return gated_mlp(
            x,
            gate.weight,
            up.weight,
            down.weight,
            activation=self.activation,
            approximate=self.approximate,
            bias=None if biases == (None, None, None) else biases,
            recompute=self.recompute,
        )

    def _gate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return silu_mul(g, u)

    @classmethod
    def _llama_keys(cls, module, state_dict, prefix, *args) -> None:
        for part in ("weight", "bias"):
            stacked = f"{prefix}gate_up_proj.{part}"
            gate, up = f"{prefix}gate.{part}", f"{prefix}up.{part}"
            # (this module's own keys present: the stacked one stays, and a strict load reports it)
            if stacked in state_dict and gate not in state_dict and up not in state_dict:
                state_dict[gate], state_dict[up] = state_dict.pop(stacked).chunk(2, dim=0)
        _rename_keys(state_dict, prefix, cls.LLAMA_NAMES)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.gate.in_features}, hidden_features={self.gate.out_features}, "
            f"bias={self.gate.bias is not None}, recompute={self.recompute}"
        )


class GeGLU(SwiGLU):
    """The GeGLU MLP (Gemma's, T5 v1.1's), ``down(gelu(gate(x)) * up(x))``: :class:`SwiGLU`
    with GELU for SiLU, exact (``approximate="none"``) or tanh (Gemma's ``gelu_pytorch_tanh``);
    the same layers, state dict keys, loading and options."""

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        *,
        approximate: str = "none",
        recompute: bool = False,
    ):
        if approximate not in ("none", "tanh"):
            raise ArgumentError(f"GeGLU(): approximate must be 'none' or 'tanh', got {approximate!r}")
        super().__init__(in_features, hidden_features, bias, device, dtype, recompute=recompute)
        self.activation, self.approximate = "gelu", approximate

    def _gate(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return gelu_mul(g, u, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"


class RMSNorm(nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` running :func:`fusedkit.rms_norm`: the same
    constructor, parameter (``weight``), state-dict keys and defaults, so it loads a
    ``torch.nn.RMSNorm`` or transformers ``LlamaRMSNorm`` state dict. (LlamaRMSNorm's output
    has the weight's and input's promoted dtype; this one, as ``torch.nn.RMSNorm``, the
    input's.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` running :func:`fusedkit.layer_norm`: the same
    constructor (``elementwise_affine``, ``bias=False``), parameters and state-dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
