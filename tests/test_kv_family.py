"""The KV-reducing family beyond what the shared conformance suite checks: MLA's two forms and its cache width,
cross-layer sharing, the sliding window's bounded memory in both layouts, hybrid patterns and their errors."""
import pytest
import torch

import zoo
from attention import Attention, MLAttention
from cache import CacheBatch, ContiguousKV, PagedKV
from harness import Engine, SamplingParams
from batches import slot_batch  # tests/ is on sys.path under pytest
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest

DTYPE_SIZE = {torch.float32: 4, torch.bfloat16: 2}


def paged_batch(positions: torch.Tensor, is_prefill: bool, block_size: int, blocks_per_seq: int) -> CacheBatch:
    """Sequence i owns pool blocks in reverse order, so a layout that ignores the table reads the wrong rows."""
    batch = slot_batch(positions, is_prefill)
    b = positions.shape[0]
    table = torch.tensor([[(i + 1) * blocks_per_seq - 1 - j for j in range(blocks_per_seq)] for i in range(b)], dtype=torch.int32)
    slots = table.long().gather(1, positions // block_size) * block_size + positions % block_size
    batch.block_tables, batch.slot_mappings = (table,), (slots.flatten(),)
    return batch


def run_cached(mixer, cache, x: torch.Tensor, chunks: list[int], make_batch) -> torch.Tensor:
    """Feed x [B, T, d] in chunks (the first a prefill from 0), returning the outputs for every position."""
    outs, start = [], 0
    for n in chunks:
        positions = torch.arange(start, start + n).expand(x.shape[0], n)
        outs.append(mixer(x[:, start : start + n], positions, cache, make_batch(positions, start == 0)))
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("q_lora_rank,v_head_dim", [(None, 10), (12, 10), (None, 24)])  # value narrower / wider than q·k
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_mla_absorbed_decode_equals_expanded_form(q_lora_rank, v_head_dim, layout):
    torch.manual_seed(0)
    mla = MLAttention(d_model=32, layer_idx=0, n_heads=4, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
                      v_head_dim=v_head_dim, q_lora_rank=q_lora_rank)
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        expanded = mla(x)  # uncached: per-head keys and values expanded from the latent
        spec = mla.cache_spec()
        if layout == "contiguous":
            cache, make_batch = ContiguousKV(spec, 2, 32, torch.float32, "cpu"), slot_batch
        else:
            cache = PagedKV(spec, num_blocks=2 * 8, block_size=4, group=0, dtype=torch.float32, device="cpu")
            make_batch = lambda p, pre: paged_batch(p, pre, block_size=4, blocks_per_seq=8)  # noqa: E731
        # prefill 9 (expanded), then single tokens and a 5-token chunk: both absorbed, over the latent cache
        absorbed = run_cached(mla, cache, x, [9, 1, 1, 5, 1, 1, 1, 1, 1], make_batch)
    assert cache.v is None and cache.k.shape[-1] == 20 + 6  # the cache row is [latent ; rope key], nothing else
    err = (absorbed - expanded).abs().max().item()
    assert err < 1e-5, f"absorbed decode differs from the expanded form by {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_mla_cache_bytes_per_token_per_layer(dtype, kv_cache):
    model = zoo.build("mla", preset="tiny", kv_lora_rank=24, qk_rope_head_dim=8).to(dtype)
    max_batch, max_seq_len = 3, 64
    engine = Engine(model, max_batch=max_batch, max_seq_len=max_seq_len, kv_cache=kv_cache, block_size=8)
    per_token_per_layer = engine.cache_bytes_allocated / (max_batch * max_seq_len * model.config.n_layers)
    assert per_token_per_layer == (24 + 8) * DTYPE_SIZE[dtype]
    assert zoo.cache_bytes(model, seq_len=100) == (24 + 8) * DTYPE_SIZE[dtype] * 100 * model.config.n_layers


def test_mla_small_preset_takes_the_issue_example():
    with torch.device("meta"):
        model = zoo.build("mla", preset="small", kv_lora_rank=64)
    mixer = model.blocks[0].mixer
    assert (mixer.kv_lora_rank, mixer.rope_dim) == (64, 32)
    assert zoo.cache_bytes(model, seq_len=1, dtype=torch.float32) == (64 + 32) * 4 * 8


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_cla_share_1_equals_gqa_exactly(kv_cache):
    gqa = random_model("gqa", seed=3)
    cla = zoo.build("cla", preset="tiny", share=1, tie_embeddings=False)
    cla.load_state_dict(gqa.state_dict())  # strict: the same modules under the same names
    prompts = make_prompts([5, 23], 512, seed=3)
    with torch.no_grad():
        assert torch.equal(cla(torch.tensor([prompts[1]])), gqa(torch.tensor([prompts[1]])))
    outs = [Engine(m, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=8).generate(prompts, greedy(20))
            for m in (gqa, cla)]
    for a, b in zip(*outs):
        assert_not_constant(a.token_ids)
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_cla_share_2_halves_the_measured_cache(kv_cache):
    sizes = {}
    for share in (1, 2, 4):
        model = zoo.build("cla", preset="tiny", n_layers=4, share=share)
        consumers = [b.mixer for b in model.blocks if b.mixer.kv_source is not None]
        assert len(consumers) == 4 - 4 // share and not any(hasattr(m, "k_proj") for m in consumers)
        sizes[share] = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=8).cache_bytes_allocated
    assert sizes[2] * 2 == sizes[1] and sizes[4] * 4 == sizes[1]


def test_window_of_one_sees_only_itself():
    torch.manual_seed(0)
    attn = Attention(d_model=16, layer_idx=0, n_heads=2, n_kv_heads=1, window=1)
    x = torch.randn(1, 7, 16)
    with torch.no_grad():
        own_value = attn.o_proj(attn.v_proj(x).repeat(1, 1, 2))  # each of the 2 query heads reads its KV head
        assert torch.allclose(attn(x), own_value, atol=1e-6)
        same_weights = lambda **kw: Attention(d_model=16, layer_idx=0, n_heads=2, n_kv_heads=1, **kw).requires_grad_(False)  # noqa: E731
        wide, full = same_weights(window=7), same_weights()  # a window as long as the sequence is plain causal attention
        for other in (wide, full):
            other.load_state_dict(attn.state_dict())
        assert torch.allclose(wide(x), full(x), atol=1e-6)


def test_sliding_window_contiguous_cache_stops_growing_at_the_window():
    model = zoo.build("swa", preset="tiny", window=16)
    allocated = {n: Engine(model, max_batch=2, max_seq_len=n).cache_bytes_allocated for n in (8, 16, 17, 48, 200)}
    per_token = zoo.cache_bytes(model, seq_len=1, batch=2)
    assert allocated[8] == 8 * per_token  # shorter than the window: a row per position
    assert allocated[16] == allocated[17] == allocated[48] == allocated[200] == 16 * per_token
    assert [zoo.cache_bytes(model, seq_len=t) for t in (16, 17, 500)] == [16 * per_token // 2] * 3


def test_sliding_window_paged_blocks_return_to_the_pool():
    """One request runs far past its window: the blocks it holds stay bounded, and the rest come back."""
    window, block_size = 16, 4
    model = random_model("hybrid", layers="swa,gqa", window=window)
    engine = Engine(model, max_batch=1, max_seq_len=96, kv_cache="paged", block_size=block_size)
    swa_blocks, full_blocks = engine.block_managers  # groups in layer order: the window first
    assert (swa_blocks.retention.window, full_blocks.retention.keeps_all) == (window, True)
    engine.add_request(make_prompts([21], 512)[0], greedy(70))
    held, returned = [], []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            table = swa_blocks.tables[seq.request_id]
            held.append(swa_blocks.used)
            returned.append(table.count(-1))
            assert full_blocks.used == full_blocks.blocks_for(seq.num_cached)  # the global layer keeps everything
            assert swa_blocks.used == swa_blocks.held(seq) <= (window - 1) // block_size + 2
    # the 21-token prompt left 5 + 1 blocks' worth before its window; by the end 90 tokens have passed
    assert returned[0] >= 1 and returned[-1] == (90 - window) // block_size
    assert returned == sorted(returned) and max(held) == (window - 1) // block_size + 2
    assert swa_blocks.used == 0 and full_blocks.used == 0


def test_hybrid_patterns_repeat_to_fill_the_layers():
    kinds = lambda m: [(b.mixer.__class__.__name__, b.mixer.window if hasattr(b.mixer, "window") else None)  # noqa: E731
                       for b in m.blocks]
    model = zoo.build("hybrid", preset="tiny", layers="swa,swa,swa,gqa", n_layers=8, window=8)
    assert kinds(model) == [("Attention", 8)] * 3 + [("Attention", None)] + [("Attention", 8)] * 3 + [("Attention", None)]
    # aligned to end on the pattern's last layer: a 2-layer "1 in 6" still has its global layer
    assert kinds(zoo.build("hybrid-1in6", preset="tiny")) == [("Attention", 16), ("Attention", None)]
    small = zoo.make_config("hybrid-1in6", preset="small")
    assert [s.params.get("window") for s in small.layers] == [512, None, 512, 512, 512, 512, 512, None]
    mixed = zoo.build("hybrid", preset="tiny", layers=["mla", "swa", "mqa"], n_layers=3)
    assert [type(b.mixer).__name__ for b in mixed.blocks] == ["MLAttention", "Attention", "Attention"]


def test_hybrid_with_latent_window_and_full_layers_runs_through_both_layouts():
    model = random_model("hybrid", layers="mla,swa,mqa", n_layers=3, window=12)
    prompts = make_prompts([3, 30, 14], 512, seed=7)
    params = [greedy(n) for n in (25, 10, 18)]
    contiguous = Engine(model, max_batch=3, max_seq_len=64).generate(prompts, params)
    paged = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged", block_size=4).generate(prompts, params)
    for prompt, c, p in zip(prompts, contiguous, paged):
        assert_not_constant(c.token_ids)
        assert_same_output(p, c, 1e-4, f"prompt len {len(prompt)}")
        with torch.no_grad():
            full = model(torch.tensor([prompt + c.token_ids[:-1]]))[0, len(prompt) - 1 :]
        assert (full - torch.stack(c.logits)).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch,settings,message", [
    ("swa", {"window": 0}, "window must be >= 1.*got 0"),
    ("swa", {"window": -4}, "window must be >= 1.*got -4"),
    ("mla", {"kv_lora_rank": 0}, "kv_lora_rank must be >= 1, got 0"),
    ("mla", {"q_lora_rank": -1}, "q_lora_rank must be >= 1, got -1"),
    ("cla", {"share": 3}, r"share factor 3 must divide n_layers=8; allowed: \[1, 2, 4, 8\]"),
    ("cla", {"share": 0}, "share must be >= 1, got 0"),
    ("hybrid", {"layers": "swa,attn,gqa"}, r"unknown layer kind\(s\) \['attn'\]; allowed: mha, gqa, mqa, mla, swa"),
    ("hybrid", {"layers": "gqa,cla"}, r"unknown layer kind\(s\) \['cla'\]"),
    ("gqa", {"window": 64}, r"unknown setting\(s\) \['window'\] for 'gqa'"),
])
def test_bad_settings_raise_clear_errors(arch, settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.build(arch, preset="small", **settings)


def test_shared_cache_must_match_its_producer():
    layers = [zoo.MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 2}),
              zoo.MixerSpec("attention", {"n_heads": 4, "n_kv_heads": 1, "kv_source": 0})]
    with pytest.raises(ValueError, match="reads 1 KV heads of dim 8 from layer 0, which caches 2"):
        zoo.build(zoo.ModelConfig(vocab_size=64, d_model=32, layers=layers))
    windowed = [zoo.MixerSpec("attention", {"n_heads": 4, "window": 8}),
                zoo.MixerSpec("attention", {"n_heads": 4, "kv_source": 0})]
    with pytest.raises(ValueError, match="not a full KV cache"):
        zoo.build(zoo.ModelConfig(vocab_size=64, d_model=32, layers=windowed))
    with pytest.raises(ValueError, match="only with an earlier layer, got kv_source=1"):
        Attention(d_model=32, layer_idx=1, n_heads=4, kv_source=1)


def test_shared_caches_are_owned_once_but_read_by_every_layer():
    cla = zoo.build("cla", preset="tiny", n_layers=4, share=2)
    gqa = zoo.build("gqa", preset="tiny", n_layers=4)
    assert zoo.cache_bytes(cla, seq_len=10) * 2 == zoo.cache_bytes(gqa, seq_len=10)
    assert zoo.cache_read_bytes(cla, seq_len=10) == zoo.cache_read_bytes(gqa, seq_len=10) == zoo.cache_bytes(gqa, seq_len=10)
    engine = Engine(cla, max_batch=1, max_seq_len=32)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
    # MBU's byte count: three decode steps after a 3-token prompt attend over 4, 5 and 6 keys in all 4 layers
    assert list(engine.decode_stats.kv_bytes) == [zoo.cache_read_bytes(cla, seq_len=n) for n in (4, 5, 6)]
