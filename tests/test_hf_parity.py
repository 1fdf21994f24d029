"""HF Llama is the oracle for MHA/GQA/MQA (reference.md §3): same weights in, same logits and greedy tokens out."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import zoo
from harness import Engine, SamplingParams
from zoo.hf import copy_weights_to_hf

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


@torch.no_grad()
def random_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(llama_config(**overrides)).float().eval()
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
    _, hf, _ = pair
    with torch.no_grad():
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


def test_logits_match(pair):
    name, hf, model = pair
    tokens = torch.tensor([prompt_ids()])
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    assert got.shape == want.shape == (1, PROMPT_LEN, VOCAB)
    err = (got - want).abs().max().item()
    assert err <= 1e-4, f"{name}: logits differ from HF by {err:.3g}"
    assert want.std() > 0.5  # the weights are spread enough that the comparison means something


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_greedy_continuation_matches_generate(pair, hf_continuation, kv_cache):
    name, hf, model = pair
    prompt, want = prompt_ids(), hf_continuation
    assert len(want) == NEW_TOKENS
    assert len(set(want)) > 8, f"{name}: HF continuation nearly constant {want}"
    engine = Engine(model, max_batch=2, max_seq_len=128, kv_cache=kv_cache, block_size=16)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    assert got == want, f"{name}/{kv_cache}: first difference at step {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


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
