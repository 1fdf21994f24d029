"""The one-byte KV caches (Engine(kv_dtype="int8" or "fp8")): rows stored as int8 or float8 e4m3 with a scale per
token and KV head (an MLA latent row: one for the latent, one for its rotary part), for every architecture with a
per-token cache, in both layouts. The stored rows are what an independent rounding gives, paged equals contiguous
token for token, the bytes allocated are the analytic bytes with their scales, decoding stays within rounding of the
float cache, and bad settings fail before any work."""
import pytest
import torch

import zoo
from cache import QuantizedRows
from harness import Engine
from helpers import greedy, make_prompts, random_model

ARCHS = [name for name in zoo.architectures() if zoo.is_causal(name)]
KV_ARCHS = [a for a in ARCHS if any(s.elements_per_token for s in zoo.build(a, preset="tiny").cache_specs())]


def test_int8_rows_store_an_independent_rounding():
    rows = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)) * 4
    store = QuantizedRows.zeros(3, 5, 16, dtype=torch.float32, device="cpu")
    store[:, 1:4] = rows[:, 1:4]
    step = rows[:, 1:4].abs().max(dim=-1, keepdim=True).values / 127
    want = (rows[:, 1:4] / step).round() * step
    assert torch.allclose(store[:, 1:4], want, atol=1e-6)
    assert (store[:, 1:4] - rows[:, 1:4]).abs().le(step / 2 + 1e-6).all()
    assert not store[:, 0].any() and store.nbytes == 3 * 5 * (16 + 4)
    assert torch.equal(store.transpose(0, 1)[2], store[:, 2])


def test_fp8_rows_keep_e4m3_precision():
    """e4m3 has 3 mantissa bits: each stored value is within half a step (2^(exponent - 4) of the scaled value) of
    its row's value over the row's scale, the row's largest magnitude lands on 448 exactly, and the values are
    e4m3 numbers (a cast there and back changes nothing)."""
    rows = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(5)) * 3
    store = QuantizedRows.zeros(4, 6, 32, dtype=torch.float32, device="cpu", kv_format="fp8")
    store[:, 2:5] = rows[:, 2:5]
    assert store.values.dtype == torch.float8_e4m3fn and store.nbytes == 4 * 6 * (32 + 4)
    scale = rows[:, 2:5].abs().amax(dim=-1, keepdim=True) / 448
    scaled, stored = rows[:, 2:5] / scale, store[:, 2:5] / scale
    normal = scaled.abs() >= 2 ** -6
    half_step = 2.0 ** (torch.floor(torch.log2(scaled.abs().clamp_min(2 ** -6))) - 4)
    assert ((stored - scaled).abs() <= half_step * 1.0001 + 1e-6)[normal].all()
    assert ((stored - scaled).abs() <= 2 ** -10 + 1e-6)[~normal].all()  # subnormals: steps of 2^-9
    assert torch.allclose(stored.abs().amax(dim=-1), torch.full((4, 3), 448.0))
    assert torch.equal(store.values.float().to(torch.float8_e4m3fn).float(), store.values.float())


def test_a_latent_row_keeps_a_scale_for_its_latent_and_one_for_its_rotary_part():
    """MLA caches the normalised latent and the rotary part of the key side by side, of very different sizes: each
    part is rounded in steps of its own max |x| / 127 (one scale for both would round the latent in the rotary
    part's steps), and a token costs its row in bytes plus two scales, in the engine's allocation too."""
    rows = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1))
    rows[..., 16:] *= 20
    store = QuantizedRows.zeros(2, 7, 24, dtype=torch.float32, device="cpu", split=16)
    store[:, :] = rows
    for part in (slice(0, 16), slice(16, 24)):
        step = rows[..., part].abs().amax(dim=-1, keepdim=True) / 127
        assert (store[:, :][..., part] - rows[..., part]).abs().le(step / 2 + 1e-6).all()
    assert store.nbytes == 2 * 7 * (24 + 2 * 4)
    model = zoo.build("mla", preset="tiny")
    mixer = model.blocks[0].mixer
    row = mixer.kv_lora_rank + mixer.rope_dim
    assert zoo.cache_bytes(model, 10, kv_format="int8") == 10 * len(model.blocks) * (row + 2 * 4)  # fp32 scales
    engine = Engine(model, max_batch=1, max_seq_len=10, kv_dtype="int8")
    assert engine.cache_bytes_allocated == 10 * len(model.blocks) * (row + 2 * 4)


@pytest.mark.parametrize("arch,kv_format", [(a, "int8") for a in KV_ARCHS] + [(a, "fp8") for a in ("gqa", "mla", "swa")])
def test_paged_equals_contiguous_and_bytes_are_analytic(arch, kv_format):
    model = random_model(arch, seed=1)
    prompts = make_prompts([5, 23, 11], model.config.vocab_size, seed=1)
    runs = {}
    for layout in ("contiguous", "paged"):
        engine = Engine(model, max_batch=3, max_seq_len=64, kv_cache=layout, block_size=8, kv_dtype=kv_format)
        runs[layout] = engine.generate(prompts, greedy(12))
        if layout == "contiguous":  # every row allocated at max_seq_len
            assert engine.cache_bytes_allocated == zoo.cache_bytes(model, 64, batch=3, kv_format=kv_format)
    # The two layouts' decode steps agree to rounding, not bit for bit (sink's first decode step: 1.4e-6 apart with
    # fp32 caches). A one-byte row can round the other way on such a difference, which moves later logits by up to
    # ~5e-3 (sink, int8): far below what a wrong row or scale does.
    for a, b in zip(runs["contiguous"], runs["paged"]):
        assert a.token_ids == b.token_ids
        assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max() < 2e-2


@pytest.mark.parametrize("arch,kv_format", [(a, "int8") for a in ("gqa", "mla", "swa", "cla", "hybrid")]
                         + [(a, "fp8") for a in ("gqa", "mla")])
def test_decoding_stays_within_rounding_of_the_float_cache(arch, kv_format):
    torch.manual_seed(2)
    model = zoo.build(arch, preset="tiny").eval()  # the default init: no chaotic amplification of a rounding
    prompts = make_prompts([9, 30], model.config.vocab_size, seed=3)
    exact = Engine(model, max_batch=2, max_seq_len=64).generate(prompts, greedy(10))
    rounded = Engine(model, max_batch=2, max_seq_len=64, kv_dtype=kv_format).generate(prompts, greedy(10))
    for a, b in zip(exact, rounded):
        assert a.token_ids == b.token_ids
        want = torch.stack(a.logits)
        assert (torch.stack(b.logits) - want).abs().max() <= 0.02 * want.abs().max()


def test_int8_bytes_are_half_of_bf16_less_the_scales():
    """At the small preset in bf16: a token's int8 cache is its elements in bytes plus one 2-byte scale per row, so
    a budget holds (2 * head_dim) / (head_dim + 2) times as many sequences (64-wide heads: 1.94x)."""
    model = zoo.build("gqa", preset="small").to(torch.bfloat16)
    bf16, int8, fp8 = (zoo.cache_bytes(model, 4096, kv_format=f) for f in ("auto", "int8", "fp8"))
    head_dim = model.blocks[0].mixer.head_dim
    assert int8 * 2 * head_dim == bf16 * (head_dim + 2) and fp8 == int8
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


def test_fp8_on_a_gpu_without_e4m3_is_an_error(monkeypatch):
    """An A100 (sm_80) has no float8 e4m3 for the Triton kernels: the engine says so instead of running them."""
    import harness.engine.checks
    monkeypatch.setattr(harness.engine.checks, "fp8_kernels_missing", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"kv_dtype='fp8' on CUDA needs compute capability 8.9.*\(8, 0\).*int8"):
        Engine(random_model("gqa"), kv_dtype="fp8")
    monkeypatch.undo()
    assert not harness.engine.checks.fp8_kernels_missing(torch.device("cpu"))


@pytest.mark.usefixtures("machine_rates_once")
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
