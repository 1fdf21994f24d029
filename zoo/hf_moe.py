"""HF interop for the feed-forward of mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3):
each layer's FFNSpec from an HF config, the FFN weights' HF names, and refusals for routing the zoo's MoE does not
compute.

transformers stacks a layer's routed experts as the zoo does, with gate and up fused: experts.gate_up_proj is
[n_experts, 2 * width, d_model] ([gate; up] per expert), experts.down_proj [n_experts, d_model, width].
"""
from typing import NamedTuple

from zoo import checks
from zoo.config import FFNSpec, ModelConfig
from zoo.feedforward import bound_arguments
from zoo.ffn.moe import expert_width

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

class Fused(NamedTuple):
    """An HF weight that is the zoo weights `parts` (equal shapes) concatenated along `dim`."""

    hf_name: str
    parts: list[str]
    dim: int


def moe_spec(n_experts: int, top_k: int, expert_hidden: int, n_shared_experts: int, router: str,
             norm_topk_prob: bool) -> FFNSpec:
    return FFNSpec("moe", {"n_experts": n_experts, "top_k": top_k, "expert_hidden": expert_hidden,
                           "n_shared_experts": n_shared_experts, "router": router, "norm_topk_prob": norm_topk_prob})


def per_layer(is_moe: list[bool], spec: FFNSpec) -> list[FFNSpec] | None:
    """spec in the MoE layers, a SwiGLU of the model's mlp_hidden in the others; None when no layer is MoE, so a
    dense model's config reads as before per-layer FFNs."""
    if not any(is_moe):
        return None
    return [FFNSpec(spec.kind, dict(spec.params)) if moe else FFNSpec("swiglu") for moe in is_moe]


def check_experts(c, experts_setting: str) -> int:
    """The routed expert count and num_experts_per_tok by their HF names, before an MoE is sized from them."""
    n_experts = checks.integer(experts_setting, getattr(c, experts_setting), minimum=1)
    top_k = c.num_experts_per_tok
    if not checks.is_integer(top_k) or not 1 <= top_k <= n_experts:
        raise ValueError(f"num_experts_per_tok must be an integer in [1, {experts_setting}={n_experts}], "
                         f"got {checks.short(top_k)}")
    return n_experts


def mixtral_ffns(c) -> list[FFNSpec]:
    """Every layer an MoE of full-width experts (intermediate_size); softmax top-k, always renormalised."""
    n_experts = check_experts(c, "num_local_experts")
    spec = moe_spec(n_experts, c.num_experts_per_tok, c.intermediate_size, 0, "softmax", True)
    return per_layer([True] * c.num_hidden_layers, spec)


def qwen_sparse_layers(c) -> list[bool]:
    """The layers Qwen2-MoE and Qwen3-MoE make sparse: num_experts > 0, (i + 1) % decoder_sparse_step == 0, i not in
    mlp_only_layers."""
    step = checks.integer("decoder_sparse_step", c.decoder_sparse_step, minimum=1)
    return [c.num_experts > 0 and (i + 1) % step == 0 and i not in c.mlp_only_layers
            for i in range(c.num_hidden_layers)]


def qwen2_moe_ffns(c) -> list[FFNSpec] | None:
    """MoE in the sparse layers (qwen_sparse_layers), a SwiGLU of intermediate_size elsewhere; the shared expert
    gated by a sigmoid."""
    is_moe = qwen_sparse_layers(c)
    if not any(is_moe):
        return None
    n_experts = check_experts(c, "num_experts")
    spec = moe_spec(n_experts, c.num_experts_per_tok, c.moe_intermediate_size, qwen2_shared_experts(c), "softmax",
                    bool(c.norm_topk_prob))
    return per_layer(is_moe, spec)


def qwen3_moe_ffns(c) -> list[FFNSpec] | None:
    """Qwen2-MoE's sparse layers and softmax top-k (renormalised as norm_topk_prob says), without a shared expert."""
    is_moe = qwen_sparse_layers(c)
    if not any(is_moe):
        return None
    n_experts = check_experts(c, "num_experts")
    spec = moe_spec(n_experts, c.num_experts_per_tok, c.moe_intermediate_size, 0, "softmax", bool(c.norm_topk_prob))
    return per_layer(is_moe, spec)


def olmoe_ffns(c) -> list[FFNSpec]:
    """Every layer an MoE of intermediate_size experts; softmax top-k, renormalised only with norm_topk_prob."""
    n_experts = check_experts(c, "num_experts")
    spec = moe_spec(n_experts, c.num_experts_per_tok, c.intermediate_size, 0, "softmax", bool(c.norm_topk_prob))
    return per_layer([True] * c.num_hidden_layers, spec)


def qwen2_shared_experts(c) -> int:
    """The shared expert's width in experts of moe_intermediate_size: the zoo sizes shared experts in that unit."""
    width = checks.integer("moe_intermediate_size", c.moe_intermediate_size, minimum=1)
    shared = c.shared_expert_intermediate_size
    if not checks.is_integer(shared) or shared < 1 or shared % width:
        raise ValueError(f"shared_expert_intermediate_size must be a positive multiple of moe_intermediate_size="
                         f"{width} (the zoo's shared expert is n_shared_experts experts of that width), "
                         f"got {checks.short(shared)}")
    return shared // width


def deepseek_v3_ffns(c) -> list[FFNSpec] | None:
    """Dense SwiGLU in the first first_k_dense_replace layers, MoE after: sigmoid scores, bias-corrected top-k,
    ungated shared experts (routed_scaling_factor is folded into the weights: routed_scales)."""
    dense = checks.integer("first_k_dense_replace", c.first_k_dense_replace, minimum=0)
    is_moe = [i >= dense for i in range(c.num_hidden_layers)]
    if not any(is_moe):
        return None
    n_experts = check_experts(c, "n_routed_experts")
    check_group_routing(c)
    checks.real("routed_scaling_factor", c.routed_scaling_factor, minimum=0, open_min=True)
    shared = checks.integer("n_shared_experts", c.n_shared_experts, minimum=0)
    spec = moe_spec(n_experts, c.num_experts_per_tok, c.moe_intermediate_size, shared, "sigmoid",
                    bool(c.norm_topk_prob))
    return per_layer(is_moe, spec)


def check_group_routing(c) -> None:
    """DeepSeek-V3 first keeps the topk_group of n_group expert groups whose top-2 scores sum highest; with every
    group kept (topk_group == n_group) that is plain top-k, the only form the zoo's sigmoid router computes."""
    if not checks.is_integer(c.n_group) or c.topk_group != c.n_group:
        raise ValueError(f"DeepseekV3 group-limited routing is not supported: n_group={c.n_group!r}, "
                         f"topk_group={c.topk_group!r}; allowed: topk_group == n_group (every group eligible, "
                         f"e.g. n_group=1, topk_group=1)")


def moe_layers(config: ModelConfig) -> list[int]:
    return [i for i in range(config.n_layers) if config.ffn(i).kind == "moe"]


def routed_scales(hf_config, config: ModelConfig) -> dict[str, float]:
    """DeepSeek-V3 multiplies the routed experts' weighted sum by routed_scaling_factor; the zoo's MoE has no such
    factor, so each routed expert's down projection carries it (the sum is linear in them)."""
    factor = float(hf_config.routed_scaling_factor)
    if factor == 1:
        return {}
    return {f"blocks.{i}.mlp.experts.down_proj.weight": factor for i in moe_layers(config)}


def expert_fusions(config: ModelConfig) -> list[Fused]:
    return [Fused(f"model.layers.{i}.mlp.experts.gate_up_proj",
                  [f"blocks.{i}.mlp.experts.gate_proj.weight", f"blocks.{i}.mlp.experts.up_proj.weight"], 1)
            for i in moe_layers(config)]


def ffn_settings(config: ModelConfig, layer_idx: int) -> tuple[str, dict]:
    """A layer's FFN kind and arguments with defaults filled in and an MoE's expert width resolved: what the built
    FFN computes with, so a zoo config and one read from HF compare equal when they compute alike."""
    spec = config.ffn(layer_idx)
    if spec.kind == "none":
        return spec.kind, {}
    settings = dict(bound_arguments(spec, config, layer_idx))
    del settings["d_model"]
    if spec.kind == "moe":
        settings["expert_hidden"] = expert_width(settings.pop("hidden"), settings["expert_hidden"])
    return spec.kind, settings


def ffn_names(config: ModelConfig, layer_idx: int, shared_expert: str) -> list[tuple[str, str]]:
    """(HF name, zoo name) of the layer's FFN weights that map one to one (gate and up of the routed experts are
    fused in HF: expert_fusions). shared_expert: HF's module name for the shared experts."""
    kind, settings = ffn_settings(config, layer_idx)
    hf, ours = f"model.layers.{layer_idx}.mlp.", f"blocks.{layer_idx}.mlp."
    if kind == "swiglu":
        return [(hf + f"{proj}.weight", ours + f"{proj}.weight") for proj in PROJECTIONS]
    if kind != "moe":
        raise ValueError(f"no HF weight names for FFN kind {kind!r} (layer {layer_idx})")
    names = [(hf + "gate.weight", ours + "gate.weight"), (hf + "experts.down_proj", ours + "experts.down_proj.weight")]
    if settings["router"] == "sigmoid":
        names.append((hf + "gate.e_score_correction_bias", ours + "gate.e_score_correction_bias"))
    if settings["n_shared_experts"]:
        names += [(hf + f"{shared_expert}.{proj}.weight", ours + f"shared_experts.{proj}.weight")
                  for proj in PROJECTIONS]
        if settings["router"] == "softmax":
            names.append((hf + "shared_expert_gate.weight", ours + "shared_expert_gate.weight"))
    return names
