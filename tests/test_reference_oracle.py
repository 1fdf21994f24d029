"""The oracle: every architecture's uncached forward against a naive float64 reference written from the papers
(zoo/reference.py, attention/reference.py, ssm/reference.py).

The conformance suite checks self-consistency only (cached decode == full forward, batched == alone, paged ==
contiguous), so a formula wrong the same way in the uncached and the cached path passes it. These tests compare the
forward with an independent computation instead, and the mutation tests show the difference: a formula broken in
both fast paths still passes the self-consistency check here but fails the oracle.

Tolerance: the error is measured relative to the logits' scale, max|model - reference| / max|reference|. fp32
against float64 through the tiny models (2 layers, 40 tokens, logits ~10) lands at 0.6e-6 .. 4.5e-6 (Mamba's
40-step fp32 scan is the largest); RTOL = 1e-4 leaves a margin of 20x over that, while every mutation below moves
the logits by 1e-2 or more relative.
"""
import pytest
import torch

import zoo
from attention import LinearAttention
from attention.reference import linear_attention_reference
from harness import Engine
from ssm import Mamba2
from ssm.reference import mamba2_reference
from zoo.config import MixerSpec, ModelConfig
from zoo.reference import reference_forward
from helpers import assert_not_constant, greedy, make_prompts, random_model, spread_weights  # tests/ is on sys.path under pytest

RTOL = 1e-4
SEQ_LEN = 40  # longer than the tiny preset's window (16), so sliding-window layers drop keys
BATCH = 2

VARIANTS = [
    ("hybrid", {"layers": "mamba,gqa"}),
    ("hybrid", {"layers": "linear,swa"}),
    ("hybrid", {"layers": "mla,mamba2"}),
    ("diffusion", {"mixer": "mla"}),
    ("diffusion", {"mixer": "mqa"}),
    ("linear", {"feature_map": "taylor"}),
    ("mamba2", {"n_groups": 2}),
    ("mla", {"q_lora_rank": 32}),
    ("cla", {"n_layers": 4, "share": 2}),
    ("gqa", {"mlp": "gelu", "norm": "layernorm"}),
    ("swa", {"mlp": "none", "window": 7}),
    ("cla", {"rope_base": 500.0}),
    ("hybrid", {"layers": "mla,mamba2,linear,mamba,swa", "n_layers": 5, "rope_base": 500.0}),
]
CASES = [(name, {}) for name in zoo.architectures()] + VARIANTS


def tokens_for(model, seed: int = 0, length: int = SEQ_LEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (BATCH, length), generator=generator)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@torch.no_grad()
def oracle_error(model, tokens) -> float:
    """max|uncached forward - float64 reference| relative to the reference logits' scale."""
    return relative_error(model(tokens), reference_forward(model, tokens))


def case_id(case) -> str:
    name, overrides = case
    return name + "".join(f"-{k}={v}" for k, v in overrides.items())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_uncached_forward_matches_float64_reference(case):
    name, overrides = case
    model = random_model(name, **overrides)
    assert model.config.max_seq_len >= SEQ_LEN
    err = oracle_error(model, tokens_for(model))
    assert err <= RTOL, f"{case_id(case)}: uncached forward differs from the float64 reference by {err:.3g} (relative)"


# ---- retention policies beyond the registry's sliding window (sinks, chunks, dilation) ------------------------------

RETENTIONS = [{"window": 8}, {"window": 8, "sinks": 4}, {"window": 5, "sinks": 3}, {"chunk": 16}, {"chunk": 7},
              {"window": 4, "dilation": 3}, {"window": 6, "dilation": 2}]


@pytest.mark.parametrize("retention", RETENTIONS, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()))
def test_retention_policies_match_reference(retention):
    layers = [MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 2, **retention}),
              MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 2})]
    config = ModelConfig(vocab_size=512, d_model=64, layers=layers, mlp_hidden=192, tie_embeddings=False)
    torch.manual_seed(0)
    model = spread_weights(zoo.build(config))
    err = oracle_error(model, tokens_for(model))
    assert err <= RTOL, f"{retention}: uncached forward differs from the float64 reference by {err:.3g} (relative)"


# ---- mixers alone, where the fast path's chunking is exercised across several chunks -------------------------------

@pytest.mark.parametrize("feature_map", ["elu", "taylor"])
def test_linear_attention_across_chunks_matches_reference(feature_map):
    torch.manual_seed(0)
    mixer = spread_weights(LinearAttention(d_model=64, layer_idx=0, n_heads=4, feature_map=feature_map,
                                                   chunk_size=8))
    x = torch.randn(BATCH, SEQ_LEN, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = relative_error(mixer(x), linear_attention_reference(mixer, x))
    assert err <= RTOL, f"chunked linear attention ({feature_map}) differs from the recurrence by {err:.3g}"


def test_mamba2_across_chunks_matches_reference():
    torch.manual_seed(0)
    mixer = spread_weights(Mamba2(d_model=64, layer_idx=0, d_state=16, head_dim=16, n_groups=2, chunk_size=8))
    x = torch.randn(BATCH, SEQ_LEN, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = relative_error(mixer(x), mamba2_reference(mixer, x))
    assert err <= RTOL, f"chunked SSD scan differs from the step-by-step recurrence by {err:.3g}"


def test_a_mixer_without_a_reference_is_named():
    model = zoo.build("gqa", preset="tiny")
    model.blocks[1].mixer = torch.nn.Identity()
    model.blocks[1].mixer.layer_idx = 1
    with pytest.raises(NotImplementedError, match="layer 1.*Identity.*reference"):
        reference_forward(model, tokens_for(model))


# ---- mutations: one formula made wrong in BOTH fast paths (uncached/prefill and cached decode) -----------------------

def scale_attention(model):
    """The softmax temperature: both the fresh (prefill/uncached) attention and the cached decode read mixer.scale."""
    for block in model.blocks:
        block.mixer.scale = block.mixer.scale * 1.25


def sharpen_feature_map(model):
    """Linear attention: project() (used by the chunked, prefill and decode paths) applies phi(1.25 x)."""
    for block in model.blocks:
        block.mixer.phi = lambda x, phi=block.mixer.phi: phi(1.25 * x)


def swap_mamba_b_c(model):
    """Mamba-1: time_step() (read by the scan and by the decode step) returns C where B belongs and B where C does."""
    for block in model.blocks:
        def time_step(x, original=block.mixer.time_step):
            dt, B, C = original(x)
            return dt, C, B
        block.mixer.time_step = time_step


def swap_mamba2_b_c(model):
    """Mamba-2: split_xbc() (read by the SSD scan and by the decode step) swaps the B and C channels."""
    for block in model.blocks:
        def split_xbc(xbc, original=block.mixer.split_xbc):
            x, B, C = original(xbc)
            return x, C, B
        block.mixer.split_xbc = split_xbc


MUTATIONS = [("gqa", scale_attention), ("mla", scale_attention), ("linear", sharpen_feature_map),
             ("mamba", swap_mamba_b_c), ("mamba2", swap_mamba2_b_c)]


@torch.no_grad()
def cached_decode_error(model, prompt_len: int = 20, new_tokens: int = 12) -> float:
    """The conformance property: greedy decode through the engine's cache vs the full forward over the same tokens
    (absolute, as tests/test_conformance.py measures it)."""
    prompt = make_prompts([prompt_len], model.config.vocab_size, seed=1)[0]
    out = Engine(model, max_batch=1, max_seq_len=64).generate([prompt], greedy(new_tokens))[0]
    assert_not_constant(out.token_ids, "mutated model")
    cached = torch.stack(out.logits)
    full = model(torch.tensor([prompt + out.token_ids[:-1]]))[0, prompt_len - 1:]
    return (full - cached).abs().max().item()


@pytest.mark.parametrize("arch,mutate", MUTATIONS, ids=[f"{a}-{m.__name__}" for a, m in MUTATIONS])
def test_mutation_in_both_paths_escapes_self_consistency_but_not_the_oracle(arch, mutate):
    model = random_model(arch)
    tokens = tokens_for(model)
    assert oracle_error(model, tokens) <= RTOL  # the unmutated model passes
    mutate(model)
    # (a) self-consistency cannot see it: cached decode still equals the (equally wrong) uncached forward
    assert cached_decode_error(model) <= 1e-4
    # (b) the oracle does
    err = oracle_error(model, tokens)
    assert err > RTOL, f"{arch}: {mutate.__name__} moved the logits by only {err:.3g} relative; the oracle missed it"
