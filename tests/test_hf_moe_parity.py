"""HF oracles for mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (q/k RMSNorm per head and over
all heads) and DeepSeek-V3 (MLA, dense layers then MoE).
Same weights in, same logits and greedy tokens out, both ways (zoo.from_hf, copy_weights_to_hf); unsupported
routing and families refused by name before any weight is read."""
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM,
    Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)

import zoo
from zoo.hf import copy_weights_to_hf
from zoo.model import DecoderLM
from helpers import spread_weights  # tests/ is on sys.path under pytest
from test_hf_parity import (VOCAB, assert_generate_matches, assert_logits_match, assert_round_trip,
                            hf_greedy, prompt_ids, random_hf)

BLOCK_SIZE = 8  # paged layout: a window spans several blocks

SHARED = dict(  # every family: small, fp32-exact paths (eager attention, HF's reference expert loop)
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,  # 0.2: greedy output varies
    tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager",
)


def mixtral_config(**overrides) -> MixtralConfig:
    settings = dict(SHARED, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    return MixtralConfig(**{**settings, **overrides})


def qwen2_moe_config(**overrides) -> Qwen2MoeConfig:
    settings = dict(SHARED, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                    num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    return Qwen2MoeConfig(**{**settings, **overrides})


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    settings = dict(SHARED, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                    norm_topk_prob=False)
    return Qwen3MoeConfig(**{**settings, **overrides})


def olmoe_config(**overrides) -> OlmoeConfig:
    settings = dict(SHARED, intermediate_size=32, num_experts=6, num_experts_per_tok=2)  # norm_topk_prob: False
    return OlmoeConfig(**{**settings, **overrides})


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    settings = dict(
        SHARED, num_key_value_heads=4,  # HF expands MLA keys to every head; its eager path needs all of them
        intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    )
    return DeepseekV3Config(**{**settings, **overrides})


FAMILIES = {"mixtral": (MixtralForCausalLM, mixtral_config), "qwen2_moe": (Qwen2MoeForCausalLM, qwen2_moe_config),
            "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config),
            "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe_config), "olmoe": (OlmoeForCausalLM, olmoe_config)}

# case -> (family, HF overrides, each layer's zoo FFN class)
CASES = {
    "mixtral_window": ("mixtral", dict(), ["MoE"] * 3),
    "mixtral_top3_head_dim": ("mixtral", dict(sliding_window=None, num_experts_per_tok=3, head_dim=32,
                                              num_hidden_layers=2), ["MoE"] * 2),
    "qwen2_moe_mlp_only": ("qwen2_moe", dict(mlp_only_layers=[1]), ["MoE", "SwiGLU", "MoE"]),
    "qwen2_moe_window_sparse_step": ("qwen2_moe", dict(
        decoder_sparse_step=2, num_hidden_layers=4, norm_topk_prob=True, qkv_bias=False, use_sliding_window=True,
        sliding_window=12, max_window_layers=3, shared_expert_intermediate_size=32,
    ), ["SwiGLU", "MoE", "SwiGLU", "MoE"]),
    "deepseek_v3_moe": ("deepseek_v3", dict(), ["SwiGLU", "MoE", "MoE"]),
    "deepseek_v3_moe_q_lora": ("deepseek_v3", dict(
        q_lora_rank=24, rope_interleave=False, first_k_dense_replace=0, n_shared_experts=2, n_group=2, topk_group=2,
        routed_scaling_factor=1.0, norm_topk_prob=False, num_hidden_layers=2,
    ), ["MoE", "MoE"]),
    "qwen3_moe_mlp_only": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=True), ["MoE", "SwiGLU", "MoE"]),
    "qwen3_moe_window_sparse_step_bias": ("qwen3_moe", dict(
        decoder_sparse_step=2, num_hidden_layers=4, use_sliding_window=True, sliding_window=12, head_dim=32,
        attention_bias=True,
    ), ["SwiGLU", "MoE", "SwiGLU", "MoE"]),
    "olmoe": ("olmoe", dict(), ["MoE"] * 3),
    "olmoe_norm_topk_bias": ("olmoe", dict(norm_topk_prob=True, attention_bias=True, num_hidden_layers=2),
                             ["MoE"] * 2),
}


@torch.no_grad()
def random_family(case: str, seed: int = 0, **extra):
    """A random HF model of the case; DeepSeek-V3's routing bias (zero at init) randomised so it steers the choice."""
    family, overrides, _ = CASES[case]
    model_class, config_of = FAMILIES[family]
    hf = random_hf(model_class, config_of(**{**overrides, **extra}), seed)
    for name, buffer in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn_like(buffer))
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf = random_family(request.param, seed=len(request.param))
    return request.param, hf, zoo.from_hf(hf).eval()


def test_each_layers_ffn_is_mapped(pair):
    name, hf, model = pair
    assert [type(block.mlp).__name__ for block in model.blocks] == CASES[name][2]
    c = hf.config
    for block in model.blocks:
        if type(block.mlp).__name__ == "MoE":
            assert block.mlp.top_k == c.num_experts_per_tok and block.mlp.expert_hidden == hf_expert_width(c)
        else:
            assert block.mlp.gate_proj.weight.shape == (c.intermediate_size, c.hidden_size)


def hf_expert_width(c) -> int:
    return c.intermediate_size if c.model_type in ("mixtral", "olmoe") else c.moe_intermediate_size


def test_logits_match(pair):
    assert_logits_match(pair[0], pair[1], pair[2])


@pytest.fixture(scope="module")
def hf_continuation(pair) -> list[int]:
    """HF's greedy continuation of prompt_ids(), computed once per model for both KV layouts."""
    return hf_greedy(pair[1])


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_greedy_continuation_matches_generate(pair, hf_continuation, kv_cache):
    assert_generate_matches(pair[0], pair[2], hf_continuation, kv_cache, BLOCK_SIZE)


@pytest.mark.parametrize("case, setting, other", [
    ("qwen2_moe_mlp_only", "norm_topk_prob", True),
    ("qwen2_moe_window_sparse_step", "use_sliding_window", False),
    ("deepseek_v3_moe", "routed_scaling_factor", 1.0),
    ("deepseek_v3_moe", "norm_topk_prob", False),
    ("qwen3_moe_window_sparse_step_bias", "norm_topk_prob", True),
    ("olmoe", "norm_topk_prob", True),
])
def test_oracle_setting_matters(case, setting, other):
    """Guard: each HF setting the conversion must honour changes HF's logits on these models, so the parity tests
    above would catch a converter that ignored it."""
    hf = random_family(case)
    twin = random_family(case, **{setting: other})
    twin.load_state_dict(hf.state_dict())
    tokens = torch.tensor([prompt_ids()])
    with torch.no_grad():
        err = (hf(tokens).logits - twin(tokens).logits).abs().max().item()
    assert err > 0.1, f"{case}: {setting}={other} gives the same logits; the parity test proves nothing"


@pytest.mark.parametrize("case", ["qwen3_moe_mlp_only", "olmoe"])
def test_oracle_qk_norm_matters(case):
    """Guard: HF's q_norm and k_norm change its logits, so a converter that dropped the q/k norm would fail parity."""
    hf = random_family(case)
    twin = random_family(case)
    for layer in twin.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    tokens = torch.tensor([prompt_ids()])
    with torch.no_grad():
        err = (hf(tokens).logits - twin(tokens).logits).abs().max().item()
    assert err > 0.1, f"{case}: without q/k norm HF gives the same logits; the parity test proves nothing"


# ---- zoo -> HF: registry-built models into HF twins of the matching config ---------------------------------------

def zoo_moe(arch: str, **settings) -> DecoderLM:
    """A "tiny" registry model with spread weights, norm gains off 1 and a random routing bias (where it has one)."""
    torch.manual_seed(3)
    model = zoo.build(arch, preset="tiny", max_seq_len=128, tie_embeddings=False, **settings)
    spread_weights(model, seed=3)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):  # gains of 1 would hide a swapped norm mapping
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    return model


def sizes(model: DecoderLM) -> dict:
    c = model.config
    return dict(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                max_position_embeddings=128, tie_word_embeddings=c.tie_embeddings, rope_theta=c.rope_base,
                initializer_range=0.02)


def mixtral_twin(model: DecoderLM, **overrides) -> MixtralForCausalLM:
    p, moe = model.config.layers[0].params, model.blocks[0].mlp
    settings = dict(num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"], sliding_window=None,
                    intermediate_size=moe.expert_hidden, num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k)
    config = mixtral_config(**sizes(model), **{**settings, **overrides})
    return MixtralForCausalLM(config).float().eval()


def qwen2_moe_twin(model: DecoderLM) -> Qwen2MoeForCausalLM:
    p, moe = model.config.layers[0].params, model.blocks[0].mlp
    config = qwen2_moe_config(
        **sizes(model), num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"], qkv_bias=False,
        moe_intermediate_size=moe.expert_hidden, shared_expert_intermediate_size=2 * moe.expert_hidden,
        num_experts=moe.n_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
    )
    return Qwen2MoeForCausalLM(config).float().eval()


def qwen3_moe_twin(model: DecoderLM) -> Qwen3MoeForCausalLM:
    p, moe = model.config.layers[0].params, model.blocks[0].mlp
    config = qwen3_moe_config(
        **sizes(model), num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"],
        moe_intermediate_size=moe.expert_hidden, num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
    )
    return Qwen3MoeForCausalLM(config).float().eval()


def olmoe_twin(model: DecoderLM) -> OlmoeForCausalLM:
    p, moe = model.config.layers[0].params, model.blocks[0].mlp
    config = olmoe_config(
        **sizes(model), num_attention_heads=p["n_heads"], num_key_value_heads=p["n_kv_heads"],
        intermediate_size=moe.expert_hidden, num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
    )
    return OlmoeForCausalLM(config).float().eval()


def deepseek_v3_twin(model: DecoderLM) -> DeepseekV3ForCausalLM:
    p, moe = model.config.layers[0].params, model.blocks[1].mlp
    mla = {k: p[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    config = deepseek_v3_config(
        **sizes(model), **mla, num_attention_heads=p["n_heads"], num_key_value_heads=p["n_heads"],
        intermediate_size=model.config.mlp_hidden, moe_intermediate_size=moe.expert_hidden, first_k_dense_replace=1,
        n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k, n_shared_experts=1,
    )  # routed_scaling_factor 2.5: the zoo's down projections are divided by it on the way
    return DeepseekV3ForCausalLM(config).float().eval()


@pytest.mark.parametrize("arch, settings, twin_of", [
    ("moe", dict(), mixtral_twin),
    ("moe", dict(n_shared_experts=2, expert_hidden=32, norm_topk_prob=False, top_k=3), qwen2_moe_twin),
    ("hybrid", dict(layers="mla/swiglu,mla/moe", router="sigmoid", n_shared_experts=1, expert_hidden=32),
     deepseek_v3_twin),
    ("moe", dict(qk_norm="head", expert_hidden=32, top_k=3), qwen3_moe_twin),
    ("moe", dict(qk_norm="all", norm_topk_prob=False), olmoe_twin),
], ids=["mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe"])
def test_copy_weights_to_hf_round_trip(arch, settings, twin_of):
    model = zoo_moe(arch, **settings)
    assert_round_trip(model, twin_of(model), rtol=1e-6)  # a routed scale divided out and multiplied back in


def test_copy_weights_to_hf_refuses_a_different_routing():
    model = zoo_moe("moe", top_k=3)
    hf = mixtral_twin(model, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"layer 0 ffn: zoo .*'top_k': 3.* vs HF .*'top_k': 2"):
        copy_weights_to_hf(model, hf)


def test_copy_weights_to_hf_refuses_a_dense_model_into_mixtral():
    model = zoo_moe("gqa")
    hf = mixtral_twin(zoo_moe("moe"))
    with pytest.raises(ValueError, match=r"layer 0 ffn: zoo \('swiglu'.* vs HF \('moe'"):
        copy_weights_to_hf(model, hf)


def test_copy_weights_to_hf_refuses_an_output_bias_qwen2_moe_lacks():
    """Qwen2-MoE biases q, k and v only: the zoo's o_proj bias comes in zero and must be zero to go out."""
    hf = random_family("qwen2_moe_mlp_only")
    model = zoo.from_hf(hf)
    assert not model.blocks[0].mixer.o_proj.bias.any()
    with torch.no_grad():
        model.blocks[2].mixer.o_proj.bias.fill_(0.1)
    with pytest.raises(ValueError, match=r"qwen2_moe has no weights for \['blocks.2.mixer.o_proj.bias'\]"):
        copy_weights_to_hf(model, random_family("qwen2_moe_mlp_only", seed=1))


# ---- refusals: before any weight is read (the stand-in model has none) -------------------------------------------

@pytest.mark.parametrize("config, message", [
    (olmoe_config(clip_qkv=8.0), r"OLMoE with clip_qkv=8.0 is not supported.*allowed: clip_qkv=None"),
    (qwen3_moe_config(decoder_sparse_step=0), r"decoder_sparse_step must be >= 1, got 0"),
    (deepseek_v3_config(n_group=3, topk_group=1), r"group-limited routing .*n_group=3, topk_group=1; allowed: "
                                                  r"topk_group == n_group"),
    (deepseek_v3_config(routed_scaling_factor=0.0), r"routed_scaling_factor must be a finite number > 0, got 0.0"),
    (deepseek_v3_config(first_k_dense_replace=None), r"first_k_dense_replace must be an integer >= 0, got None"),
    (deepseek_v3_config(hidden_act="gelu"), r"hidden_act='gelu'"),
    (mixtral_config(num_experts_per_tok=5), r"num_experts_per_tok must be an integer in \[1, num_local_experts=4\], "
                                            r"got 5"),
    (mixtral_config(num_local_experts=0), r"num_local_experts must be >= 1, got 0"),
    (qwen2_moe_config(shared_expert_intermediate_size=48), r"shared_expert_intermediate_size must be a positive "
                                                           r"multiple of moe_intermediate_size=32.*got 48"),
    (qwen2_moe_config(decoder_sparse_step=0), r"decoder_sparse_step must be >= 1, got 0"),
    (qwen2_moe_config(layer_types=["sliding_attention", "full_attention", "full_attention"]),
     r"layer_types\[0\]='sliding_attention' needs sliding_window >= 1, got sliding_window=0"),
], ids=["olmoe_clip_qkv", "qwen3_moe_sparse_step_zero", "group_limited", "routed_scale_zero", "no_dense_count",
        "gelu", "top_k_above_experts", "zero_experts", "shared_width", "sparse_step_zero", "window_zero"])
def test_from_hf_refuses_unsupported_moe_configs(config, message):
    with pytest.raises(ValueError, match=message):
        zoo.from_hf(SimpleNamespace(config=config))
