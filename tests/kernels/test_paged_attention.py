import pytest
import torch

import kernels.paged_attention as paged_attention
from cache import Retention
from spans import sees, visible_span  # tests/kernels/ is on sys.path under pytest
from kernels import (
    cpu_kernels_available,
    FORCE_TRITON_ENV,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    triton_available,
    use_triton,
)

SEQ_LENS = [1, 19, 70, 33]  # mixed lengths, all but one ending mid-block; 1 = a fresh sequence
# (query heads, KV heads); the MQA group of 6 is no power of two
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (6, 1)}
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=1e-2)}
# with block 16: windows inside one block, exactly one block, several blocks, longer than every sequence; sinks
# inside the first block and beside a window; chunks aligned to blocks and not
RETENTIONS = {"window_inside_block": Retention(window=5), "window_one_block": Retention(window=16),
              "window_several_blocks": Retention(window=40), "window_past_seq_len": Retention(window=1000),
              "sinks": Retention(sinks=4, window=20), "sinks_past_block": Retention(sinks=19, window=5),
              "chunk": Retention(chunk=32), "chunk_unaligned": Retention(chunk=20),
              "dilated": Retention(window=6, dilation=3), "dilated_past_blocks": Retention(window=20, dilation=5)}


def naive_decode_attention(q, k_pool, v_pool, block_table, seq_lens, scale, retention=None):
    """Gather each sequence's visible keys one position at a time and take a plain float64 softmax."""
    batch, num_heads, _ = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    out = torch.empty(batch, num_heads, v_pool.shape[3], dtype=torch.float64)
    for seq in range(batch):
        for head in range(num_heads):
            kv_head = head // (num_heads // num_kv_heads)
            query = int(seq_lens[seq]) - 1
            slots = [(int(block_table[seq, pos // block_size]), pos % block_size)
                     for pos in range(query + 1) if sees(pos, query, retention)]
            keys = torch.stack([k_pool[block, offset, kv_head] for block, offset in slots]).double()
            values = torch.stack([v_pool[block, offset, kv_head] for block, offset in slots]).double()
            weights = torch.softmax(keys @ q[seq, head].double() * scale, dim=0)
            out[seq, head] = weights @ values
    return out


def make_query(batch, num_heads, dim, dtype, device):
    """A strided (non-contiguous) [B, H, D] view, as attention layers slice it from a projection."""
    generator = torch.Generator().manual_seed(batch * num_heads + dim)
    return torch.randn(batch, dim, num_heads, generator=generator).to(device, dtype).transpose(1, 2)


def check_triton_against_reference(cache, q, num_splits=None, retention=None):
    scale = q.shape[-1] ** -0.5
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, scale)
    span = visible_span(retention, cache.seq_lens)
    expected = paged_decode_attention_ref(*args, **span)
    actual = paged_decode_attention_triton(*args, num_splits=num_splits, **span)
    assert actual.dtype == q.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCE[q.dtype])
    if retention is not None:  # the bounded paths also answer to the float64 loop
        naive = naive_decode_attention(*(t.cpu() for t in args[:5]), scale, retention=retention)
        torch.testing.assert_close(expected.cpu(), naive.to(q.dtype), **TOLERANCE[q.dtype])


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("storage", ["position-major", "head-major"])
def test_reference_matches_naive_gather(paged_cache, layout, storage):
    num_heads, num_kv_heads = HEAD_LAYOUTS[layout]
    cache = paged_cache(SEQ_LENS, 16, num_kv_heads, 32, 32, torch.float32, "cpu", head_major=storage == "head-major")
    q = make_query(len(SEQ_LENS), num_heads, 32, torch.float32, "cpu")
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, 0.3)
    torch.testing.assert_close(paged_decode_attention_ref(*args), naive_decode_attention(*args).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_triton_matches_reference(force_triton, device, paged_cache, layout, dtype):
    num_heads, num_kv_heads = HEAD_LAYOUTS[layout]
    cache = paged_cache(SEQ_LENS, 16, num_kv_heads, 32, 32, dtype, device)
    check_triton_against_reference(cache, make_query(len(SEQ_LENS), num_heads, 32, dtype, device))


def test_triton_reads_a_head_major_pool(force_triton, device, paged_cache):
    """The engine's pools are head-major views: the kernel follows their strides."""
    cache = paged_cache(SEQ_LENS, 16, 4, 32, 32, torch.float32, device, head_major=True)
    assert cache.k_pool.stride(2) > cache.k_pool.stride(1)
    check_triton_against_reference(cache, make_query(len(SEQ_LENS), 12, 32, torch.float32, device))


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_triton_block_sizes(force_triton, device, paged_cache, block_size):
    cache = paged_cache(SEQ_LENS, block_size, 2, 16, 16, torch.float32, device)
    check_triton_against_reference(cache, make_query(len(SEQ_LENS), 8, 16, torch.float32, device))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_triton_splits_with_empty_slices(force_triton, device, paged_cache, num_splits):
    # 150 keys span several 64-key steps and splits; the short sequences leave later splits empty
    seq_lens = [150, 3, 70, 1]
    cache = paged_cache(seq_lens, 16, 2, 16, 16, torch.float32, device)
    check_triton_against_reference(cache, make_query(len(seq_lens), 8, 16, torch.float32, device), num_splits)


def test_triton_every_sequence_of_length_one(force_triton, device, paged_cache):
    cache = paged_cache([1, 1, 1], 16, 1, 32, 32, torch.float16, device)
    check_triton_against_reference(cache, make_query(3, 4, 32, torch.float16, device), num_splits=2)


def test_triton_unpadded_and_unequal_head_dims(force_triton, device, paged_cache):
    # MLA-style decode: keys wider than values, neither a power of two
    cache = paged_cache(SEQ_LENS, 16, 1, 24, 20, torch.float32, device)
    check_triton_against_reference(cache, make_query(len(SEQ_LENS), 4, 24, torch.float32, device))


@pytest.mark.parametrize("retention", RETENTIONS.values(), ids=RETENTIONS.keys())
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_reference_matches_naive_gather_bounded(paged_cache, layout, retention):
    num_heads, num_kv_heads = HEAD_LAYOUTS[layout]
    cache = paged_cache(SEQ_LENS, 16, num_kv_heads, 32, 32, torch.float32, "cpu", retention=retention)
    q = make_query(len(SEQ_LENS), num_heads, 32, torch.float32, "cpu")
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, 0.3)
    expected = naive_decode_attention(*args, retention=retention).float()
    torch.testing.assert_close(paged_decode_attention_ref(*args, **visible_span(retention, cache.seq_lens)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("retention", RETENTIONS.values(), ids=RETENTIONS.keys())
def test_triton_bounded_matches_reference(force_triton, device, paged_cache, retention, dtype):
    # dropped blocks' table entries are -1 and dropped slots NaN: reading either shows up in the output
    cache = paged_cache(SEQ_LENS, 16, 2, 16, 16, dtype, device, retention=retention)
    check_triton_against_reference(cache, make_query(len(SEQ_LENS), 8, 16, dtype, device), retention=retention)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_triton_windowed_head_layouts(force_triton, device, paged_cache, layout):
    num_heads, num_kv_heads = HEAD_LAYOUTS[layout]
    retention = Retention(window=20)
    cache = paged_cache(SEQ_LENS, 8, num_kv_heads, 16, 16, torch.float16, device, retention=retention)
    q = make_query(len(SEQ_LENS), num_heads, 16, torch.float16, device)
    check_triton_against_reference(cache, q, retention=retention)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("retention", [Retention(window=40), Retention(window=150), Retention(sinks=20, window=40),
                                       Retention(chunk=100), Retention(window=40, dilation=4)],
                         ids=["window40", "window150", "sinks", "chunk", "dilated"])
def test_triton_bounded_long_sequences_in_splits(force_triton, device, paged_cache, retention, num_splits):
    # The 300-key sequence's span starts mid-block far from position 0: a split over [0, capacity) would
    # lie wholly before it and read -1 table entries. Window 150 spans two 128-key splits, window 40 one
    # (the rest empty), sinks put a split across the gap, and the 2-key sequence leaves all but its first split empty.
    seq_lens = [300, 2, 170]
    cache = paged_cache(seq_lens, 16, 1, 16, 16, torch.float32, device, retention=retention)
    q = make_query(len(seq_lens), 2, 16, torch.float32, device)
    check_triton_against_reference(cache, q, num_splits=num_splits, retention=retention)


@pytest.mark.parametrize("bad, match", [(dict(sinks=-1), "sinks must be >= 0"), (dict(max_keys=0), "max_keys"),
                                        (dict(starts=torch.zeros(2, dtype=torch.int32)), "starts"),
                                        (dict(stride=0), "stride must be >= 1"),
                                        (dict(stride=2), "above 1 only with starts"),
                                        (dict(stride=2, sinks=2, starts=torch.zeros(1, dtype=torch.int32)),
                                         "no sinks")])
def test_bad_span_arguments_raise(paged_cache, bad, match):
    cache = paged_cache([5], 16, 1, 16, 16, torch.float32, "cpu")
    args = (make_query(1, 2, 16, torch.float32, "cpu"), cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens)
    for attention in (paged_decode_attention_ref, paged_decode_attention_triton):
        with pytest.raises(ValueError, match=match):
            attention(*args, 0.25, **bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 is broken in the Triton interpreter")
@pytest.mark.parametrize("retention", [None, Retention(window=1000), Retention(sinks=4, window=1000)])
def test_triton_bf16_on_gpu(paged_cache, retention):
    cache = paged_cache([1, 300, 4097], 16, 8, 128, 128, torch.bfloat16, "cuda", retention=retention)
    q = make_query(3, 32, 128, torch.bfloat16, "cuda")
    scale = 128**-0.5
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, scale)
    span = visible_span(retention, cache.seq_lens)
    torch.testing.assert_close(paged_decode_attention_triton(*args, **span),
                               paged_decode_attention_ref(*args, **span), atol=2e-2, rtol=2e-2)


def test_use_triton_false_for_cpu_tensors_by_default(monkeypatch):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    assert not use_triton(torch.zeros(2), torch.zeros(3))


def test_use_triton_true_when_forced(monkeypatch):
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    assert use_triton(torch.zeros(2)) == triton_available()


@pytest.mark.parametrize("forced", [False, True])
def test_dispatcher_routes_by_use_triton(monkeypatch, paged_cache, forced):
    if forced and not triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if forced else "0")
    called = []
    monkeypatch.setattr(paged_attention, "paged_decode_attention_triton", lambda *a, **kw: called.append("triton"))
    monkeypatch.setattr(paged_attention, "paged_decode_attention_ref", lambda *a, **kw: called.append("ref"))
    monkeypatch.setattr(paged_attention.cpu_decode, "paged_decode_attention_cpu", lambda *a, **kw: called.append("cpu"))
    cache = paged_cache([5], 16, 1, 16, 16, torch.float32, "cpu")
    paged_decode_attention(make_query(1, 2, 16, torch.float32, "cpu"), cache.k_pool, cache.v_pool,
                           cache.block_table, cache.seq_lens, 0.25)
    assert called == ["triton" if forced else ("cpu" if cpu_kernels_available() else "ref")]
