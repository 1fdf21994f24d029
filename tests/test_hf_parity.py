"""HF oracles: Llama for MHA/GQA/MQA, Mistral for sliding windows, DeepseekV3 for MLA.
Same weights in, same logits and greedy tokens out."""
import pytest
import torch
from transformers import (
    DeepseekV3Config, DeepseekV3ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM,
)

import zoo
from harness import Engine, SamplingParams
from zoo.hf import copy_weights_to_hf
from helpers import spread_weights  # tests/ is on sys.path under pytest

VOCAB = 256
PROMPT_LEN = 40
NEW_TOKENS = 64

CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "attention_bias": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # heads * head_dim != hidden
}


def llama_config(**overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        initializer_range=0.2,  # std 0.02 gives near-ties and repeated tokens; 0.2 makes greedy output vary
        tie_word_embeddings=False, attn_implementation="eager",
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def random_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return random_hf(LlamaForCausalLM, llama_config(**overrides), seed)


@torch.no_grad()
def random_hf(model_class, config, seed: int = 0):
    torch.manual_seed(seed)
    hf = model_class(config).float().eval()
    # HF initialises norm gains to 1 and biases to 0; randomise them so a swapped or dropped mapping shows.
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn_like(p))
    return hf


def prompt_ids(seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf = random_llama(seed=len(request.param), **CASES[request.param])
    return request.param, hf, zoo.from_hf(hf).eval()


@pytest.fixture(scope="module")
def hf_continuation(pair) -> list[int]:
    """HF's greedy continuation of prompt_ids(), computed once per model for both KV layouts."""
    return hf_greedy(pair[1])


@torch.no_grad()
def hf_greedy(hf) -> list[int]:
    generated = hf.generate(
        torch.tensor([prompt_ids()]), attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long),
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # no EOS id: Llama's default (2) would end generation early or, with min_new_tokens, be masked out
    return generated[0, PROMPT_LEN:].tolist()


def test_config_mapped(pair):
    name, hf, model = pair
    c = hf.config
    assert model.config.vocab_size == VOCAB and model.config.n_layers == c.num_hidden_layers
    for spec in model.cache_specs():
        assert spec.kv_heads == c.num_key_value_heads
        assert spec.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert model.config.tie_embeddings == bool(c.tie_word_embeddings)
    if model.config.tie_embeddings:
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()


def assert_logits_match(name: str, hf, model) -> None:
    """fp32 logits of prompt_ids() within 1e-4 of HF's, on weights spread enough that the comparison means something."""
    tokens = torch.tensor([prompt_ids()])
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    assert got.shape == want.shape == (1, PROMPT_LEN, VOCAB)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{name}: logits differ from HF by {err:.3g}"
    assert want.std() > 0.5


def assert_generate_matches(name: str, model, want: list[int], kv_cache: str, block_size: int) -> None:
    """The engine's greedy continuation of prompt_ids() equals HF's (want), which varies enough to tell."""
    assert len(want) == NEW_TOKENS
    assert len(set(want)) > 8, f"{name}: HF continuation nearly constant {want}"
    engine = Engine(model, max_batch=2, max_seq_len=128, kv_cache=kv_cache, block_size=block_size)
    got = engine.generate([prompt_ids()], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"{name}/{kv_cache}: first difference at step {first}"


def test_logits_match(pair):
    assert_logits_match(pair[0], pair[1], pair[2])


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_greedy_continuation_matches_generate(pair, hf_continuation, kv_cache):
    assert_generate_matches(pair[0], pair[2], hf_continuation, kv_cache, block_size=16)


@pytest.mark.parametrize("tie", [False, True])
def test_copy_weights_to_hf_round_trip(tie):
    torch.manual_seed(3)
    model = zoo.build("gqa", preset="tiny", tie_embeddings=tie, max_seq_len=128).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    attn = model.blocks[0].mixer
    hf = LlamaForCausalLM(llama_config(
        vocab_size=model.config.vocab_size, hidden_size=model.config.d_model, intermediate_size=model.config.mlp_hidden,
        num_hidden_layers=model.config.n_layers, num_attention_heads=attn.n_heads, num_key_value_heads=attn.n_kv_heads,
        max_position_embeddings=128, tie_word_embeddings=tie, initializer_range=0.02,
    )).float().eval()
    copy_weights_to_hf(model, hf)
    tokens = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert err <= 1e-4, f"zoo -> HF weights give logits {err:.3g} apart"
    back = zoo.from_hf(hf)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), f"{key} changed in the zoo -> HF -> zoo round trip"


def test_from_hf_rejects_unsupported_model_type():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported: llama"):
        zoo.from_hf(gpt2)


def test_from_hf_rejects_scaled_rope():
    hf = random_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="linear"):
        zoo.from_hf(hf)


# Mistral (sliding window) and DeepseekV3 (MLA, dense MLPs) through the same checks.

WINDOW = 16  # < PROMPT_LEN, so the window drops keys during prefill and decode
BLOCK_SIZE = 8  # paged layout: the window spans several blocks


def mistral_config(**overrides) -> MistralConfig:
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=WINDOW, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False, attn_implementation="eager",
    )
    settings.update(overrides)
    return MistralConfig(**settings)


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4,  # HF expands MLA keys to every head; its eager path breaks for fewer "KV heads"
        kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=2,  # every layer a dense MLP (no MoE)
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.2,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    settings.update(overrides)
    return DeepseekV3Config(**settings)


FAMILIES = {"mistral": (MistralForCausalLM, mistral_config), "deepseek_v3": (DeepseekV3ForCausalLM, deepseek_v3_config)}

FAMILY_CASES = {
    "mistral_window": ("mistral", dict()),
    "mistral_window12_head_dim": ("mistral", dict(sliding_window=12, head_dim=32)),  # window not a multiple of blocks
    "mistral_no_window": ("mistral", dict(sliding_window=None)),
    "mla_interleave": ("deepseek_v3", dict()),
    "mla_q_lora_interleave": ("deepseek_v3", dict(q_lora_rank=24)),
    "mla_no_interleave": ("deepseek_v3", dict(rope_interleave=False)),
    "mla_q_lora_no_interleave": ("deepseek_v3", dict(q_lora_rank=24, rope_interleave=False, qk_rope_head_dim=12,
                                                     v_head_dim=24)),
}


def random_family(case: str, seed: int = 0, **extra):
    family, overrides = FAMILY_CASES[case]
    model_class, config_of = FAMILIES[family]
    return random_hf(model_class, config_of(**{**overrides, **extra}), seed)


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def family_pair(request):
    hf = random_family(request.param, seed=len(request.param))
    return request.param, hf, zoo.from_hf(hf).eval()


@pytest.fixture(scope="module")
def family_continuation(family_pair) -> list[int]:
    return hf_greedy(family_pair[1])


def test_family_config_mapped(family_pair):
    name, hf, model = family_pair
    c = hf.config
    assert model.config.vocab_size == VOCAB and model.config.n_layers == c.num_hidden_layers
    assert model.config.mlp_hidden == c.intermediate_size
    for spec in model.cache_specs():
        if c.model_type == "mistral":
            want = ("kv", c.num_key_value_heads, c.head_dim, c.sliding_window)
            assert (spec.kind, spec.kv_heads, spec.head_dim, spec.retention.window) == want
        else:
            assert (spec.kind, spec.kv_heads, spec.value_dim) == ("latent", 1, c.kv_lora_rank)
            assert spec.head_dim == c.kv_lora_rank + c.qk_rope_head_dim and spec.retention.keeps_all


def test_family_logits_match(family_pair):
    assert_logits_match(family_pair[0], family_pair[1], family_pair[2])


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_family_greedy_continuation_matches_generate(family_pair, family_continuation, kv_cache):
    assert_generate_matches(family_pair[0], family_pair[2], family_continuation, kv_cache, BLOCK_SIZE)


@pytest.mark.parametrize("case, setting, other", [
    ("mistral_window", "sliding_window", None),
    ("mla_interleave", "rope_interleave", False),
    ("mla_q_lora_interleave", "rope_interleave", False),
])
def test_oracle_setting_matters(case, setting, other):
    """Guard: the HF setting the conversion must honour changes HF's logits on these models, so the parity tests
    above would catch a converter that ignored it (for the window: only past the first WINDOW positions)."""
    hf = random_family(case)
    twin = random_family(case, **{setting: other})
    twin.load_state_dict(hf.state_dict())
    tokens = torch.tensor([prompt_ids()])
    with torch.no_grad():
        a, b = hf(tokens).logits, twin(tokens).logits
    if setting == "sliding_window":
        assert torch.allclose(a[:, :WINDOW], b[:, :WINDOW], atol=1e-5)
        a, b = a[:, WINDOW:], b[:, WINDOW:]
    assert (a - b).abs().max() > 0.1, f"{case}: {setting}={other} gives the same logits; the parity test proves nothing"


def hf_twin(model, **overrides):
    """An HF model (random weights) shaped like a zoo "swa" (Mistral) or "mla" (DeepseekV3) model."""
    c, p = model.config, model.config.layers[0].params
    sizes = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_hidden,
                 num_hidden_layers=c.n_layers, num_attention_heads=p["n_heads"], max_position_embeddings=128,
                 tie_word_embeddings=c.tie_embeddings, initializer_range=0.02)
    if model.config.layers[0].kind == "attention":
        attention = dict(num_key_value_heads=p["n_kv_heads"], sliding_window=p["window"])
        return MistralForCausalLM(mistral_config(**{**sizes, **attention, **overrides})).float().eval()
    mla = {k: p[k] for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    mla["num_key_value_heads"] = p["n_heads"]
    return DeepseekV3ForCausalLM(deepseek_v3_config(**{**sizes, **mla, **overrides})).float().eval()


@pytest.mark.parametrize("arch, settings, hf_overrides", [
    ("swa", dict(window=WINDOW), {}),
    ("swa", dict(window=WINDOW, tie_embeddings=True), {}),
    ("mla", dict(q_lora_rank=None), dict(rope_interleave=True)),
    ("mla", dict(q_lora_rank=24), dict(rope_interleave=True)),
    ("mla", dict(q_lora_rank=24), dict(rope_interleave=False)),
], ids=["mistral", "mistral_tied", "mla_interleave", "mla_q_lora_interleave", "mla_q_lora_no_interleave"])
def test_family_copy_weights_to_hf_round_trip(arch, settings, hf_overrides):
    torch.manual_seed(3)
    model = zoo.build(arch, preset="tiny", max_seq_len=128, **{"tie_embeddings": False, **settings})
    spread_weights(model, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # gains of 1 would hide a swapped norm mapping
                p.copy_(1 + 0.2 * torch.randn_like(p))
    assert_round_trip(model, hf_twin(model, **hf_overrides))


def assert_round_trip(model, hf, rtol: float = 0.0) -> None:
    """model's weights copied into its HF twin give its logits (within 1e-4), and come back from HF equal (within
    rtol where a conversion rescales a weight and undoes it)."""
    copy_weights_to_hf(model, hf)
    tokens = torch.randint(0, model.config.vocab_size, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, got = model(tokens), hf(tokens).logits
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"zoo -> HF weights give logits {err:.3g} apart"
    assert want.std() > 0.5
    back = zoo.from_hf(hf)
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        if rtol:
            torch.testing.assert_close(theirs[key], ours[key], rtol=rtol, atol=0, msg=f"{key} changed, round trip")
        else:
            assert torch.equal(ours[key], theirs[key]), f"{key} changed in the zoo -> HF -> zoo round trip"


def test_copy_weights_to_hf_rejects_a_different_window():
    model = zoo.build("swa", preset="tiny", window=WINDOW, tie_embeddings=False, max_seq_len=128)
    hf = hf_twin(model, sliding_window=WINDOW // 2)
    with pytest.raises(ValueError, match=r"layer 0: .*'window': 16.* vs HF .*'window': 8"):
        copy_weights_to_hf(model, hf)


@pytest.mark.parametrize("overrides, message", [
    (dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
          moe_intermediate_size=32), r"group-limited routing.*n_group=2, topk_group=1"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                           "original_max_position_embeddings": 64}), "yarn"),
], ids=["moe_group_limited", "attention_bias", "yarn"])
def test_from_hf_rejects_unsupported_deepseek_v3(overrides, message):
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(deepseek_v3_config(**overrides))
    with pytest.raises(ValueError, match=message):
        zoo.from_hf(hf)
