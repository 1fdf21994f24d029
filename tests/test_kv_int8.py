"""The int8 KV cache (Engine(kv_dtype="int8")): rows stored as int8 with a scale per token and KV head, for every
architecture with a per-token cache, in both layouts. The stored rows are what an independent rounding gives, paged
equals contiguous token for token, the bytes allocated are the analytic bytes with their scales, decoding stays
within rounding of the float cache, and bad settings fail before any work."""
import pytest
import torch

import zoo
from cache import Int8Rows
from harness import Engine
from helpers import greedy, make_prompts, random_model

ARCHS = [name for name in zoo.architectures() if zoo.is_causal(name)]
KV_ARCHS = [a for a in ARCHS if any(s.elements_per_token for s in zoo.build(a, preset="tiny").cache_specs())]


def test_int8_rows_store_an_independent_rounding():
    rows = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)) * 4
    store = Int8Rows.zeros(3, 5, 16, dtype=torch.float32, device="cpu")
    store[:, 1:4] = rows[:, 1:4]
    step = rows[:, 1:4].abs().max(dim=-1, keepdim=True).values / 127
    want = (rows[:, 1:4] / step).round() * step
    assert torch.allclose(store[:, 1:4], want, atol=1e-6)
    assert (store[:, 1:4] - rows[:, 1:4]).abs().le(step / 2 + 1e-6).all()
    assert not store[:, 0].any() and store.nbytes == 3 * 5 * (16 + 4)
    assert torch.equal(store.transpose(0, 1)[2], store[:, 2])


@pytest.mark.parametrize("arch", KV_ARCHS)
def test_paged_equals_contiguous_and_bytes_are_analytic(arch):
    model = random_model(arch, seed=1)
    prompts = make_prompts([5, 23, 11], model.config.vocab_size, seed=1)
    runs = {}
    for layout in ("contiguous", "paged"):
        engine = Engine(model, max_batch=3, max_seq_len=64, kv_cache=layout, block_size=8, kv_dtype="int8")
        runs[layout] = engine.generate(prompts, greedy(12))
        if layout == "contiguous":  # every row allocated at max_seq_len
            assert engine.cache_bytes_allocated == zoo.cache_bytes(model, 64, batch=3, kv_format="int8")
    for a, b in zip(runs["contiguous"], runs["paged"]):
        assert a.token_ids == b.token_ids
        assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ["gqa", "mla", "swa", "cla", "hybrid"])
def test_decoding_stays_within_rounding_of_the_float_cache(arch):
    torch.manual_seed(2)
    model = zoo.build(arch, preset="tiny").eval()  # the default init: no chaotic amplification of a rounding
    prompts = make_prompts([9, 30], model.config.vocab_size, seed=3)
    exact = Engine(model, max_batch=2, max_seq_len=64).generate(prompts, greedy(10))
    rounded = Engine(model, max_batch=2, max_seq_len=64, kv_dtype="int8").generate(prompts, greedy(10))
    for a, b in zip(exact, rounded):
        assert a.token_ids == b.token_ids
        want = torch.stack(a.logits)
        assert (torch.stack(b.logits) - want).abs().max() <= 0.02 * want.abs().max()


def test_int8_bytes_are_half_of_bf16_less_the_scales():
    """At the small preset in bf16: a token's int8 cache is its elements in bytes plus one 2-byte scale per row, so
    a budget holds (2 * head_dim) / (head_dim + 2) times as many sequences (64-wide heads: 1.94x)."""
    model = zoo.build("gqa", preset="small").to(torch.bfloat16)
    bf16, int8 = (zoo.cache_bytes(model, 4096, kv_format=f) for f in ("auto", "int8"))
    head_dim = model.blocks[0].mixer.head_dim
    assert int8 * 2 * head_dim == bf16 * (head_dim + 2)
    budget = 64 * 2**20
    for layout in ("contiguous", "paged"):
        engine = Engine(zoo.build("gqa", preset="tiny").to(torch.bfloat16), max_batch=256, max_seq_len=256,
                        kv_cache=layout, cache_budget_bytes=budget, kv_dtype="int8")
        assert engine.cache_bytes_allocated <= budget
    two_gib = 2 * 2**30  # the budget, at context 4096: 248 sequences against 128
    assert (two_gib // int8, two_gib // bf16) == (248, 128)


def test_bad_kv_settings_are_errors_before_work():
    with pytest.raises(ValueError, match="unknown kv_dtype 'int4'"):
        Engine(random_model("gqa"), kv_dtype="int4")
    with pytest.raises(ValueError, match="keeps no per-token cache"):
        Engine(random_model("mamba"), kv_dtype="int8")
    with pytest.raises(ValueError, match="unknown kv_format"):
        zoo.cache_bytes(random_model("gqa"), 16, kv_format="fp4")


def test_compare_puts_int8_caches_beside_float_ones(tmp_path):
    from harness.compare import CompareSettings, run_compare
    settings = CompareSettings(archs=["gqa", "mla"], preset="tiny", contexts=[32], batches=[1], new_tokens=3,
                               kv_dtypes=["auto", "int8"], out=tmp_path)
    rows = {(r["arch"], r["kv_dtype"]): r for r in run_compare(settings, show_progress=False)}
    for arch in ("gqa", "mla"):
        auto, int8 = rows[arch, "auto"], rows[arch, "int8"]
        assert int8["analytic_cache_bytes"] == int8["measured_cache_bytes"] < auto["analytic_cache_bytes"]
        assert int8["step_cache_read_bytes"] < auto["step_cache_read_bytes"]  # the floor counts the int8 bytes
    with pytest.raises(ValueError, match="'mamba' keeps no per-token cache"):
        run_compare(CompareSettings(archs=["mamba"], preset="tiny", contexts=[32], kv_dtypes=["int8"],
                                    out=tmp_path / "m"), show_progress=False)
    with pytest.raises(ValueError, match="unknown kv_dtype 'fp4'"):
        run_compare(CompareSettings(archs=["gqa"], preset="tiny", contexts=[32], kv_dtypes=["fp4"],
                                    out=tmp_path / "f"), show_progress=False)
