"""The memory a `zoo train` run asks for, estimated from its settings before any model is built, so a batch, a
context or a model too large for the device is refused by name rather than by the allocator mid-step.

The estimate is the peak of a training step in fp32, each part summed though they do not all peak together:
- the weights (zoo.model.model_bytes), a gradient for each and AdamW's two moments: WEIGHT_COPIES x the weights;
- the activations autograd keeps for the backward, per token and layer: the mixer's width (its parameters over
  d_model) times its kind's SAVED_PER_WIDTH, the MLP's hidden width times SAVED_PER_HIDDEN, SAVED_PER_NORM x d_model
  per norm;
- the logits: LOGIT_COPIES [tokens, vocab] tensors (the log-softmax kept, its gradient and the logits').
The factors are the values autograd kept (torch.autograd.graph.saved_tensors_hooks, distinct storages) per token in
fp32 on CPU at the tiny and small presets, batch 4 x 256 tokens, the larger of the two rounded up: softmax attention
1.6-1.7, MLA 2.9, linear attention 3.8, Mamba 4.3, Mamba-2 6.5, Gated DeltaNet 10.4 (its chunked form keeps
[chunk, chunk] matrices per head); SwiGLU 5.5 and GELU 3.0 per hidden unit; RMSNorm 1 per d_model, besides its input.
An MoE layer (not measured) is priced as SwiGLU over the hidden units a token runs (top_k routed experts and the
shared ones), plus its copy of the input per routed expert (the grouped path's sorted rows).
A whole training step's peak RSS growth (weights aside) measured 0.60-0.90x the estimate at the small preset (batch
4 x 128 and 8 x 256 tokens) and 0.84-1.11x at the tiny one (64 x 256), for gqa, mla, linear, mamba, mamba2, gdn,
hybrid and diffusion. bf16 autocast keeps about half the activations; the scan states that Mamba's CUDA path keeps
without mamba-ssm's kernels are not counted.
"""
import math

import torch

from zoo.config import ModelConfig
from zoo.feedforward import bound_arguments
from zoo.mixers import mixer_bytes
from zoo.model import model_bytes
from zoo.resources import check_bytes

FP32 = torch.float32
WEIGHT_COPIES = 4  # the weight, its gradient, AdamW's exp_avg and exp_avg_sq
SAVED_PER_WIDTH = {"attention": 2, "mla": 3, "linear": 4, "mamba": 5, "mamba2": 7, "gdn": 11}
UNMEASURED_MIXER = max(SAVED_PER_WIDTH.values())  # a mixer kind not measured yet is priced as the hungriest
SAVED_PER_HIDDEN = {"swiglu": 6, "gelu": 3}
UNMEASURED_FFN = max(SAVED_PER_HIDDEN.values())  # an FFN kind not measured yet is priced as the hungriest
SAVED_PER_NORM = 2  # its input and the normalised copy
LOGIT_COPIES = 3


def layer_values(config: ModelConfig, layer_idx: int) -> int:
    """Values one token keeps for the backward in layer layer_idx: its mixer's, its feed-forward's and its norms'."""
    spec = config.layers[layer_idx]
    width = mixer_bytes(spec, config, layer_idx, FP32) / FP32.itemsize / config.d_model
    norms = 1 if config.ffn(layer_idx).kind == "none" else 2
    return (math.ceil(SAVED_PER_WIDTH.get(spec.kind, UNMEASURED_MIXER) * width) + ffn_values(config, layer_idx)
            + SAVED_PER_NORM * norms * config.d_model)


def ffn_values(config: ModelConfig, layer_idx: int) -> int:
    """Values one token keeps for the backward in layer layer_idx's feed-forward."""
    spec = config.ffn(layer_idx)
    if spec.kind == "none":
        return 0
    args = bound_arguments(spec, config, layer_idx)
    if spec.kind != "moe":
        return SAVED_PER_HIDDEN.get(spec.kind, UNMEASURED_FFN) * args["hidden"]
    hidden = (args["top_k"] + args["n_shared_experts"]) * (args["expert_hidden"] or args["hidden"])
    return SAVED_PER_HIDDEN["swiglu"] * hidden + args["top_k"] * config.d_model


def activation_bytes(config: ModelConfig, tokens: int) -> int:
    """Bytes autograd keeps for the backward of a forward over `tokens` tokens (batch x context), in fp32."""
    per_token = sum(layer_values(config, i) for i in range(config.n_layers)) + LOGIT_COPIES * config.vocab_size
    return tokens * per_token * FP32.itemsize


def training_bytes(config: ModelConfig, batch_size: int, context: int) -> int:
    """The peak bytes of a training step at this batch and context: weights with their training state, and
    activations."""
    return WEIGHT_COPIES * model_bytes(config, FP32) + activation_bytes(config, batch_size * context)


def check_training_bytes(config: ModelConfig, batch_size: int, context: int, device: str) -> None:
    """Refuse a run whose step would not fit in the memory free on `device` (or under ZOO_MEMORY_LIMIT)."""
    what = (f"training {config.name} (d_model={config.d_model:,}, n_layers={config.n_layers:,}, "
            f"vocab_size={config.vocab_size:,}) at batch_size={batch_size:,} and context={context:,}")
    check_bytes(what, training_bytes(config, batch_size, context), device,
                lower="batch_size, context, or the model's size (--preset, --set n_layers=..., d_model=...)")
