"""The masked diffusion LM's model side: the registry entry, non-causal attention against a naive reference,
right-padding, the cached non-causal path against the full forward, and the models that may not be non-causal."""
import pytest
import torch

import zoo
from attention import Attention
from cache import CacheBatch, CacheSpec, ContiguousKV, PagedKV
from attention.rope import apply_rope
from harness import Engine
from harness.engine.cache_pool import CachePool
from zoo import MixerSpec, ModelConfig
from helpers import assert_not_constant, make_prompts, random_model  # tests/ is on sys.path under pytest


def test_diffusion_is_the_gqa_decoder_made_bidirectional_with_a_mask_token():
    assert "diffusion" in zoo.architectures()
    assert not zoo.registry.is_causal("diffusion") and zoo.registry.is_causal("gqa")
    model, gqa = zoo.build("diffusion", preset="small"), zoo.build("gqa", preset="small")
    config = model.config
    assert config.vocab_size == gqa.config.vocab_size + 1 and config.mask_token_id == config.vocab_size - 1
    assert not config.causal and gqa.config.causal
    assert config.layers == gqa.config.layers and config.mlp == gqa.config.mlp == "swiglu"
    assert all(not block.mixer.causal for block in model.blocks)
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in gqa.parameters()) == config.d_model
    assert zoo.ByteTokenizer().min_vocab_size <= config.mask_token_id  # the byte tokenizer's ids stay valid


def test_diffusion_mixer_option():
    assert zoo.build("diffusion", preset="tiny", mixer="mha").blocks[0].mixer.n_kv_heads == 4
    mla = zoo.build("diffusion", preset="tiny", mixer="mla", kv_lora_rank=8)
    assert type(mla.blocks[0].mixer).__name__ == "MLAttention" and not mla.blocks[0].mixer.causal
    assert mla.blocks[0].mixer.kv_lora_rank == 8
    for bad in ("swa", "linear", "mamba", "cla", "nope"):
        with pytest.raises(ValueError, match=rf"'{bad}'.*allowed: mha, gqa, mqa, mla"):
            zoo.build("diffusion", preset="tiny", mixer=bad)


@pytest.mark.parametrize("spec,named", [
    (MixerSpec("linear", {"n_heads": 2}), "'linear'"),
    (MixerSpec("mamba", {}), "'mamba'"),
    (MixerSpec("mamba2", {"head_dim": 8}), "'mamba2'"),
])
def test_a_causal_only_mixer_cannot_build_a_non_causal_model(spec, named):
    config = ModelConfig(vocab_size=10, d_model=16, layers=[spec], causal=False, mask_token_id=9)
    with pytest.raises(ValueError, match=rf"{named} \(layer 0\) runs only causally.*allowed: attention, mla"):
        zoo.build(config)


@pytest.mark.parametrize("params", [{"window": 4}, {"window": 4, "sinks": 2}, {"chunk": 8}])
def test_a_bounded_attention_layer_cannot_be_non_causal(params):
    config = ModelConfig(vocab_size=10, d_model=16, layers=[MixerSpec("attention", {"n_heads": 2, **params})],
                         causal=False, mask_token_id=9)
    with pytest.raises(ValueError, match="non-causal attention keeps every key.*must be unset"):
        zoo.build(config)


def test_a_shared_cache_layer_cannot_be_non_causal():
    layers = [MixerSpec("attention", {"n_heads": 2}), MixerSpec("attention", {"n_heads": 2, "kv_source": 0})]
    with pytest.raises(ValueError, match=r"non-causal attention keeps every key and computes its own.*kv_source=0"):
        zoo.build(ModelConfig(vocab_size=10, d_model=16, layers=layers, causal=False))


def test_config_validation():
    layers = [MixerSpec("attention", {"n_heads": 2})]
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=rf"mask_token_id must lie in \[0, 10\).*{bad}"):
            ModelConfig(vocab_size=10, d_model=16, layers=layers, mask_token_id=bad)
    with pytest.raises(ValueError, match="ModelConfig.causal"):  # direction is one setting for the whole model
        zoo.build(ModelConfig(vocab_size=10, d_model=16, layers=[MixerSpec("attention", {"n_heads": 2, "causal": False})]))


def test_engine_refuses_a_diffusion_model():
    with pytest.raises(ValueError, match="masked diffusion LM.*harness.DiffusionSampler"):
        Engine(zoo.build("diffusion", preset="tiny"))


def naive_attention(layer: Attention, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """float64 softmax(QK^T / sqrt(d)) V over every key before the row's length, then o_proj."""
    b, t, _ = x.shape
    q = layer.q_proj(x).view(b, t, layer.n_heads, -1).transpose(1, 2)
    k = layer.k_proj(x).view(b, t, layer.n_kv_heads, -1).transpose(1, 2)
    v = layer.v_proj(x).view(b, t, layer.n_kv_heads, -1).transpose(1, 2).double()
    cos, sin = layer.rope(torch.arange(t).expand(b, t), torch.float32)
    q, k = apply_rope(q, cos, sin).double(), apply_rope(k, cos, sin).double()
    group = layer.n_heads // layer.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / layer.head_dim**0.5
    hidden = torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]  # [B, keys]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ v
    return layer.o_proj(out.transpose(1, 2).reshape(b, t, -1).float())


@torch.no_grad()
def test_non_causal_attention_equals_a_naive_softmax_over_all_keys():
    torch.manual_seed(0)
    layer = Attention(d_model=32, layer_idx=0, n_heads=4, n_kv_heads=2, causal=False)
    x = torch.randn(2, 9, 32)
    full = layer(x)
    assert torch.allclose(full, naive_attention(layer, x, [9, 9]), atol=1e-5)
    # the first position already depends on the last token: no causal mask
    changed = x.clone()
    changed[:, -1] += 1
    assert not torch.allclose(layer(changed)[:, 0], full[:, 0], atol=1e-4)
    # key padding: row 1 holds 5 tokens, its keys 5.. are hidden
    lengths = torch.tensor([9, 5])
    batch = CacheBatch(positions=torch.arange(9).expand(2, 9), lengths=lengths, max_length=9, step="prefill")
    padded = layer(x, None, None, batch)
    assert torch.allclose(padded, naive_attention(layer, x, [9, 5]), atol=1e-5)
    assert torch.allclose(padded[1, :5], layer(x[1:, :5])[0], atol=1e-5)


def random_diffusion_model(**overrides):
    return random_model("diffusion", seed=3, max_seq_len=64, **overrides)


@pytest.mark.parametrize("mixer", ["gqa", "mla"])
@torch.no_grad()
def test_padded_rows_equal_each_row_alone(mixer):
    model = random_diffusion_model(mixer=mixer)
    prompts = make_prompts([12, 5, 9], model.config.vocab_size - 1, seed=4)
    width = 12
    tokens = torch.tensor([p + [model.config.mask_token_id] * (width - len(p)) for p in prompts])
    batch = CacheBatch(positions=torch.arange(width).expand(3, width), lengths=torch.tensor([12, 5, 9]),
                       max_length=width, step="prefill")
    padded = model(tokens, batch.positions, None, batch)
    for i, prompt in enumerate(prompts):
        alone = model(torch.tensor([prompt]))[0]
        assert torch.allclose(padded[i, : len(prompt)], alone, atol=1e-4), f"row {i}"


@pytest.mark.parametrize("mixer", ["gqa", "mla"])
@pytest.mark.parametrize("route", ["suffix", "block"])
@torch.no_grad()
def test_cached_non_causal_path_equals_the_full_forward(mixer, route):
    """Write every position's K/V with one full forward, then run some positions through the cached path on the
    same tokens: their logits equal the full forward's (what Fast-dLLM's caches approximate when tokens change)."""
    model = random_diffusion_model(mixer=mixer)
    lengths = [20, 14, 17]
    width, rows = max(lengths), len(lengths)
    prompts = make_prompts(lengths, model.config.vocab_size - 1, seed=5)
    tokens = torch.tensor([p + [model.config.mask_token_id] * (width - len(p)) for p in prompts])
    full_batch = CacheBatch(positions=torch.arange(width).expand(rows, width), lengths=torch.tensor(lengths),
                            max_length=width, step="prefill", slots=torch.arange(rows))
    pool = CachePool(model.cache_specs(), "contiguous", rows, width, 1, [], torch.float32, "cpu")
    full = model(tokens, full_batch.positions, pool.layers, full_batch)
    starts = torch.tensor([6, 3, 9])  # each row's own first query position
    count = 5 if route == "block" else min(n - s for n, s in zip(lengths, starts.tolist()))
    queries = starts[:, None] + torch.arange(count)
    batch = CacheBatch(positions=queries, lengths=torch.tensor(lengths), max_length=width, step="chunk",
                       slots=torch.arange(rows))
    cached = model(tokens.gather(1, queries), queries, pool.layers, batch)
    want = full.gather(1, queries[..., None].expand(-1, -1, full.shape[-1]))
    err = (cached - want).abs().max().item()
    assert err <= 1e-4, f"cached non-causal path differs from the full forward by {err:.3g}"
    assert_not_constant(cached.argmax(-1).flatten().tolist())


@pytest.mark.parametrize("queries_per_row", [3, 1])
@torch.no_grad()
def test_paged_non_causal_attend_equals_contiguous(queries_per_row):
    """The paged layout reads the same keys as the contiguous one in non-causal mode (several queries: the
    gathered path; one query at a middle position: the decode kernel, which reads every key before lengths)."""
    torch.manual_seed(6)
    spec = CacheSpec(kind="kv", kv_heads=2, head_dim=8, value_dim=8)
    rows, width, block_size = 2, 16, 4
    lengths = torch.tensor([16, 11])
    table = torch.arange(8, dtype=torch.int32).view(rows, 4)
    positions = torch.arange(width).expand(rows, width)
    mapping = (table.long().gather(1, positions // block_size) * block_size + positions % block_size).flatten()
    write = CacheBatch(positions=positions, lengths=lengths, max_length=width, step="prefill",
                       slots=torch.arange(rows), block_tables=(table,), slot_mappings=(mapping,))
    contiguous, paged = ContiguousKV(spec, rows, width, torch.float32, "cpu"), PagedKV(spec, 8, block_size, 0, torch.float32, "cpu")
    k, v = torch.randn(rows, 2, width, 8), torch.randn(rows, 2, width, 8)
    for layout in (contiguous, paged):
        layout.write(k, v, write)
    queries = torch.tensor([[2], [4]]) + torch.arange(queries_per_row)
    read = CacheBatch(positions=queries, lengths=lengths, max_length=width, step="chunk",
                      slots=torch.arange(rows), block_tables=(table,))
    q = torch.randn(rows, 4, queries_per_row, 8)
    got = paged.attend(q, read, 0.3, causal=False)
    want = contiguous.attend(q, read, 0.3, causal=False)
    assert torch.allclose(got, want, atol=1e-5)
    # and both read past the query: the causal answer (lengths = newest query + 1, as a causal batch has) differs
    causal = CacheBatch(positions=queries, lengths=queries[:, -1] + 1, max_length=width, step="chunk",
                        slots=torch.arange(rows), block_tables=(table,))
    assert not torch.allclose(want, contiguous.attend(q, causal, 0.3), atol=1e-3)
