"""Weights interop with HF transformers: an HF model in, a zoo model with the same weights (and logits) out.

Supported: LlamaForCausalLM, MistralForCausalLM (sliding window), MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM and OlmoeForCausalLM (mixture of experts, zoo/hf_moe.py; the last two with q/k RMSNorm in
attention), DeepseekV3ForCausalLM (MLA; dense layers, then MoE layers), MambaForCausalLM and Mamba2ForCausalLM.
"""
import inspect
from typing import Callable, NamedTuple

import torch

from zoo.config import FFNSpec, MixerSpec, ModelConfig
from zoo.hf_mamba import mamba_config, mamba_names
from zoo.hf_mamba2 import mamba2_config, mamba2_names
from zoo.hf_moe import (deepseek_v3_ffns, expert_fusions, ffn_names, ffn_settings, mixtral_ffns, olmoe_ffns,
                        qwen2_moe_ffns, qwen3_moe_ffns, routed_scales)
from zoo.mixers import mixer_class
from zoo.model import DecoderLM


class Converter(NamedTuple):
    config_of: Callable  # HF config -> ModelConfig
    names_of: Callable  # ModelConfig -> (HF name, zoo name) for every weight
    # (HF config, ModelConfig) -> {zoo name: rows}: zoo weight = HF weight[rows] where layouts differ by a permutation
    row_orders: Callable = lambda hf_config, config: {}
    # ModelConfig -> [Fused]: HF weights that are several zoo weights concatenated (an MoE's gate_up_proj)
    fused: Callable = lambda config: []
    # (HF config, ModelConfig) -> {zoo name: factor}: zoo weight = HF weight * factor (a scale HF applies in forward)
    scales: Callable = lambda hf_config, config: {}
    # ModelConfig -> [zoo name]: zoo weights HF has no place for: zero from HF, and must be zero to go to HF
    absent: Callable = lambda config: []


def from_hf(hf_model) -> DecoderLM:
    """Convert a transformers causal LM (see CONVERTERS) into a zoo model with the same weights; a config the zoo
    would compute differently is refused with a ValueError before any weight is read."""
    converter = converter_for(hf_model.config)
    config = converter.config_of(hf_model.config)
    model = DecoderLM(config).to(next(hf_model.parameters()).dtype)
    ours = zoo_weights(converter, hf_model, model)
    if config.tie_embeddings:
        ours["head.weight"] = ours["embed.weight"]
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if missing or unexpected:
        raise ValueError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model


def zoo_weights(converter: Converter, hf_model, model: DecoderLM) -> dict[str, torch.Tensor]:
    """Every zoo weight from HF's: renamed, split where HF fuses, reordered, rescaled, zero where HF has none."""
    config, hf_config, hf_state = model.config, hf_model.config, hf_model.state_dict()
    ours = {our_name: hf_weight(hf_state, hf_name, our_name) for hf_name, our_name in converter.names_of(config)}
    for hf_name, parts, dim in converter.fused(config):
        ours.update(zip(parts, hf_weight(hf_state, hf_name, parts[0]).chunk(len(parts), dim)))
    for our_name, rows in converter.row_orders(hf_config, config).items():
        ours[our_name] = ours[our_name][rows]
    for our_name, factor in converter.scales(hf_config, config).items():
        ours[our_name] = ours[our_name] * factor
    shapes = model.state_dict()
    ours.update({our_name: torch.zeros_like(shapes[our_name]) for our_name in converter.absent(config)})
    return ours


def hf_weight(hf_state: dict, hf_name: str, our_name: str) -> torch.Tensor:
    if hf_name not in hf_state:
        raise ValueError(f"HF checkpoint lacks {hf_name!r}, needed for {our_name!r}")
    return hf_state[hf_name]


@torch.no_grad()
def copy_weights_to_hf(model: DecoderLM, hf_model) -> None:
    """The reverse mapping: load a zoo model's weights into an HF model of the matching config (benchmarks, oracles)."""
    converter = converter_for(hf_model.config)
    check_same_architecture(model.config, converter.config_of(hf_model.config))
    ours = model.state_dict()
    check_absent_are_zero(converter.absent(model.config), ours, hf_model.config.model_type)
    load_into_hf(hf_model, hf_weights(converter, hf_model.config, model.config, ours), model.config.tie_embeddings)


def hf_weights(converter: Converter, hf_config, config: ModelConfig, ours: dict) -> dict[str, torch.Tensor]:
    """zoo_weights inverted: renamed, reordered back, unscaled, fused."""
    pairs = list(converter.names_of(config))
    theirs = {hf_name: ours[our_name] for hf_name, our_name in pairs}
    hf_of = {our_name: hf_name for hf_name, our_name in pairs}
    for our_name, rows in converter.row_orders(hf_config, config).items():
        theirs[hf_of[our_name]] = ours[our_name][torch.argsort(rows)]  # inverse permutation
    for our_name, factor in converter.scales(hf_config, config).items():
        theirs[hf_of[our_name]] = theirs[hf_of[our_name]] / factor
    for hf_name, parts, dim in converter.fused(config):
        theirs[hf_name] = torch.cat([ours[part] for part in parts], dim)
    return theirs


def check_absent_are_zero(names: list[str], ours: dict, model_type: str) -> None:
    """A zoo weight HF has no place for may only be zero: dropping any other would change what the model computes."""
    nonzero = [name for name in names if ours[name].any()]
    if nonzero:
        raise ValueError(f"HF {model_type} has no weights for {nonzero}; copy_weights_to_hf needs them zero")


def load_into_hf(hf_model, theirs: dict, tied: bool) -> None:
    """Every HF weight must be written, but a tied head and weights with no elements (DeepSeek-V3's shared experts
    at n_shared_experts=0), which hold nothing to write."""
    missing, unexpected = hf_model.load_state_dict(theirs, strict=False)
    shapes = hf_model.state_dict()
    unwritten = [name for name in missing if shapes[name].numel() and not (tied and name == "lm_head.weight")]
    if unwritten or unexpected:
        raise ValueError(f"weight mapping to HF incomplete: unwritten {unwritten}, unexpected {unexpected}")


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


def decoder_config(c, layers: list[MixerSpec], name: str, ffns: list[FFNSpec] | None = None) -> ModelConfig:
    """The parts every supported HF decoder shares: embedding, RMSNorm pre-norm blocks, SwiGLU MLPs of
    intermediate_size (or per-layer FFNs), head."""
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
        ffns=ffns,
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


def mixtral_config(c) -> ModelConfig:
    """Mistral's attention (sliding_window or None) with an MoE in every layer."""
    attention = {**attention_settings(c), "window": c.sliding_window}
    layers = [MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)]
    return decoder_config(c, layers, "mixtral", mixtral_ffns(c))


def qwen2_moe_config(c) -> ModelConfig:
    """Llama's attention with q, k, v biases (qkv_bias; o_proj's bias, which HF lacks, held at zero:
    qwen2_moe_absent), windowed in the layer_types 'sliding_attention' layers; MoE or dense FFNs per layer."""
    attention = {**attention_settings(c), "bias": bool(c.qkv_bias)}
    layers = [MixerSpec("attention", {**attention, "window": window}) for window in qwen2_moe_windows(c)]
    return decoder_config(c, layers, "qwen2_moe", qwen2_moe_ffns(c))


def qwen2_moe_windows(c) -> list[int | None]:
    """Each layer's window: sliding_window in a 'sliding_attention' layer, None (all keys) in a 'full_attention' one."""
    windows = []
    for i in range(c.num_hidden_layers):
        kind = c.layer_types[i]
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"Qwen2-MoE layer_types[{i}]={kind!r} is not supported; allowed: 'full_attention', "
                             f"'sliding_attention'")
        if kind == "sliding_attention" and not c.sliding_window:
            raise ValueError(f"Qwen2-MoE layer_types[{i}]='sliding_attention' needs sliding_window >= 1, got "
                             f"sliding_window={c.sliding_window!r} (use_sliding_window={c.use_sliding_window})")
        windows.append(c.sliding_window if kind == "sliding_attention" else None)
    return windows


def qwen2_moe_absent(config: ModelConfig) -> list[str]:
    return [f"blocks.{i}.mixer.o_proj.bias" for i, spec in enumerate(config.layers) if spec.params.get("bias")]


def qwen2_moe_names(config: ModelConfig) -> list[tuple[str, str]]:
    """Llama's names and Qwen2-MoE's shared_expert, less the o_proj biases HF does not have."""
    absent = set(qwen2_moe_absent(config))
    return [(hf, ours) for hf, ours in decoder_names(config, shared_expert="shared_expert") if ours not in absent]


def qwen3_moe_config(c) -> ModelConfig:
    """Attention with RMSNorm over each query and key head before RoPE (q_norm, k_norm of head_dim), every layer
    windowed when use_sliding_window; MoE or dense FFNs per layer as Qwen2-MoE's, no shared expert."""
    attention = {**attention_settings(c), "window": c.sliding_window, "qk_norm": "head", "norm_eps": c.rms_norm_eps}
    layers = [MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)]
    return decoder_config(c, layers, "qwen3_moe", qwen3_moe_ffns(c))


def olmoe_config(c) -> ModelConfig:
    """Attention with RMSNorm over all query heads' and all key heads' width before RoPE; an MoE in every layer."""
    if c.clip_qkv is not None:
        raise ValueError(f"OLMoE with clip_qkv={c.clip_qkv!r} is not supported (the zoo's attention does not clamp "
                         f"q, k, v); allowed: clip_qkv=None")
    attention = {**attention_settings(c), "qk_norm": "all", "norm_eps": c.rms_norm_eps}
    layers = [MixerSpec("attention", dict(attention)) for _ in range(c.num_hidden_layers)]
    return decoder_config(c, layers, "olmoe", olmoe_ffns(c))


def deepseek_v3_config(c) -> ModelConfig:
    """MLA in every layer; dense MLPs in the first first_k_dense_replace layers, MoE after."""
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
    layers = [MixerSpec("mla", dict(mla)) for _ in range(c.num_hidden_layers)]
    return decoder_config(c, layers, "deepseek_v3", deepseek_v3_ffns(c))


def decoder_names(config: ModelConfig, shared_expert: str = "shared_experts"):
    """(HF name, zoo name) pairs for every weight that maps one to one; attention layers use HF Llama's names, MLA
    layers HF DeepseekV3's, FFNs zoo/hf_moe.py's (shared_expert: HF's name for the shared experts)."""
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
        yield from ffn_names(config, i, shared_expert)


def mixer_weight_names(spec: MixerSpec) -> list[str]:
    if spec.kind == "attention":
        suffixes = ("weight", "bias") if spec.params.get("bias") else ("weight",)
        norms = ["q_norm.weight", "k_norm.weight"] if spec.params.get("qk_norm") else []
        return [f"{proj}.{s}" for proj in ("q_proj", "k_proj", "v_proj", "o_proj") for s in suffixes] + norms
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
    "mixtral": Converter(mixtral_config, decoder_names, fused=expert_fusions),
    "qwen2_moe": Converter(qwen2_moe_config, qwen2_moe_names, fused=expert_fusions, absent=qwen2_moe_absent),
    "qwen3_moe": Converter(qwen3_moe_config, decoder_names, fused=expert_fusions),
    "olmoe": Converter(olmoe_config, decoder_names, fused=expert_fusions),
    "deepseek_v3": Converter(deepseek_v3_config, decoder_names, interleaved_rope_rows, expert_fusions, routed_scales),
    "mamba": Converter(mamba_config, mamba_names),
    "mamba2": Converter(mamba2_config, mamba2_names),
}


def check_same_architecture(config: ModelConfig, hf_side: ModelConfig) -> None:
    """copy_weights_to_hf: what the weights alone do not fix (how a projection splits into heads, the window,
    whether blocks have an MLP, each layer's FFN and routing, RoPE base, norm eps) must agree, or the HF twin would
    compute something else without any error."""
    problems = [f"{field}: zoo {getattr(config, field)} vs HF {getattr(hf_side, field)}"
                for field in ("n_layers", "mlp", "rope_base", "norm_eps")
                if getattr(config, field) != getattr(hf_side, field)]
    for i, (ours, theirs) in enumerate(zip(config.layers, hf_side.layers)):
        a, b = mixer_settings(ours, config), mixer_settings(theirs, hf_side)
        if a != b:
            problems.append(f"layer {i}: zoo {a} vs HF {b}")
    for i in range(min(config.n_layers, hf_side.n_layers)):
        a, b = ffn_settings(config, i), ffn_settings(hf_side, i)
        if a != b:
            problems.append(f"layer {i} ffn: zoo {a} vs HF {b}")
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
