"""Weights interop with HF transformers: an HF model in, a zoo model with the same weights (and logits) out.

Supported: LlamaForCausalLM, MistralForCausalLM (sliding window), DeepseekV3ForCausalLM (MLA, dense MLPs only),
MambaForCausalLM and Mamba2ForCausalLM.
"""
import inspect
from typing import Callable, NamedTuple

import torch

from zoo.config import MixerSpec, ModelConfig
from zoo.hf_mamba import mamba_config, mamba_names
from zoo.hf_mamba2 import mamba2_config, mamba2_names
from zoo.mixers import mixer_class
from zoo.model import DecoderLM


class Converter(NamedTuple):
    config_of: Callable  # HF config -> ModelConfig
    names_of: Callable  # ModelConfig -> (HF name, zoo name) for every weight
    # (HF config, ModelConfig) -> {zoo name: rows}: zoo weight = HF weight[rows] where the layouts differ by a permutation
    row_orders: Callable = lambda hf_config, config: {}


def from_hf(hf_model) -> DecoderLM:
    """Convert a transformers causal LM (llama, mistral, dense deepseek_v3) into a zoo model with the same weights."""
    converter = converter_for(hf_model.config)
    config = converter.config_of(hf_model.config)
    model = DecoderLM(config).to(next(hf_model.parameters()).dtype)
    hf_state = hf_model.state_dict()
    ours = {}
    for hf_name, our_name in converter.names_of(config):
        if hf_name not in hf_state:
            raise ValueError(f"HF checkpoint lacks {hf_name!r}, needed for {our_name!r}")
        ours[our_name] = hf_state[hf_name]
    for our_name, rows in converter.row_orders(hf_model.config, config).items():
        ours[our_name] = ours[our_name][rows]
    if config.tie_embeddings:
        ours["head.weight"] = ours["embed.weight"]
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def copy_weights_to_hf(model: DecoderLM, hf_model) -> None:
    """The reverse mapping: load a zoo model's weights into an HF model of the matching config (benchmarks, oracles)."""
    converter = converter_for(hf_model.config)
    check_same_architecture(model.config, converter.config_of(hf_model.config))
    ours = model.state_dict()
    hf_state = {hf_name: ours[our_name] for hf_name, our_name in converter.names_of(model.config)}
    hf_of = {our_name: hf_name for hf_name, our_name in converter.names_of(model.config)}
    for our_name, rows in converter.row_orders(hf_model.config, model.config).items():
        hf_state[hf_of[our_name]] = ours[our_name][torch.argsort(rows)]  # inverse permutation
    hf_model.load_state_dict(hf_state, strict=not model.config.tie_embeddings)


def converter_for(hf_config) -> Converter:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CONVERTERS:
        raise ValueError(f"from_hf does not support model_type {model_type!r}; supported: {', '.join(CONVERTERS)}")
    return CONVERTERS[model_type]


def rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf_config.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope['rope_type']!r} is not supported; only the default RoPE")
    return float(rope["rope_theta"])


def check_gated_mlp(c) -> None:
    if c.hidden_act != "silu" or getattr(c, "mlp_bias", False):
        raise ValueError(f"only SiLU-gated MLPs without bias are supported, got hidden_act={c.hidden_act!r}, "
                         f"mlp_bias={getattr(c, 'mlp_bias', False)}")


def decoder_config(c, layers: list[MixerSpec], name: str) -> ModelConfig:
    """The parts every supported HF decoder shares: embedding, RMSNorm pre-norm blocks, SwiGLU MLP, head."""
    check_gated_mlp(c)
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=layers,
        mlp="swiglu",
        mlp_hidden=c.intermediate_size,
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        rope_base=rope_theta(c),
        tie_embeddings=bool(c.tie_word_embeddings),
        max_seq_len=c.max_position_embeddings,
        name=name,
    )


def attention_settings(c) -> dict:
    return {
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "bias": bool(getattr(c, "attention_bias", False)),
    }


def llama_config(c) -> ModelConfig:
    attention = attention_settings(c)
    return decoder_config(c, [MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)], "llama")


def mistral_config(c) -> ModelConfig:
    """Llama with every layer attending to the newest `sliding_window` keys, itself included (None: no window)."""
    attention = {**attention_settings(c), "window": c.sliding_window}
    return decoder_config(c, [MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)], "mistral")


def deepseek_v3_config(c) -> ModelConfig:
    dense = c.first_k_dense_replace
    if dense is None or dense < c.num_hidden_layers:
        raise ValueError(
            f"DeepseekV3 mixture-of-experts layers are not supported: first_k_dense_replace={dense} with "
            f"num_hidden_layers={c.num_hidden_layers} makes layers {dense or 0}..{c.num_hidden_layers - 1} MoE; "
            f"only dense models convert (first_k_dense_replace >= num_hidden_layers)"
        )
    if c.attention_bias:
        raise ValueError("DeepseekV3 with attention_bias=True is not supported (zoo MLA projections have no bias)")
    mla = {
        "n_heads": c.num_attention_heads,
        "kv_lora_rank": c.kv_lora_rank,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "norm_eps": 1e-6,  # HF's q_a_layernorm / kv_a_layernorm use their default eps, not rms_norm_eps
    }
    return decoder_config(c, [MixerSpec("mla", dict(mla)) for _ in range(c.num_hidden_layers)], "deepseek_v3")


def decoder_names(config: ModelConfig):
    """(HF name, zoo name) pairs for every weight; attention layers use HF Llama's names, MLA layers HF DeepseekV3's."""
    yield "model.embed_tokens.weight", "embed.weight"
    yield "model.norm.weight", "norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "head.weight"
    for i, spec in enumerate(config.layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        yield hf + "input_layernorm.weight", ours + "mixer_norm.weight"
        yield hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"
        for name in mixer_weight_names(spec):
            yield hf + f"self_attn.{name}", ours + f"mixer.{name}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield hf + f"mlp.{proj}.weight", ours + f"mlp.{proj}.weight"


def mixer_weight_names(spec: MixerSpec) -> list[str]:
    if spec.kind == "attention":
        suffixes = ("weight", "bias") if spec.params.get("bias") else ("weight",)
        return [f"{proj}.{s}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj") for s in suffixes]
    if spec.kind == "mla":
        q = ["q_proj"] if spec.params.get("q_lora_rank") is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        return [f"{m}.weight" for m in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
    raise ValueError(f"no HF weight names for mixer kind {spec.kind!r}")


def interleaved_rope_rows(hf_config, config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF DeepseekV3 with rope_interleave rotates the pairs (x0, x1), (x2, x3), ... of the rope dims and returns
    [rotated evens ; rotated odds]: exactly rotate-half RoPE applied to [x0, x2, ... ; x1, x3, ...]. So the zoo's
    rotate-half MLA equals it when the rows producing the rope dims (per query head, and of the shared rope key)
    are reordered evens first. Attention scores are unchanged: q and k are permuted alike."""
    if not hf_config.rope_interleave:
        return {}
    orders = {}
    for i, spec in enumerate(config.layers):
        p = spec.params
        nope, rope, rank = p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["kv_lora_rank"]
        deinterleave = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        head = torch.cat([torch.arange(nope), nope + deinterleave])
        q_proj = "q_proj" if p.get("q_lora_rank") is None else "q_b_proj"
        orders[f"blocks.{i}.mixer.{q_proj}.weight"] = torch.cat([h * (nope + rope) + head for h in range(p["n_heads"])])
        orders[f"blocks.{i}.mixer.kv_a_proj_with_mqa.weight"] = torch.cat([torch.arange(rank), rank + deinterleave])
    return orders


CONVERTERS = {
    "llama": Converter(llama_config, decoder_names),
    "mistral": Converter(mistral_config, decoder_names),
    "deepseek_v3": Converter(deepseek_v3_config, decoder_names, interleaved_rope_rows),
    "mamba": Converter(mamba_config, mamba_names),
    "mamba2": Converter(mamba2_config, mamba2_names),
}


def check_same_architecture(config: ModelConfig, hf_side: ModelConfig) -> None:
    """copy_weights_to_hf: what the weights alone do not fix (how a projection splits into heads, the window,
    whether blocks have an MLP, RoPE base, norm eps) must agree, or the HF twin would compute something else without any error."""
    problems = [f"{field}: zoo {getattr(config, field)} vs HF {getattr(hf_side, field)}"
                for field in ("n_layers", "mlp", "ffns", "rope_base", "norm_eps")
                if getattr(config, field) != getattr(hf_side, field)]
    for i, (ours, theirs) in enumerate(zip(config.layers, hf_side.layers)):
        a, b = mixer_settings(ours, config), mixer_settings(theirs, hf_side)
        if a != b:
            problems.append(f"layer {i}: zoo {a} vs HF {b}")
    if problems:
        raise ValueError("the HF model's config does not match the zoo model: " + "; ".join(problems))


def mixer_settings(spec: MixerSpec, config: ModelConfig) -> tuple:
    """A layer's mixer arguments with defaults filled in, as the mixer will see them."""
    bound = inspect.signature(mixer_class(spec.kind)).bind_partial(**spec.params)
    bound.apply_defaults()
    settings = {k: v for k, v in bound.arguments.items() if k not in ("d_model", "layer_idx")}
    if "rope_base" not in spec.params and "rope_base" in settings:
        settings["rope_base"] = config.rope_base
    if spec.kind == "attention":
        settings["n_kv_heads"] = settings["n_kv_heads"] or settings["n_heads"]
        settings["head_dim"] = settings["head_dim"] or config.d_model // settings["n_heads"]
    return spec.kind, settings
