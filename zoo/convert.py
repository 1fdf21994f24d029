"""A trained model turned into another architecture, started from its weights where the shapes allow, so that
distillation from the original (`zoo distill`) has less to recover than training from scratch:

- "gqa": attention layers to fewer KV heads, each new head's key and value projections the mean of the heads it
  replaces (GQA's mean pooling before uptraining, Ainslie et al. 2023);
- "swa": attention layers that see only the newest `window` tokens, weights unchanged (the cache stops growing);
- "gdn": chosen attention layers become Gated DeltaNet layers. Their query, key and value projections are the
  attention's (each KV head repeated for its query heads), the output projection is o_proj, and the short causal
  conv starts as the identity: a linear RNN started from attention's projections, as MambaInLlama (Wang et al.
  2024) starts Mamba's C, B and x from Q, K and V. The output gate and the decays have no counterpart and start as
  a fresh layer's;
- "mla": attention layers become multi-head latent attention (DeepSeek-V2): partial RoPE on a uniform subset of
  frequencies, the nope keys and values through one latent by a whitened truncated SVD (zoo/convert_mla.py), from
  calibration windows of the layers' inputs.

Every other weight is copied unchanged. The converted model is a normal archzoo model.
"""
import copy
import dataclasses

import torch

from zoo.config import MixerSpec
from zoo.convert_mla import attention_as_mla, check_mla_sizes, default_rank, input_grams
from zoo.model import DecoderLM
from zoo.pruning import head_cut_layers

TARGETS = ("gqa", "swa", "gdn", "mla")


def convert(model: DecoderLM, to: str, *, kv_heads: int | None = None, window: int | None = None,
            layers: list[int] | None = None, kv_rank: int | None = None, rope_dim: int | None = None,
            calibration: torch.Tensor | None = None) -> DecoderLM:
    """A new model: `to` "gqa" (kv_heads), "swa" (window), "gdn" or "mla" (kv_rank, default half the layer's cache
    less the rope key; rope_dim, default half a head; calibration, token windows [N, T] whose layer inputs whiten
    the latent), over the attention layers given (default: all that compute their own keys and values)."""
    if to not in TARGETS:
        raise ValueError(f"unknown conversion target {to!r}; allowed: {', '.join(TARGETS)}")
    eligible = head_cut_layers(model.config)
    chosen = eligible if layers is None else list(layers)
    bad = [i for i in chosen if i not in eligible]
    if not chosen or bad:
        raise ValueError(f"layers {bad or chosen} cannot be converted: attention layers that compute their own keys "
                         f"and values are {eligible}")
    specs = copy.deepcopy(model.config.layers)
    for i in chosen:
        mixer = model.blocks[i].mixer
        if to == "gqa":
            if not isinstance(kv_heads, int) or kv_heads < 1 or mixer.n_kv_heads % kv_heads:
                raise ValueError(f"kv_heads must divide layer {i}'s {mixer.n_kv_heads} KV heads (each new head the "
                                 f"mean of a group of them), got {kv_heads!r}")
            specs[i].params.update(n_kv_heads=kv_heads, head_dim=mixer.head_dim)
        elif to == "swa":
            if not isinstance(window, int) or window < 1:
                raise ValueError(f"window must be an integer >= 1 (tokens each query sees), got {window!r}")
            specs[i].params["window"] = window
        elif to == "gdn":
            specs[i] = MixerSpec("gdn", {"n_heads": mixer.n_heads, "head_dim": mixer.head_dim})
        else:
            specs[i] = mla_spec(model, i, kv_rank, rope_dim, calibration)
    grams = input_grams(model, chosen, calibration) if to == "mla" else {}
    config = dataclasses.replace(model.config, layers=specs, name=f"{model.config.name}-to-{to}")
    converted = DecoderLM(config).to(next(model.parameters()).dtype)
    state = converted.state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
            if layer in chosen and ".mixer." in name:
                continue  # written below
            state[name] = tensor.clone()
        for i in chosen:
            old, new = model.blocks[i].mixer, f"blocks.{i}.mixer."
            if to == "gqa":
                state.update(pooled_kv(old, kv_heads, new))
            elif to == "swa":
                state.update({new + k: v.clone() for k, v in old.state_dict().items()})
            elif to == "gdn":
                state.update(attention_as_gdn(old, converted.blocks[i].mixer, new))
            else:
                state.update(attention_as_mla(old, converted.blocks[i].mixer, new, grams[i]))
    converted.load_state_dict(state)
    return converted.eval()


def mla_spec(model: DecoderLM, layer: int, kv_rank, rope_dim, calibration) -> MixerSpec:
    """Layer's MLA spec (nope + rope channels a whole head, values a whole head), its sizes checked."""
    mixer = model.blocks[layer].mixer
    rope_dim = mixer.head_dim // 2 if rope_dim is None else rope_dim
    kv_rank = default_rank(mixer, rope_dim) if kv_rank is None and isinstance(rope_dim, int) else kv_rank
    check_mla_sizes(mixer, layer, kv_rank, rope_dim, model.config.d_model)
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype != torch.long:
        raise ValueError("an MLA conversion needs calibration token windows (a [N, T] integer tensor): the latent is "
                         f"fitted to the layers' inputs on them; got {type(calibration).__name__}")
    return MixerSpec("mla", {"n_heads": mixer.n_heads, "kv_lora_rank": kv_rank, "q_lora_rank": None,
                             "qk_nope_head_dim": mixer.head_dim - rope_dim, "qk_rope_head_dim": rope_dim,
                             "v_head_dim": mixer.head_dim})


def pooled_kv(mixer, kv_heads: int, prefix: str) -> dict:
    """The attention's weights with its KV heads averaged in consecutive groups down to kv_heads."""
    out = {prefix + k: v.clone() for k, v in mixer.state_dict().items()}
    pool = mixer.n_kv_heads // kv_heads
    for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if prefix + name in out:
            weight = out[prefix + name]
            grouped = weight.view(kv_heads, pool, mixer.head_dim, *weight.shape[1:])
            out[prefix + name] = grouped.mean(dim=1).flatten(0, 1)
    if mixer.qk_norm == "all" and prefix + "k_norm.weight" in out:
        gains = out[prefix + "k_norm.weight"]
        out[prefix + "k_norm.weight"] = gains.view(kv_heads, pool, mixer.head_dim).mean(dim=1).flatten()
    return out


def attention_as_gdn(attention, gdn, prefix: str) -> dict:
    """The fresh GDN layer's weights with q, k, v and the output projection from the attention's and an identity
    conv; its gate, beta and decay rows as initialised."""
    if attention.q_proj.bias is not None:
        raise ValueError("an attention layer with biases has no Gated DeltaNet counterpart (its projections have none)")
    out = {prefix + k: v.clone() for k, v in gdn.state_dict().items()}
    group = attention.n_heads // attention.n_kv_heads
    keys = attention.k_proj.weight.view(attention.n_kv_heads, 1, attention.head_dim, -1)
    values = attention.v_proj.weight.view(attention.n_kv_heads, 1, attention.head_dim, -1)
    repeated = [w.expand(-1, group, -1, -1).reshape(attention.n_heads * attention.head_dim, -1) for w in (keys, values)]
    in_proj = out[prefix + "in_proj.weight"]
    width = attention.n_heads * attention.head_dim
    in_proj[:width] = attention.q_proj.weight
    in_proj[width:2 * width] = repeated[0]
    in_proj[2 * width:3 * width] = repeated[1]
    conv = torch.zeros_like(out[prefix + "conv1d.weight"])
    conv[:, 0, -1] = 1  # the newest token's tap: the conv passes q, k and v through
    out[prefix + "conv1d.weight"] = conv
    out[prefix + "out_proj.weight"] = attention.o_proj.weight.clone()
    return out
