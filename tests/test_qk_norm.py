"""qk_norm on GQA-family attention: RMSNorm of queries and keys before RoPE, per head ("head", Qwen3) or over all
heads' width ("all", OLMoE). The cached decode equals the full forward, the uncached forward equals the float64
oracle (which applies the norm itself), the module's stated bytes are exact, and a bad value is refused by name."""
import pytest
import torch

import zoo
from attention import Attention
from harness import Engine
from helpers import assert_not_constant, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest
from zoo.model import model_bytes
from zoo.reference import reference_forward

ATOL = 1e-4  # as tests/test_conformance.py
RTOL = 1e-4  # as tests/test_reference_oracle.py
NEW_TOKENS = 16

CASES = [("gqa", {"qk_norm": "head"}), ("gqa", {"qk_norm": "all"}), ("mqa", {"qk_norm": "all"}),
         ("swa", {"qk_norm": "head"}), ("cla", {"qk_norm": "head", "n_layers": 4, "share": 2}),
         ("moe", {"qk_norm": "all"})]


def case_id(case) -> str:
    name, overrides = case
    return name + "".join(f"-{k}={v}" for k, v in overrides.items())


def qk_model(arch: str, **overrides):
    """A random tiny model whose q/k gains are off 1, so a dropped or swapped gain shows."""
    model = random_model(arch, **overrides)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
    return model


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cached_decode_matches_full_forward(case, kv_cache):
    name, overrides = case
    model = qk_model(name, **overrides)
    prompts = make_prompts([1, 7, 19], model.config.vocab_size, seed=1)
    block_size = {"block_size": 8} if kv_cache == "paged" else {}
    engine = Engine(model, max_batch=len(prompts), max_seq_len=64, kv_cache=kv_cache, **block_size)
    for prompt, out in zip(prompts, engine.generate(prompts, greedy(NEW_TOKENS))):
        context = f"{case_id(case)}/{kv_cache} prompt len {len(prompt)}"
        assert_not_constant(out.token_ids, context)
        cached = torch.stack(out.logits)
        with torch.no_grad():
            full = model(torch.tensor([prompt + out.token_ids[:-1]]))[0, len(prompt) - 1:]
        err = (full - cached).abs().max().item()
        assert err <= ATOL, f"{context}: cached decode differs from the full forward by {err:.3g}"


@torch.no_grad()
def oracle_error(model) -> float:
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    want = reference_forward(model, tokens)
    return ((model(tokens).double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_uncached_forward_matches_float64_reference(case):
    name, overrides = case
    err = oracle_error(qk_model(name, **overrides))
    assert err <= RTOL, f"{case_id(case)}: uncached forward differs from the float64 reference by {err:.3g}"


@pytest.mark.parametrize("qk_norm", ["head", "all"])
def test_the_oracle_catches_a_forward_that_skips_the_norm(qk_norm):
    """The reference normalises on its own: a forward whose heads skip the q/k norm no longer matches it."""
    model = qk_model("gqa", qk_norm=qk_norm)
    for block in model.blocks:
        block.mixer.normed_heads = unnormed_heads(block.mixer)
    assert oracle_error(model) > 1e-2


def unnormed_heads(mixer):
    """Attention.normed_heads without the norm: [B, T, n * d] -> [B, n, T, d]."""
    return lambda y, norm, n: y.view(*y.shape[:2], n, mixer.head_dim).transpose(1, 2)


@pytest.mark.parametrize("qk_norm, q_width, k_width", [("head", 16, 16), ("all", 64, 32)])
def test_norm_widths_and_eps(qk_norm, q_width, k_width):
    """tiny: 4 query heads, 2 KV heads of 16; the eps is the model's norm_eps."""
    mixer = zoo.build("gqa", preset="tiny", qk_norm=qk_norm, norm_eps=1e-6).blocks[0].mixer
    assert mixer.q_norm.weight.shape == (q_width,) and mixer.k_norm.weight.shape == (k_width,)
    assert mixer.q_norm.eps == mixer.k_norm.eps == 1e-6


def test_a_layer_reading_another_layers_keys_norms_only_its_queries():
    mixer = zoo.build("cla", preset="tiny", qk_norm="head", n_layers=2, share=2).blocks[1].mixer
    assert mixer.kv_source == 0 and hasattr(mixer, "q_norm") and not hasattr(mixer, "k_norm")


def measured_bytes(model) -> int:
    return sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())


@pytest.mark.parametrize("case", [*CASES, ("gqa", {})], ids=case_id)
def test_module_bytes_are_exact(case):
    name, overrides = case
    config = zoo.make_config(name, "tiny", **overrides)
    assert measured_bytes(zoo.build(config)) == model_bytes(config)


def test_module_bytes_price_the_norm_gains():
    sizes = dict(dtype=torch.float32, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, bias=False, kv_source=None)
    plain = Attention.module_bytes(**sizes, qk_norm=None)
    assert Attention.module_bytes(**sizes, qk_norm="head") - plain == (16 + 16) * 4
    assert Attention.module_bytes(**sizes, qk_norm="all") - plain == (64 + 32) * 4
    assert Attention.module_bytes(**{**sizes, "kv_source": 0}, qk_norm="all") == (
        Attention.module_bytes(**{**sizes, "kv_source": 0}, qk_norm=None) + 64 * 4)


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError, match=r"unknown qk_norm 'x'; allowed: head, all"):
        zoo.build("gqa", preset="tiny", qk_norm="x")
    with pytest.raises(ValueError, match=r"unknown qk_norm 'x'; allowed: head, all or None"):
        Attention(64, 0, 4, qk_norm="x")


def test_an_architecture_without_softmax_attention_does_not_take_it():
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['qk_norm'\] for 'mamba'"):
        zoo.build("mamba", preset="tiny", qk_norm="head")
