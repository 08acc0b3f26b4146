"""Real models, the benchmark of record: ``python -m fusedkit bench --models``.

Model code that others wrote, unmodified except where fusedkit goes in, timed beside the
same model stock, eager and under ``torch.compile``, in one process:

- Whole models, each fused by ``fusedkit.fuse(model, batch)`` as a user calls it (``whole``):
  ``gpt2`` (transformers ``GPT2LMHeadModel``, 124M), ``llama_1b`` (``LlamaForCausalLM``,
  hidden 2048, MLP 5632, 16 layers), ``bert`` (``BertForMaskedLM``, base), ``vit_b16`` and
  ``convnext_tiny`` (timm), ``resnet50`` (torchvision, channels_last). AdamW under bf16
  autocast; the language models also decode through ``generate``. Variants: also
  ``fusedkit_compiled`` (``torch.compile`` of the fused model) and Liger-Kernel on the LLaMA.
- ``gpt2_mlp`` / ``gpt2_mlp_relu``: transformers' ``GPT2MLP`` at GPT-2 medium's sizes
  (1024 -> 4096 -> 1024), activation ``gelu_new`` (tanh GELU) or ``relu``; the fused model
  runs the up-projection, bias and activation as one ``fusedkit.matmul`` (its epilogue);
  ``fusedkit_mlp``: the whole MLP as one ``fusedkit.mlp`` (prologue and backward epilogue).
- ``gpt2_block``: transformers' ``GPT2Block`` (layer norms, attention, residuals) with
  that MLP inside.
- ``llama_mlp``: transformers' ``LlamaMLP`` at LLaMA-7B's sizes (4096 -> 11008 -> 4096,
  SiLU gate); the fused model runs its gate, ``act_fn(gate_proj(x)) * up_proj(x)``, as one
  ``fusedkit.silu_mul``. Where Liger-Kernel imports, its SwiGLU MLP forward is a variant
  too (``liger``); ``fusedkit_gated``: the whole MLP as one ``fusedkit.gated_mlp`` (gate and up
  projections in one GEMM with the gate in its epilogue).
- ``llama_layer``: transformers' ``LlamaDecoderLayer`` at the 1B-class LLaMA's sizes, fused
  by ``fusedkit.fuse`` as a whole model is (its two RMSNorms, the residual join with the
  second, and the gated MLP); Liger-Kernel's RMSNorm and SwiGLU MLP as a peer (``liger``).

For each model and variant (``eager``: stock; ``fusedkit``: the fused model, eager;
``compiled``: ``torch.compile`` of the stock model; blocks train with SGD and momentum):

- ``train_ms``: one training step (forward, loss, backward, SGD with momentum, grads set
  to None), ``do_bench`` median; ``gpu_ms``: the GPU's busy time a step (its kernels'
  durations summed, from ``torch.profiler``, over ``GPU_BUSY_STEPS`` steps); ``host_ms``:
  the host's time to issue a step with the GPU idle. A step much longer than its GPU time
  and near its host time is bound by the host's Python and launches, not by the kernels;
- ``bs1_ms`` / ``serve_ms``: inference (``torch.inference_mode``) at batch 1 and at a
  serving batch (images for ResNet-50; for the GPT-2 cases one token of each sequence, the
  MLP's shapes in a decode step, though the block attends without a KV cache);
- ``peak_mb``: the peak memory of a training step above what lives between steps;
- ``losses``: 20 training steps from the same weights on one batch (a model fitting one
  batch: the loss falls steadily, so rounding differences do not blow up as they do on
  random batches); the report gives each variant's largest relative difference from the
  stock eager run, with a second stock eager run (``eager2``) as the control for
  run-to-run nondeterminism.

On a CPU the same code runs at tiny sizes, in float32, as a correctness check of the
harness (its times are not GPU times). A case whose package does not import is skipped,
and the report says why.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import statistics
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import fusedkit

from .cases import timer
from .progress import bar as progress_bar

__all__ = [
    "MODELS",
    "VARIANTS",
    "case_variants",
    "decode",
    "decode_side_by_side",
    "merge_processes",
    "run_processes",
    "ModelCase",
    "run_models",
    "run_case",
    "training_step",
    "format_models_table",
    "fuse",
    "unavailable",
    "prepared",
    "variant_model",
    "autocast_for",
    "time_ms",
    "timing_rounds",
    "gpu_busy_ms",
    "kernel_time_us",
    "host_ms",
]

#: Training steps of the loss comparison.
LOSS_STEPS = 20
#: do_bench budget (ms) of a model step in one round: a ResNet-50 step takes tens of
#: milliseconds (docs/results.md), so do_bench's default budget would take the median of a few.
MODEL_WARMUP_MS, MODEL_REP_MS = 50, 300
#: Rounds of timing, every variant once a round (the median over rounds is reported): the
#: same stock ResNet-50 step measured 1.7x apart in two processes on the H200 host, and
#: drifts within one.
TIMING_ROUNDS = 3
#: Every variant's name (a case runs those :func:`case_variants` gives, and its peers).
VARIANTS = ("eager", "eager2", "fusedkit", "compiled", "fusedkit_compiled")
#: Training steps profiled together for the GPU busy time (one step's read 3% apart for the
#: same stock LLaMA-7B MLP in two processes on the H200).
GPU_BUSY_STEPS = 3
#: Steps issued from an idle GPU for the host's time (the median is reported).
HOST_STEPS = 10


@dataclass(frozen=True)
class Sizes:
    """A case's batch shapes for training, batch-1 and serving inference."""

    train: tuple
    bs1: tuple
    serve: tuple


@dataclass(frozen=True)
class ModelCase:
    """One real model: how to build it stock, how fusedkit goes into it, its batches and loss."""

    name: str
    what: str
    package: str  # the module the model comes from
    build: Callable[[bool], torch.nn.Module]  # (small) -> the stock model, float32, on the CPU
    fuse: Callable[[torch.nn.Module, torch.Tensor], int]  # (model, example input): fusedkit in, in place; sites
    batch: Callable[[tuple, torch.Generator, bool], tuple]  # (shape, generator, small) -> (input, target)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    sizes: Sizes
    small_sizes: Sizes
    lr: float
    channels_last: bool = False
    #: Other libraries' fusions of the same sites, each a variant of its own where its package
    #: imports: (variant name, package, fuse in place -> sites changed).
    peers: tuple = ()
    #: The training step's optimizer: "sgd" (with momentum) or "adamw".
    optimizer: str = "sgd"
    #: A causal LM: its decode step is timed through ``generate`` (``decode1_ms``, ``decode16_ms``).
    decode: bool = False
    #: A whole model that ``fusedkit.fuse`` finds the sites of (the others are blocks fused by hand).
    whole: bool = False
    #: A block that ``fusedkit.fuse`` finds the sites of, as a whole model's are (on the device,
    #: from an example batch); the other blocks are fused by hand.
    traced: bool = False


# --- ResNet-50 (torchvision) ------------------------------------------------------------


def _build_resnet(small: bool):
    from torchvision.models import resnet

    if small:  # one Bottleneck a stage (a downsampling join in each), ten classes
        return resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=10)
    return resnet.resnet50()


def _image_batch(shape, gen, small):
    n, side = shape
    classes = 10 if small else 1000
    return torch.randn(n, 3, side, side, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _cross_entropy(out, target):
    return F.cross_entropy(out.float(), target)


# --- GPT-2 (transformers) ---------------------------------------------------------------

#: transformers' activation names -> fusedkit.matmul's.
GPT2_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
#: GPT-2 medium: hidden 1024, MLP 4 x 1024, 16 heads.
GPT2_MEDIUM = dict(n_embd=1024, n_inner=4096, n_head=16)
GPT2_SMALL = dict(n_embd=32, n_inner=128, n_head=4)


def _gpt2_mlp_forward(self, hidden_states):
    """transformers' ``GPT2MLP.forward`` with ``act(c_fc(x))`` as one fusedkit.matmul: a
    ``Conv1D`` weight is (in, out), the ``b`` operand as it is."""
    h = fusedkit.matmul(hidden_states, self.c_fc.weight, self.c_fc.bias, activation=self.fusedkit_activation)
    return self.dropout(self.c_proj(h))


def _gpt2_mlp_unit_forward(self, hidden_states):
    """transformers' ``GPT2MLP.forward`` as one ``fusedkit.mlp``: the activation's output never
    written, its gradient in the backward GEMM's epilogue; ``Conv1D`` weights (in, out) read
    transposed, as views."""
    activation, _, approximate = self.fusedkit_activation.partition("_")
    fc, proj = self.c_fc, self.c_proj
    h = fusedkit.mlp(
        hidden_states,
        fc.weight.t(),
        fc.bias,
        proj.weight.t(),
        proj.bias,
        activation=activation,
        approximate=approximate or "none",
    )
    return self.dropout(h)


def _fuse_gpt2_mlp_unit(model, example=None) -> int:
    n = _fuse_gpt2(model, example)
    for m in model.modules():
        if hasattr(m, "fusedkit_activation"):
            m.forward = types.MethodType(_gpt2_mlp_unit_forward, m)
    return n


def _gpt2_config(activation: str, small: bool):
    from transformers import GPT2Config

    # No dropout: the loss comparison runs the same steps on every variant.
    return GPT2Config(
        **(GPT2_SMALL if small else GPT2_MEDIUM),
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _build_gpt2_mlp(activation: str):
    def build(small: bool):
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        config = _gpt2_config(activation, small)
        return GPT2MLP(config.n_inner, config)

    return build


def _build_gpt2_block(small: bool):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = _gpt2_config("gelu_new", small)
    config._attn_implementation = "sdpa"
    return _HiddenStates(GPT2Block(config))


class _HiddenStates(torch.nn.Module):
    """A ``GPT2Block`` returning its hidden states alone (transformers before 5 return a tuple)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, hidden_states):
        out = self.block(hidden_states)
        return out[0] if isinstance(out, tuple) else out


def _fuse_gpt2(model, example=None) -> int:
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    mlps = [m for m in model.modules() if isinstance(m, GPT2MLP)]
    for m in mlps:
        m.fusedkit_activation = GPT2_ACTIVATIONS[_activation_name(m)]
        m.forward = types.MethodType(_gpt2_mlp_forward, m)
    return len(mlps)


def _activation_name(mlp) -> str:
    """The transformers activation name of ``mlp.act`` (its config's ``activation_function``)."""
    from transformers.activations import ACT2CLS

    for name, cls in ACT2CLS.items():
        cls = cls[0] if isinstance(cls, tuple) else cls
        if type(mlp.act) is cls and name in GPT2_ACTIVATIONS:
            return name
    raise ValueError(f"GPT2MLP activation {type(mlp.act).__name__} has no fusedkit epilogue")


def _hidden_states(small_width: int, width: int):
    """A block's batch maker: (input, target) hidden states of ``width`` features (``small_width``
    at the small sizes), ``shape`` sequences by tokens."""

    def batch(shape, gen, small):
        n, t = shape
        c = small_width if small else width
        return torch.randn(n, t, c, generator=gen), torch.randn(n, t, c, generator=gen)

    return batch


_token_batch = _hidden_states(GPT2_SMALL["n_embd"], GPT2_MEDIUM["n_embd"])


def _mse(out, target):
    return F.mse_loss(out.float(), target.float())


# --- LLaMA MLP (transformers) -----------------------------------------------------------

#: LLaMA-7B's MLP: hidden 4096, intermediate 11008.
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008)
LLAMA_SMALL = dict(hidden_size=32, intermediate_size=88)


def _llama_mlp_forward(self, x):
    """transformers' ``LlamaMLP.forward`` with its gate, ``act_fn(gate_proj(x)) * up_proj(x)``,
    as one ``fusedkit.silu_mul``."""
    return self.down_proj(fusedkit.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _build_llama_mlp(small: bool):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    sizes = LLAMA_SMALL if small else LLAMA_7B
    # (heads only so the config validates: the MLP has no attention)
    return LlamaMLP(LlamaConfig(**sizes, hidden_act="silu", num_attention_heads=4, num_key_value_heads=4))


def _fuse_llama(model, example=None) -> int:
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    for m in mlps:
        if m.config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"LlamaMLP activation {m.config.hidden_act!r}: silu_mul fuses SiLU gates")
        m.forward = types.MethodType(_llama_mlp_forward, m)
    return len(mlps)


def _llama_mlp_gated_forward(self, x):
    """transformers' ``LlamaMLP.forward`` as one ``fusedkit.gated_mlp``: gate and up projections in
    one GEMM with the gate in its epilogue, two tensors of the hidden size kept for the backward."""
    return fusedkit.gated_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _fuse_llama_gated(model, example=None) -> int:
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    for m in mlps:
        if m.config.hidden_act not in ("silu", "swish") or m.gate_proj.bias is not None:
            raise ValueError(f"LlamaMLP activation {m.config.hidden_act!r} or biases: the peer runs bias-free SwiGLU")
        m.forward = types.MethodType(_llama_mlp_gated_forward, m)
    return len(mlps)


def _fuse_llama_liger(model, example=None) -> int:
    """The peer: Liger-Kernel's SwiGLU MLP forward (its fused SiLU-mul) on each LlamaMLP."""
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlps = [m for m in model.modules() if isinstance(m, LlamaMLP)]
    for m in mlps:
        m.forward = types.MethodType(LigerSwiGLUMLP.forward, m)
    return len(mlps)


_llama_batch = _hidden_states(LLAMA_SMALL["hidden_size"], LLAMA_7B["hidden_size"])


# --- LLaMA decoder layer (transformers) -------------------------------------------------


class _LlamaLayer(torch.nn.Module):
    """A transformers ``LlamaDecoderLayer`` on hidden states, with the rotary embedding its
    model computes once for every layer (the layer takes the cos and sin)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden_states):
        positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        out = self.layer(hidden_states, position_embeddings=self.rotary(hidden_states, positions))
        return out[0] if isinstance(out, tuple) else out


def _build_llama_layer(small: bool):
    from transformers import LlamaConfig

    sizes = dict(LLAMA_TINY if small else LLAMA_1B, num_hidden_layers=1)
    config = LlamaConfig(**sizes)
    config._attn_implementation = "sdpa"
    return _LlamaLayer(config)


def _fuse_llama_layer_liger(model, example=None) -> int:
    """The peer: Liger-Kernel's ``LigerRMSNorm`` for the layer's two norms (their weights
    loaded) and its SwiGLU MLP forward, what ``apply_liger_kernel_to_llama`` gives a layer."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    layer = model.layer
    for name in ("input_layernorm", "post_attention_layernorm"):
        stock = getattr(layer, name)
        norm = LigerRMSNorm(stock.weight.shape[0], eps=stock.variance_epsilon)
        norm.load_state_dict(stock.state_dict())
        setattr(layer, name, norm.to(stock.weight.device, stock.weight.dtype))
    layer.mlp.forward = types.MethodType(LigerSwiGLUMLP.forward, layer.mlp)
    return 3


# --- Whole models: fusedkit.fuse finds the sites ---------------------------------------


def _fuse_whole(model, example) -> int:
    """``fusedkit.fuse(model, example)`` as a user calls it (under the autocast the model
    trains in): the model fused in place; the sites it found."""
    with autocast_for(example.device):
        fusedkit.fuse(model, example)
    return len(model.fusion_sites)


#: Vocabulary of the tiny (CPU) language models.
_TINY_VOCAB = 128


def _build_gpt2(small: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=_TINY_VOCAB) if small else {}
    # GPT-2 small (124M); no dropout: the loss comparison runs the same steps on every variant.
    config = GPT2Config(**tiny, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


#: A 1B-class LLaMA: hidden 2048, MLP 5632 (TinyLlama's), 16 layers, 32 heads, 4 KV heads.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
LLAMA_TINY = dict(
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=_TINY_VOCAB,
)


def _build_llama(small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(LLAMA_TINY if small else LLAMA_1B))
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _build_bert(small: bool):
    from transformers import BertConfig, BertForMaskedLM

    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    tiny.update(vocab_size=_TINY_VOCAB, max_position_embeddings=64)
    # BERT-base; no dropout, as above.
    config = BertConfig(**(tiny if small else {}), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config)


def _build_timm(name: str, tiny: dict):
    def build(small: bool):
        import timm

        return timm.create_model(name, **(dict(tiny, num_classes=10) if small else {}))

    return build


def _lm_batch(vocab: int):
    def batch(shape, gen, small):
        n, t = shape
        v = _TINY_VOCAB if small else vocab
        return torch.randint(0, v, (n, t), generator=gen), torch.randint(0, v, (n, t), generator=gen)

    return batch


def _lm_loss(out, target):
    """Cross entropy of the logits against the target tokens (one batch the model fits)."""
    return F.cross_entropy(out.logits.float().flatten(0, 1), target.flatten())


def _fuse_llama_liger_whole(model, example=None) -> int:
    """The peer: Liger-Kernel's ``apply_liger_kernel_to_llama`` on the model instance, its RMSNorm
    and SwiGLU MLP (its RoPE and cross entropy left out: the first patches transformers'
    module for every LLaMA in the process, stock ones included; the loss here is the report's).
    transformers' classes are restored after, so that models built later are stock."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    kept = {k: getattr(modeling_llama, k) for k in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")}
    try:
        apply_liger_kernel_to_llama(
            rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True, model=model
        )
    finally:
        for k, v in kept.items():
            setattr(modeling_llama, k, v)
    return len(model.model.layers)


_IMAGES = Sizes(train=(64, 224), bs1=(1, 224), serve=(64, 224))
_SMALL_IMAGES = Sizes(train=(2, 32), bs1=(1, 32), serve=(2, 32))
#: Training: 8 sequences of 1024 tokens; inference: one token of 1 and of 64 sequences (a decode
#: step's shapes for the MLP; the block attends to that one token, with no KV cache).
_TOKENS = Sizes(train=(8, 1024), bs1=(1, 1), serve=(64, 1))
_SMALL_TOKENS = Sizes(train=(2, 8), bs1=(1, 1), serve=(3, 1))
#: The decoder layer: training and serving on 4 sequences of 1024 tokens (a prefill), batch 1
#: one such sequence (its attention needs the sequence: no single-token decode without a cache).
_LLAMA_LAYER_TOKENS = Sizes(train=(4, 1024), bs1=(1, 1024), serve=(4, 1024))
#: Whole language models: training and serving (prefill) on the training batch, batch 1 a
#: prefill of one sequence; the decode step through ``generate`` (``DECODE_BATCHES``).
_GPT2_TOKENS = Sizes(train=(8, 512), bs1=(1, 512), serve=(8, 512))
_LLAMA_TOKENS = Sizes(train=(4, 512), bs1=(1, 512), serve=(4, 512))
_BERT_TOKENS = Sizes(train=(32, 128), bs1=(1, 128), serve=(32, 128))
_SMALL_LM_TOKENS = Sizes(train=(2, 8), bs1=(1, 8), serve=(2, 8))

MODELS = {
    case.name: case
    for case in (
        ModelCase(
            "gpt2",
            "transformers GPT2LMHeadModel (124M), whole, through fusedkit.fuse",
            "transformers",
            _build_gpt2,
            _fuse_whole,
            _lm_batch(50257),
            _lm_loss,
            _GPT2_TOKENS,
            _SMALL_LM_TOKENS,
            lr=1e-4,
            optimizer="adamw",
            decode=True,
            whole=True,
        ),
        ModelCase(
            "llama_1b",
            "transformers LlamaForCausalLM (1B-class: 2048 / 5632, 16 layers), whole, through fusedkit.fuse",
            "transformers",
            _build_llama,
            _fuse_whole,
            _lm_batch(32000),
            _lm_loss,
            _LLAMA_TOKENS,
            _SMALL_LM_TOKENS,
            lr=1e-4,
            optimizer="adamw",
            decode=True,
            whole=True,
            peers=(("liger", "liger_kernel", _fuse_llama_liger_whole),),
        ),
        ModelCase(
            "bert",
            "transformers BertForMaskedLM (base), whole, through fusedkit.fuse",
            "transformers",
            _build_bert,
            _fuse_whole,
            _lm_batch(30522),
            _lm_loss,
            _BERT_TOKENS,
            _SMALL_LM_TOKENS,
            lr=1e-4,
            optimizer="adamw",
            whole=True,
        ),
        ModelCase(
            "vit_b16",
            "timm vit_base_patch16_224, whole, through fusedkit.fuse",
            "timm",
            _build_timm("vit_base_patch16_224", dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4)),
            _fuse_whole,
            _image_batch,
            _cross_entropy,
            _IMAGES,
            _SMALL_IMAGES,
            lr=1e-4,
            optimizer="adamw",
            whole=True,
        ),
        ModelCase(
            "convnext_tiny",
            "timm convnext_tiny, whole, through fusedkit.fuse",
            "timm",
            _build_timm("convnext_tiny", dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128))),
            _fuse_whole,
            _image_batch,
            _cross_entropy,
            _IMAGES,
            _SMALL_IMAGES,
            lr=1e-4,
            optimizer="adamw",
            channels_last=True,
            whole=True,
        ),
        ModelCase(
            "resnet50",
            "torchvision ResNet-50, whole, through fusedkit.fuse (its Bottleneck joins)",
            "torchvision",
            _build_resnet,
            _fuse_whole,
            _image_batch,
            _cross_entropy,
            _IMAGES,
            _SMALL_IMAGES,
            lr=1e-4,
            optimizer="adamw",
            channels_last=True,
            whole=True,
        ),
        ModelCase(
            "gpt2_mlp",
            "transformers GPT2MLP (medium), gelu_new in the matmul epilogue",
            "transformers",
            _build_gpt2_mlp("gelu_new"),
            _fuse_gpt2,
            _token_batch,
            _mse,
            _TOKENS,
            _SMALL_TOKENS,
            lr=0.05,
            peers=(("fusedkit_mlp", "fusedkit", _fuse_gpt2_mlp_unit),),
        ),
        ModelCase(
            "gpt2_mlp_relu",
            "transformers GPT2MLP (medium), relu in the matmul epilogue",
            "transformers",
            _build_gpt2_mlp("relu"),
            _fuse_gpt2,
            _token_batch,
            _mse,
            _TOKENS,
            _SMALL_TOKENS,
            lr=0.05,
            peers=(("fusedkit_mlp", "fusedkit", _fuse_gpt2_mlp_unit),),
        ),
        ModelCase(
            "gpt2_block",
            "transformers GPT2Block (medium), its MLP as in gpt2_mlp",
            "transformers",
            _build_gpt2_block,
            _fuse_gpt2,
            _token_batch,
            _mse,
            _TOKENS,
            _SMALL_TOKENS,
            lr=0.05,
        ),
        ModelCase(
            "llama_mlp",
            "transformers LlamaMLP (7B sizes), its SiLU gate through silu_mul",
            "transformers",
            _build_llama_mlp,
            _fuse_llama,
            _llama_batch,
            _mse,
            _TOKENS,
            _SMALL_TOKENS,
            lr=0.05,
            peers=(("fusedkit_gated", "fusedkit", _fuse_llama_gated), ("liger", "liger_kernel", _fuse_llama_liger)),
        ),
        ModelCase(
            "llama_layer",
            "transformers LlamaDecoderLayer (1B-class: 2048 / 5632), through fusedkit.fuse: its norms, "
            "residual join and gated MLP",
            "transformers",
            _build_llama_layer,
            _fuse_whole,
            _hidden_states(LLAMA_TINY["hidden_size"], LLAMA_1B["hidden_size"]),
            _mse,
            _LLAMA_LAYER_TOKENS,
            _SMALL_TOKENS,
            lr=0.05,
            traced=True,
            peers=(("liger", "liger_kernel", _fuse_llama_layer_liger),),
        ),
    )
}


def unavailable(case: ModelCase) -> str | None:
    """Why ``case`` cannot run here (its package missing or broken), or None."""
    try:
        importlib.import_module(case.package)
        case.build(True)
    except Exception as exc:  # a missing package, or one built for another torch
        return f"{case.package} does not import here: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return None


def _import_error(package: str) -> str | None:
    """Why ``package`` does not import here, or None."""
    try:
        importlib.import_module(package)
    except Exception as exc:  # missing, or built for another torch / triton
        return f"{package} does not import here: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return None


def _peer_error(case: ModelCase, fuse_peer, device) -> str | None:
    """Why a peer's fusion of ``case`` does not run here (one small training step), or None: a
    peer's kernels may not run in Triton's interpreter, say."""
    try:
        model = case.build(True).to(device)
        fuse_peer(model)
        x, t = _to_device(case, case.batch(case.small_sizes.train, torch.Generator().manual_seed(0), True), device)
        case.loss(model(x), t).backward()
    except Exception as exc:
        return f"it fails here: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return None


def fuse(case: ModelCase, model: torch.nn.Module, example: torch.Tensor | None = None) -> torch.nn.Module:
    """A copy of ``model`` (same parameter values) with fusedkit in it; ``example``: an input
    on the model's device for ``fusedkit.fuse`` (default: the case's small training batch)."""
    fused = copy.deepcopy(model)
    if example is None:  # (on the model's device: a whole model's fuse runs it on the example)
        device = next(iter(model.parameters()), torch.empty(0)).device
        example = case.batch(case.small_sizes.train, torch.Generator().manual_seed(0), True)[0].to(device)
    if case.fuse(fused, example) == 0:
        raise RuntimeError(f"{case.name}: no site to fuse found")
    return fused


@dataclass
class Result:
    model: str
    variant: str
    train_ms: float | None = None
    gpu_ms: float | None = None
    host_ms: float | None = None
    bs1_ms: float | None = None
    serve_ms: float | None = None
    peak_mb: float | None = None
    losses: list = field(default_factory=list)
    max_loss_rel_diff: float | None = None  # against the stock eager run
    decode1_ms: float | None = None  # a decode step (generate, KV cache) at batch one, per token
    decode16_ms: float | None = None  # the same at batch 16
    decode_equal: bool | None = None  # greedy tokens equal to stock eager's, both batches
    # new tokens equal to stock eager's before the first that differs (the least over batches and
    # rows): bf16 rounding parts a random-weight model's near-tied tokens, stock's own included
    decode_agree: int | None = None
    sites: int | None = None  # the sites fusedkit (or a peer) fused
    processes: int = 1  # processes the numbers are medians over
    train_x_range: list | None = None  # (least, most) stock eager / this train step, one a process


def autocast_for(device):
    # bf16 autocast on the GPU, as mixed-precision training runs; float32 on the CPU (the
    # interpreter's check of the same code).
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _to_device(case, batch, device):
    x, t = batch
    fmt = torch.channels_last if case.channels_last and x.dim() == 4 else torch.contiguous_format
    return x.to(device, memory_format=fmt), t.to(device)


def _train_step(model, opt, case, batch, device):
    x, t = batch
    with autocast_for(device):
        loss = case.loss(model(x), t)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_busy_ms(step, device, calls: int = 1) -> float | None:
    """The GPU's busy time in one ``step``: its kernels' and copies' durations summed, over
    ``calls`` calls profiled together, divided by ``calls``; None off a GPU. Annotated ranges
    (``record_function``, a custom op's or an optimizer's name; a profile that traces the CPU
    too gives them as CUDA events) are left out: each spans kernels already counted."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        _sync(device)
    return kernel_time_us(prof.events()) / 1e3 / calls


def kernel_time_us(events) -> float:
    """The summed durations (us) of the GPU's kernels and copies among profiler ``events``:
    CUDA events less the annotated ranges over them."""
    return sum(
        e.time_range.elapsed_us()
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )


def host_ms(step, device, repeats: int = HOST_STEPS) -> float | None:
    """The host's time to issue one ``step`` with the GPU idle (synchronised before), median
    over ``repeats``; None off a GPU, where a step runs as it is issued. An upper bound on the
    host's own time: a wait on the GPU inside the step (a ``.item()``, a pageable copy, a full
    launch queue) counts too. A step's time near this is bound by the host."""
    if device.type != "cuda":
        return None
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    _sync(device)
    return statistics.median(times)


def _peak_mb(step, device) -> float | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def time_ms(fn, device) -> float:
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=MODEL_WARMUP_MS, rep=MODEL_REP_MS, return_mode="median")
    return timer(device)(fn) / 1e3


def variant_model(case, variant, stock, device, example=None):
    """(module, run) for ``variant``: ``module`` the model on ``device`` (its parameters),
    ``run`` what is called (``module``, or its ``torch.compile``). A whole model is fused on the
    device with ``example`` (an input batch); a block by hand before it moves."""
    peer = next((fuse_peer for name, _, fuse_peer in case.peers if name == variant), None)
    fmt = torch.channels_last if case.channels_last else torch.contiguous_format
    fused = variant in ("fusedkit", "fusedkit_compiled")
    if fused and not (case.whole or case.traced):
        model = fuse(case, stock).to(device, memory_format=fmt)
    else:
        model = copy.deepcopy(stock).to(device, memory_format=fmt)
        if fused and case.fuse(model, example) == 0:
            raise RuntimeError(f"{case.name}: no site to fuse found")
        if peer is not None and peer(model) == 0:
            raise RuntimeError(f"{case.name}: the {variant} peer found no site to fuse")
    compiled = variant in ("compiled", "fusedkit_compiled")
    return model, (torch.compile(model, dynamic=False) if compiled else model)


def _optimizer(case: ModelCase, params):
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=case.lr)
    return torch.optim.SGD(params, lr=case.lr, momentum=0.9)


def case_variants(case: ModelCase, use_compile: bool = True) -> list[str]:
    """The variants a case runs: stock eager twice, fusedkit, compiled (a whole model: also
    compiled with fusedkit in it), then its peers (added where they import)."""
    variants = ["eager", "eager2", "fusedkit"]
    if use_compile:
        variants += ["compiled", "fusedkit_compiled"] if case.whole else ["compiled"]
    return variants


#: New tokens a decode timing generates (greedy, KV cache) after a prompt of ``DECODE_PROMPT``.
DECODE_TOKENS, DECODE_PROMPT = 32, 16
#: Batches of the decode timing, and its timed calls (the median is reported): a decode step is
#: host time, and one host's calls of the same step spread by up to 1.5x (the 1B LLaMA on an H100).
DECODE_BATCHES, DECODE_CALLS = (1, 16), 5


def _generate(model, ids, tokens):
    return model.generate(
        ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, attention_mask=None
    )


def decode(model, prompt, device, tokens: int = DECODE_TOKENS, calls: int = DECODE_CALLS):
    """(ms a new token, tokens): greedy ``generate`` of ``tokens`` tokens after ``prompt`` with
    the KV cache, inference mode and autocast, the wall time of a call (synchronised) over
    ``tokens``, median of ``calls`` after one warm-up call."""
    (ms,), (out,) = decode_side_by_side([model], prompt, device, tokens, calls)
    return ms, out


def decode_side_by_side(models, prompt, device, tokens: int = DECODE_TOKENS, calls: int = DECODE_CALLS):
    """:func:`decode` of each model, their timed calls taken in turn (a host that drifts during
    the rounds moves every model's median alike), each call its own autocast region, as a
    user's: ([ms a new token], [tokens])."""
    times = [[] for _ in models]
    for model in models:
        model.eval()
    with torch.inference_mode():
        with autocast_for(device):
            outs = [_generate(model, prompt, tokens) for model in models]
        for _ in range(calls):
            for model, took in zip(models, times):
                _sync(device)
                start = time.perf_counter()
                with autocast_for(device):
                    _generate(model, prompt, tokens)
                _sync(device)
                took.append((time.perf_counter() - start) * 1e3 / tokens)
    for model in models:
        model.train()
    return [statistics.median(t) for t in times], outs


def prepared(case: ModelCase, small: bool, device):
    """The stock model (seeded) and its training batch and inference inputs on ``device``."""
    sizes = case.small_sizes if small else case.sizes
    torch.manual_seed(0)
    stock = case.build(small)
    gen = torch.Generator().manual_seed(1)
    train = _to_device(case, case.batch(sizes.train, gen, small), device)
    infer = {
        kind: _to_device(case, case.batch(getattr(sizes, kind), gen, small), device)[0] for kind in ("bs1", "serve")
    }
    return stock, train, infer


def training_step(case: ModelCase, variant: str, device, small: bool = False):
    """(step, check) for ``variant`` of ``case``: ``step()`` runs one training step; ``check()``
    asserts the last loss is finite (for pytest-benchmark)."""
    stock, train, _ = prepared(case, small, device)
    module, run = variant_model(case, variant, stock, device, train[0])
    opt = _optimizer(case, module.parameters())
    last = []

    def step():
        last[:] = [_train_step(run, opt, case, train, device)]

    def check():
        assert last and torch.isfinite(last[0]).item(), f"{case.name} {variant}: loss {last}"

    return step, check


def timing_rounds(device, rounds: int | None = None) -> int:
    """Timing rounds: as given, else ``TIMING_ROUNDS`` on a GPU and one elsewhere."""
    return rounds or (TIMING_ROUNDS if device.type == "cuda" else 1)


def _sites(module) -> int | None:
    sites = getattr(module, "fusion_sites", None)
    return None if sites is None else len(sites)


def run_case(
    case: ModelCase, device, variants=None, small: bool = False, progress=None, rounds: int | None = None
) -> list[Result]:
    """Every measurement of ``case`` for each of ``variants`` (default :func:`case_variants`;
    ``eager`` first: the others are compared with it). The times are taken in ``rounds``
    rounds (default ``TIMING_ROUNDS`` on a GPU, 1 elsewhere), each timing every variant in
    turn, and each is the median over rounds: a host-bound step moves with the host's
    speed, which drifts within a process, and interleaving gives every variant the same drift."""
    variants = case_variants(case) if variants is None else variants
    stock, train, infer = prepared(case, small, device)
    results, live = [], []
    for variant in variants:
        module, run = variant_model(case, variant, stock, device, train[0])
        opt = _optimizer(case, module.parameters())
        r = Result(case.name, variant, sites=_sites(module))
        # The loss run first (from the same weights for every variant): it also warms
        # up (and for the compiled variants, compiles) the training step.
        step = functools.partial(_train_step, run, opt, case, train, device)
        r.losses = [float(step().detach()) for _ in range(LOSS_STEPS)]
        results.append(r)
        if progress is not None:
            progress.update()
        if variant == "eager2":  # the control run is for the losses only: its memory freed
            del module, run, opt, step
            continue
        r.gpu_ms = gpu_busy_ms(step, device, GPU_BUSY_STEPS)
        r.host_ms = host_ms(step, device)
        r.peak_mb = _peak_mb(step, device)
        live.append((r, module, run, step))
    samples = {id(r): {"train": [], "bs1": [], "serve": []} for r, *_ in live}
    for _ in range(timing_rounds(device, rounds)):
        for r, _module, _run, step in live:
            samples[id(r)]["train"].append(time_ms(step, device))
        for r, module, run, _step in live:
            module.eval()
            with torch.inference_mode(), autocast_for(device):
                for kind in ("bs1", "serve"):
                    samples[id(r)][kind].append(time_ms(functools.partial(run, infer[kind]), device))
            module.train()
        if progress is not None:
            progress.update()
    for r, *_ in live:
        r.train_ms, r.bs1_ms, r.serve_ms = (statistics.median(samples[id(r)][k]) for k in ("train", "bs1", "serve"))
    if case.decode:
        _decode_rows(live, stock.state_dict(), train[0], device, small)
    del live
    ref = results[0].losses
    for r in results:
        r.max_loss_rel_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r.losses, ref))
    return results


def _decode_rows(live, weights, ids, device, small: bool) -> None:
    """Each eager-run variant's decode step at ``DECODE_BATCHES``, their calls in turn (a
    compiled variant's ``generate`` runs its module eagerly: left out), and how many of its
    tokens agree with stock eager's. Every variant decodes from the same ``weights`` (the stock
    state dict): the timing rounds trained each a different number of steps."""
    tokens = 4 if small else DECODE_TOKENS
    prompt = ids[:1, : min(DECODE_PROMPT, ids.shape[1])]
    rows = [(r, module) for r, module, run, _step in live if run is module]
    rows.sort(key=lambda row: row[0].variant != "eager")  # (stock eager's tokens first: the reference)
    for _, module in rows:
        module.load_state_dict(weights)
    agree = [tokens] * len(rows)
    for batch in DECODE_BATCHES:
        ms, outs = decode_side_by_side(
            [module for _, module in rows],
            prompt.expand(batch, -1).contiguous(),
            device,
            tokens,
            1 if small else DECODE_CALLS,
        )
        for i, ((r, _), took, out) in enumerate(zip(rows, ms, outs)):
            setattr(r, f"decode{batch}_ms", took)
            same = (out == outs[0]).all(0)[prompt.shape[1] :].tolist() if out.shape == outs[0].shape else [False]
            agree[i] = min(agree[i], same.index(False) if False in same else tokens)
    for (r, _), n in zip(rows, agree):
        r.decode_equal, r.decode_agree = n == tokens, n


def run_models(names, device, use_compile=True, small: bool | None = None, progress=True, rounds: int | None = None):
    """Run the named cases (``rounds``: timing rounds, see :func:`run_case`); returns
    (results, skipped: {name: reason}). A case that fails is skipped with its error, so
    that the others still run."""
    small = device.type != "cuda" if small is None else small
    results, skipped = [], {}
    cases = [MODELS[n] for n in names]
    rounds = timing_rounds(device, rounds)
    # A step per variant's loss run, and one per timing round.
    bar = progress_bar(
        sum(len(case_variants(c, use_compile)) + len(c.peers) + rounds for c in cases), "models", progress
    )
    for case in cases:
        variants = case_variants(case, use_compile)
        reason = unavailable(case)
        if reason is not None:
            skipped[case.name] = reason
            bar.update(len(variants) + len(case.peers) + rounds)
            continue
        peers = []
        for name, package, fuse_peer in case.peers:
            reason = _import_error(package) or _peer_error(case, fuse_peer, device)
            if reason is None:
                peers.append(name)
            else:
                skipped[f"{case.name} {name}"] = reason
                bar.update()
        try:
            results += run_case(case, device, variants + peers, small, bar, rounds)
        except Exception as exc:  # one model failing leaves the others' rows
            traceback.print_exc()
            skipped[case.name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        torch._dynamo.reset()
        _free(device)
    bar.close()
    return results, skipped


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: Result fields that are times or sizes: a multi-process report gives their median.
_MEASURED = ("train_ms", "gpu_ms", "host_ms", "bs1_ms", "serve_ms", "peak_mb", "decode1_ms", "decode16_ms")


def run_processes(argv: list[str], processes: int, progress=True) -> tuple[list[dict], dict, list]:
    """The report ``python -m fusedkit bench <argv>`` in ``processes`` processes, one after
    another: (rows, skipped, per-process rows). Each row is a model and variant's median over
    the processes that ran it, with ``train_x_range``, the least and most stock eager / this
    training step of one process: one slow host cannot make or break a row."""
    from .processes import run_children

    payloads, skipped = run_children(argv, processes, "models", progress)
    runs = [data["models"] for data in payloads]
    for data in payloads:
        skipped.update(data.get("skipped") or {})
    return merge_processes(runs), skipped, runs


KEEP_PROCESSES = 3


def add_processes(path: str, env: dict, payload: dict) -> dict:
    """``payload`` (this run's rows, skipped cases and per-process rows) joined with the report
    that ``path`` holds, when it holds one of the same GPU: each model's rows from its newest
    ``KEEP_PROCESSES`` processes, merged again. Every per-process row names its commit, and the
    environment lists the commits kept: a record gathered over several device leases says so."""
    import json
    import os

    new_runs = [[{**r, "commit": r.get("commit", env.get("commit"))} for r in rows] for rows in payload["processes"]]
    old_runs, old_skipped = [], {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        gpu, was = env.get("gpu"), old.get("environment", {}).get("gpu")
        if gpu != was:
            raise SystemExit(f"--add: {path} holds a report of {was}, this one ran on {gpu}: name another file")
        commit = old.get("environment", {}).get("commit")
        old_runs = [[{"commit": commit, **r} for r in rows] for rows in old.get("processes") or [old["models"]]]
        old_skipped = old.get("skipped") or {}
    ran = {r["model"] for rows in new_runs for r in rows}
    kept: list[list[dict]] = []
    count: dict[str, int] = {}
    for rows in reversed(old_runs + new_runs):  # newest first
        models = {r["model"] for r in rows}
        keep = {m for m in models if count.get(m, 0) < KEEP_PROCESSES}
        for m in keep:
            count[m] = count.get(m, 0) + 1
        rows = [r for r in rows if r["model"] in keep]
        if rows:
            kept.insert(0, rows)
    skipped = {k: v for k, v in old_skipped.items() if k not in ran} | payload["skipped"]
    env["commits"] = sorted({r["commit"] for rows in kept for r in rows if r.get("commit")})
    return {"models": merge_processes(kept), "skipped": skipped, "processes": kept}


def merge_processes(runs: list[list[dict]]) -> list[dict]:
    """One row per model and variant from several processes' rows: medians of the measured
    fields, the training-step ratio's range, the losses and sites of the first process."""
    merged: dict[tuple, dict] = {}
    for rows in runs:
        base = {r["model"]: r for r in rows if r["variant"] == "eager"}
        for r in rows:
            key = (r["model"], r["variant"])
            m = merged.setdefault(
                key, {**r, "_samples": {k: [] for k in _MEASURED}, "_x": [], "_equal": [], "_agree": [], "_n": 0}
            )
            m["_n"] += 1
            for k in _MEASURED:
                if r.get(k) is not None:
                    m["_samples"][k].append(r[k])
            b = base.get(r["model"])
            if b and b.get("train_ms") and r.get("train_ms"):
                m["_x"].append(b["train_ms"] / r["train_ms"])
            if r.get("decode_equal") is not None:
                m["_equal"].append(r["decode_equal"])
            if r.get("decode_agree") is not None:
                m["_agree"].append(r["decode_agree"])
    out = []
    for m in merged.values():
        samples, ratios, equal, agree = m.pop("_samples"), m.pop("_x"), m.pop("_equal"), m.pop("_agree")
        m["decode_equal"] = all(equal) if equal else None
        m["decode_agree"] = min(agree) if agree else None
        for k, v in samples.items():
            m[k] = statistics.median(v) if v else None
        m["processes"] = m.pop("_n")  # the processes that gave this row (a failed case leaves some out)
        m["train_x_range"] = [min(ratios), max(ratios)] if ratios else None
        out.append(m)
    return out


def _ratio(base, value):
    return "-" if base is None or value is None else f"{base / value:.2f}"


def format_models_table(results, skipped: dict) -> str:
    """One row per model and variant; x = stock eager's time / this variant's (above 1: faster).
    ``results``: :class:`Result` objects or their dicts (a multi-process report's medians)."""
    rows_ = [r if isinstance(r, dict) else vars(r) for r in results]
    processes = max((r.get("processes", 1) for r in rows_), default=1)
    head = (
        f"{'model':<14} {'variant':<17} {'sites':>5} {'train ms':>9} {'x eager':>7} {'x range':>9} {'GPU ms':>8} "
        f"{'host ms':>8} {'bs1 ms':>8} {'x eager':>7} {'serve ms':>9} {'x eager':>7} {'dec1 ms':>7} {'dec16 ms':>8} "
        f"{'x eager':>7} {'agree':>5} {'peak MiB':>8} {'loss diff':>9}"
    )
    over = f"medians over {processes} processes; " if processes > 1 else ""
    lines = [
        f"Real models: training step, inference, decode, peak memory, loss over {LOSS_STEPS} steps on one "
        f"batch ({over}ms: do_bench medians; x = stock eager time / this time; x range: its least and most "
        f"in one process; GPU ms = the kernels' summed time a step, over {GPU_BUSY_STEPS} steps; host ms = the "
        "host's time to issue a step, the GPU idle; dec ms: a decode step through generate, ms a token, at "
        f"batch {' and '.join(map(str, DECODE_BATCHES))} (* tokens differ from stock eager's; agree: the new "
        "tokens equal to stock eager's before the first that differs, the least over processes); loss diff = "
        "largest relative difference from stock eager's loss; eager2 = stock again, the nondeterminism control)",
        head,
        "-" * len(head),
    ]

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    by_model: dict[str, dict[str, dict]] = {}
    for r in rows_:
        by_model.setdefault(r["model"], {})[r["variant"]] = r
    for model, rows in by_model.items():
        base = rows.get("eager") or {}
        for r in rows.values():
            span = r.get("train_x_range")
            span = "-" if not span else f"{span[0]:.2f}-{span[1]:.2f}"
            unequal = "*" if r.get("decode_equal") is False else ""
            lines.append(
                f"{model:<14} {r['variant']:<17} {num(r.get('sites'), 'd'):>5} {num(r['train_ms'], '.3f'):>9} "
                f"{_ratio(base.get('train_ms'), r['train_ms']):>7} {span:>9} {num(r['gpu_ms'], '.3f'):>8} "
                f"{num(r['host_ms'], '.3f'):>8} {num(r['bs1_ms'], '.3f'):>8} "
                f"{_ratio(base.get('bs1_ms'), r['bs1_ms']):>7} {num(r['serve_ms'], '.3f'):>9} "
                f"{_ratio(base.get('serve_ms'), r['serve_ms']):>7} {num(r.get('decode1_ms'), '.2f') + unequal:>7} "
                f"{num(r.get('decode16_ms'), '.2f') + unequal:>8} "
                f"{_ratio(base.get('decode16_ms'), r.get('decode16_ms')):>7} {num(r.get('decode_agree'), 'd'):>5} "
                f"{num(r['peak_mb'], '.0f'):>8} "
                f"{num(r['max_loss_rel_diff'], '.1e'):>9}"
            )
    for name, reason in skipped.items():
        lines.append(f"{name:<24} skipped: {reason}")
    return "\n".join(lines)
