"""Weights interop with HF transformers: an HF model in, a zoo model with the same weights (and logits) out."""
import torch

from zoo.config import MixerSpec, ModelConfig
from zoo.model import DecoderLM


def from_hf(hf_model) -> DecoderLM:
    """Convert a transformers causal LM (supported: LlamaForCausalLM) into a zoo model with the same weights."""
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in CONVERTERS:
        raise ValueError(f"from_hf does not support model_type {model_type!r}; supported: {', '.join(CONVERTERS)}")
    config_of, names_of = CONVERTERS[model_type]
    config = config_of(hf_model.config)
    model = DecoderLM(config).to(next(hf_model.parameters()).dtype)
    hf_state = hf_model.state_dict()
    ours = {}
    for hf_name, our_name in names_of(config):
        if hf_name not in hf_state:
            raise ValueError(f"HF checkpoint lacks {hf_name!r}, needed for {our_name!r}")
        ours[our_name] = hf_state[hf_name]
    if config.tie_embeddings:
        ours["head.weight"] = ours["embed.weight"]
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model


def rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": hf_config.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {rope['rope_type']!r} is not supported; only the default RoPE")
    return float(rope["rope_theta"])


def llama_config(c) -> ModelConfig:
    if c.hidden_act != "silu" or getattr(c, "mlp_bias", False):
        raise ValueError(f"only SiLU-gated MLPs without bias are supported, got hidden_act={c.hidden_act!r}, mlp_bias={c.mlp_bias}")
    attention = {
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "bias": bool(getattr(c, "attention_bias", False)),
    }
    return ModelConfig(
        vocab_size=c.vocab_size,
        d_model=c.hidden_size,
        layers=[MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)],
        mlp="swiglu",
        mlp_hidden=c.intermediate_size,
        norm="rmsnorm",
        norm_eps=c.rms_norm_eps,
        rope_base=rope_theta(c),
        tie_embeddings=bool(c.tie_word_embeddings),
        max_seq_len=c.max_position_embeddings,
        name="llama",
    )


def llama_names(config: ModelConfig):
    """(HF name, zoo name) pairs for every weight."""
    yield "model.embed_tokens.weight", "embed.weight"
    yield "model.norm.weight", "norm.weight"
    if not config.tie_embeddings:
        yield "lm_head.weight", "head.weight"
    for i, spec in enumerate(config.layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        yield hf + "input_layernorm.weight", ours + "mixer_norm.weight"
        yield hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield hf + f"self_attn.{proj}.weight", ours + f"mixer.{proj}.weight"
            if spec.params.get("bias"):
                yield hf + f"self_attn.{proj}.bias", ours + f"mixer.{proj}.bias"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield hf + f"mlp.{proj}.weight", ours + f"mlp.{proj}.weight"


CONVERTERS = {"llama": (llama_config, llama_names)}


@torch.no_grad()
def copy_weights_to_hf(model: DecoderLM, hf_model) -> None:
    """The reverse mapping: load a zoo model's weights into an HF model of the matching config (benchmarks, oracles)."""
    config_of, names_of = CONVERTERS[hf_model.config.model_type]
    ours = model.state_dict()
    hf_state = {hf_name: ours[our_name] for hf_name, our_name in names_of(model.config)}
    hf_model.load_state_dict(hf_state, strict=not model.config.tie_embeddings)
