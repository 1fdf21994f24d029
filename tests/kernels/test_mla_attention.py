import pytest
import torch

import kernels.mla_attention as mla_attention
from kernels import (
    cpu_kernels_available,
    FORCE_TRITON_ENV,
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    paged_decode_attention_ref,
    triton_available,
)

SEQ_LENS = [1, 19, 70, 33]  # mixed lengths, all but one ending mid-block; 1 = a fresh sequence
# latent row width -> value_dim (kv_lora_rank); the rest of the row is the rope key. 80 = 60 + 20 pads both parts
WIDTHS = {"w48": (48, 32), "w80": (80, 60), "w576": (576, 512)}
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=1e-2)}


def latent_cache(paged_cache, seq_lens, block_size, width, dtype, device):
    """The paged-cache builder's key pool with one head is a latent pool: shuffled blocks, NaN where unowned."""
    cache = paged_cache(seq_lens, block_size, 1, width, 1, dtype, device)
    return cache.k_pool[:, :, 0], cache.block_table, cache.seq_lens


def make_query(batch, num_heads, width, dtype, device):
    """A strided (non-contiguous) [B, H, W] view, as the absorbed query comes out of a concatenation."""
    generator = torch.Generator().manual_seed(batch * num_heads + width)
    return torch.randn(batch, width, num_heads, generator=generator).to(device, dtype).transpose(1, 2)


def naive_mla_attention(q, latent_pool, block_table, seq_lens, scale, value_dim):
    """Gather each sequence's rows one position at a time; every head takes a plain float64 softmax over them."""
    batch, num_heads, _ = q.shape
    block_size = latent_pool.shape[1]
    out = torch.empty(batch, num_heads, value_dim, dtype=torch.float64)
    for seq in range(batch):
        rows = torch.stack([latent_pool[int(block_table[seq, pos // block_size]), pos % block_size]
                            for pos in range(seq_lens[seq])]).double()
        for head in range(num_heads):
            weights = torch.softmax(rows @ q[seq, head].double() * scale, dim=0)
            out[seq, head] = weights @ rows[:, :value_dim]
    return out


def check_triton(q, latent_pool, block_table, seq_lens, value_dim, num_splits=None):
    """Triton == reference == the float64 loop."""
    args = (q, latent_pool, block_table, seq_lens, q.shape[-1] ** -0.5, value_dim)
    expected = mla_decode_attention_ref(*args)
    actual = mla_decode_attention_triton(*args, num_splits=num_splits)
    assert actual.dtype == q.dtype and actual.shape == (q.shape[0], q.shape[1], value_dim)
    torch.testing.assert_close(actual, expected, **TOLERANCE[q.dtype])
    naive = naive_mla_attention(*(t.cpu() for t in args[:4]), *args[4:])
    torch.testing.assert_close(expected.cpu(), naive.to(q.dtype), **TOLERANCE[q.dtype])


@pytest.mark.parametrize("shape", WIDTHS.values(), ids=WIDTHS.keys())
def test_reference_matches_naive_loop(paged_cache, shape):
    width, value_dim = shape
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, SEQ_LENS, 16, width, torch.float32, "cpu")
    q = make_query(len(SEQ_LENS), 5, width, torch.float32, "cpu")
    args = (q, latent_pool, block_table, seq_lens, 0.1, value_dim)
    torch.testing.assert_close(mla_decode_attention_ref(*args), naive_mla_attention(*args).float())


def test_reference_is_mqa_over_two_views_of_the_latent(paged_cache):
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, SEQ_LENS, 16, 48, torch.float32, "cpu")
    q = make_query(len(SEQ_LENS), 5, 48, torch.float32, "cpu")
    generic = paged_decode_attention_ref(q, latent_pool.unsqueeze(2), latent_pool[..., :32].unsqueeze(2),
                                         block_table, seq_lens, 0.1)
    torch.testing.assert_close(mla_decode_attention_ref(q, latent_pool, block_table, seq_lens, 0.1, 32), generic)


@pytest.mark.parametrize("shape", [WIDTHS["w48"], WIDTHS["w80"]], ids=["w48", "w80"])
@pytest.mark.parametrize("num_heads", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_matches_reference(force_triton, device, paged_cache, dtype, num_heads, shape):
    width, value_dim = shape
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, SEQ_LENS, 16, width, dtype, device)
    check_triton(make_query(len(SEQ_LENS), num_heads, width, dtype, device), latent_pool, block_table, seq_lens,
                 value_dim)


@pytest.mark.parametrize("num_heads", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_deepseek_width(force_triton, device, paged_cache, dtype, num_heads):
    # rank 512 + rope 64, few tokens: the interpreter is slow at this width
    seq_lens = [1, 13, 6]
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, seq_lens, 8, 576, dtype, device)
    check_triton(make_query(len(seq_lens), num_heads, 576, dtype, device), latent_pool, block_table, seq_lens, 512)


def test_triton_several_head_tiles(force_triton, device, paged_cache):
    # 37 heads = two full 16-head programs and a partial one
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, SEQ_LENS, 16, 48, torch.float16, device)
    check_triton(make_query(len(SEQ_LENS), 37, 48, torch.float16, device), latent_pool, block_table, seq_lens, 32)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_triton_splits_with_empty_slices(force_triton, device, paged_cache, num_splits):
    # 150 keys span several steps and splits; the short sequences leave later splits empty
    seq_lens = [150, 3, 70, 1]
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, seq_lens, 16, 48, torch.float32, device)
    check_triton(make_query(len(seq_lens), 5, 48, torch.float32, device), latent_pool, block_table, seq_lens, 32,
                 num_splits)


def test_triton_row_without_rope_part(force_triton, device, paged_cache):
    # value_dim == width: the value is the whole row
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, SEQ_LENS, 16, 32, torch.float32, device)
    check_triton(make_query(len(SEQ_LENS), 5, 32, torch.float32, device), latent_pool, block_table, seq_lens, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
def test_triton_bf16_on_gpu(paged_cache):
    # DeepSeek-V3's decode shape: 128 heads over a 512 + 64 latent
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, [1, 300, 4097], 16, 576, torch.bfloat16, "cuda")
    q = make_query(3, 128, 576, torch.bfloat16, "cuda")
    args = (q, latent_pool, block_table, seq_lens, 192**-0.5, 512)
    torch.testing.assert_close(mla_decode_attention_triton(*args), mla_decode_attention_ref(*args),
                               atol=2e-2, rtol=2e-2)


BAD_SHAPES = {
    # name: (q shape, latent_pool shape, block_table shape, seq_lens shape, value_dim, words in the message)
    "q_2d": ((2, 48), (4, 16, 48), (2, 3), (2,), 32, "(2, 48)"),
    "pool_4d": ((2, 5, 48), (4, 16, 1, 48), (2, 3), (2,), 32, "(4, 16, 1, 48)"),
    "widths_differ": ((2, 5, 48), (4, 16, 40), (2, 3), (2,), 32, "48"),
    "value_dim_too_wide": ((2, 5, 48), (4, 16, 48), (2, 3), (2,), 49, "value_dim 49"),
    "value_dim_zero": ((2, 5, 48), (4, 16, 48), (2, 3), (2,), 0, "value_dim 0"),
    "table_batch": ((2, 5, 48), (4, 16, 48), (3, 3), (2,), 32, "(3, 3)"),
    "seq_lens_batch": ((2, 5, 48), (4, 16, 48), (2, 3), (1,), 32, "(1,)"),
}


@pytest.mark.parametrize("attention", [mla_decode_attention_ref, mla_decode_attention_triton],
                         ids=["ref", "triton"])
@pytest.mark.parametrize("case", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_bad_shapes_raise(case, attention):
    q_shape, pool_shape, table_shape, lens_shape, value_dim, message = case
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        attention(torch.zeros(q_shape), torch.zeros(pool_shape), torch.zeros(table_shape, dtype=torch.int32),
                  torch.ones(lens_shape, dtype=torch.int32), 0.1, value_dim)


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, paged_cache, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(mla_attention, "mla_decode_attention_triton", lambda *a, **kw: called.append("triton"))
    monkeypatch.setattr(mla_attention, "mla_decode_attention_ref", lambda *a: called.append("ref"))
    monkeypatch.setattr(mla_attention.cpu_decode, "mla_decode_attention_cpu", lambda *a, **kw: called.append("cpu"))
    latent_pool, block_table, seq_lens = latent_cache(paged_cache, [5], 16, 48, torch.float32, "cpu")
    mla_decode_attention(make_query(1, 2, 48, torch.float32, "cpu"), latent_pool, block_table, seq_lens, 0.25, 32)
    assert called == ["triton" if forced else ("cpu" if cpu_kernels_available() else "ref")]
