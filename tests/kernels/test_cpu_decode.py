"""The compiled CPU decode-attention kernel against the PyTorch references (and a float64 loop), in every layout."""
import platform

import pytest
import torch

from kernels import (cpu_kernels_available, contiguous_decode_attention, contiguous_decode_attention_ref,
                     mla_decode_attention, mla_decode_attention_ref, paged_decode_attention, paged_decode_attention_ref,
                     use_cpu_kernel)
from kernels import cpu_decode
from kernels.cpu_decode import decode_attention

from cache import Retention
from spans import visible_span  # tests/kernels/ is on sys.path under pytest
from test_paged_attention import naive_decode_attention

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler on this machine")

SEQ_LENS = [1, 19, 70, 33, 300]  # a fresh sequence, mid-block ends, one long enough for several splits
HEAD_LAYOUTS = {"mha": (4, 4), "gqa": (12, 4), "mqa": (6, 1)}
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=1e-2)}


def query(batch, heads, dim, dtype, seed=0):
    return torch.randn(batch, heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("retention", [None, Retention(window=5), Retention(window=40), Retention(sinks=4, window=40),
                                       Retention(sinks=35, window=5), Retention(chunk=48),
                                       Retention(window=20, dilation=3)],
                         ids=["all", "window5", "window40", "sinks4", "sinks35", "chunk48", "dilated20x3"])
@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("storage", ["position-major", "head-major"])
def test_paged_matches_reference(paged_cache, dtype, layout, retention, splits, storage):
    heads, kv_heads = HEAD_LAYOUTS[layout]
    cache = paged_cache(SEQ_LENS, 16, kv_heads, 64, 64, dtype, "cpu", retention=retention,  # unowned slots hold NaN
                        head_major=storage == "head-major")
    q = query(len(SEQ_LENS), heads, 64, dtype)
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens)
    span = visible_span(retention, cache.seq_lens)
    actual = decode_attention(*args, "blocks", 0.125, 64, span.get("starts"), span.get("sinks", 0),
                              span.get("max_keys") or 0, splits, stride=span.get("stride", 1))
    expected = paged_decode_attention_ref(*args, 0.125, **span)
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])
    if dtype == torch.float32 and splits == 3:  # and the float64 loop, not only our other implementation
        naive = naive_decode_attention(*args, 0.125, retention=retention)
        torch.testing.assert_close(actual.double(), naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("width, value_dim, heads", [(48, 32, 5), (80, 64, 16), (99, 37, 3)])
def test_mla_latent_matches_reference(paged_cache, dtype, width, value_dim, heads):
    cache = paged_cache(SEQ_LENS, 8, 1, width, width, dtype, "cpu")
    latent = cache.k_pool[:, :, 0]  # [num_blocks, block_size, W]: keys; values are their first value_dim columns
    q = query(len(SEQ_LENS), heads, width, dtype, seed=1)
    args = (q, latent, cache.block_table, cache.seq_lens, width**-0.5, value_dim)
    torch.testing.assert_close(mla_decode_attention(*args), mla_decode_attention_ref(*args), **TOLERANCE[dtype])


def contiguous_cache(lengths, slots, kv_heads, dim, rows, dtype, latent=False):
    """[slots, KVH, rows, D] with NaN in every row past a sequence's length and in slots no sequence uses."""
    g = torch.Generator().manual_seed(rows)
    k = torch.full((max(slots) + 2, kv_heads, rows, dim), float("nan"))
    v = None if latent else k.clone()
    for slot, n in zip(slots, lengths):
        k[slot, :, :n] = torch.randn(kv_heads, n, dim, generator=g)
        if v is not None:
            v[slot, :, :n] = torch.randn(kv_heads, n, dim, generator=g)
    return k.to(dtype), None if v is None else v.to(dtype)


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_contiguous_matches_reference(dtype, layout):
    heads, kv_heads = HEAD_LAYOUTS[layout]
    lengths, slots = [5, 300, 1, 64], [3, 0, 2, 5]  # slots out of order: the kernel follows the slot of each row
    k, v = contiguous_cache(lengths, slots, kv_heads, 32, 320, dtype)
    q = query(len(lengths), heads, 32, dtype, seed=2)
    args = (q, k, v, torch.tensor(slots), torch.tensor(lengths, dtype=torch.int32), 32**-0.5, 32)
    assert use_cpu_kernel(q, k)
    actual = contiguous_decode_attention(*args)
    torch.testing.assert_close(actual, contiguous_decode_attention_ref(*args), **TOLERANCE[dtype])


def test_contiguous_latent_rows():
    lengths, slots = [7, 200], [1, 0]
    k, _ = contiguous_cache(lengths, slots, 1, 72, 256, torch.float32, latent=True)
    q = query(2, 8, 72, torch.float32, seed=3)
    args = (q, k, None, torch.tensor(slots), torch.tensor(lengths, dtype=torch.int32), 0.1, 64)
    torch.testing.assert_close(contiguous_decode_attention(*args), contiguous_decode_attention_ref(*args),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 targets")
@pytest.mark.parametrize("target", ["-march=haswell", "-march=x86-64"], ids=["avx2", "generic vectors"])
def test_the_paths_other_cpus_take(monkeypatch, target):
    """The AVX2 build (8 lanes, two heads a block) and GCC's generic vectors built here too: groups of 1, 3, 5 and 6
    query heads a KV head, head dims and value dims with a tail past whole vectors, a latent row."""
    flags = [flag for flag in cpu_decode.FLAGS if not flag.startswith("-march")]
    monkeypatch.setattr(cpu_decode, "FLAGS", flags + [target])
    cpu_decode._library.cache_clear()
    try:
        lengths, slots = [5, 300, 1, 64], [3, 0, 2, 5]
        for heads, kv_heads, dim in ((4, 4, 32), (6, 2, 72), (5, 1, 40), (6, 1, 99)):
            k, v = contiguous_cache(lengths, slots, kv_heads, dim, 320, torch.float32)
            q = query(len(lengths), heads, dim, torch.float32, seed=heads)
            table = torch.tensor(slots, dtype=torch.int32).unsqueeze(1)
            args = (q, k, v, torch.tensor(slots), torch.tensor(lengths, dtype=torch.int32), dim**-0.5, dim)
            got = cpu_decode.decode_attention_eager(q, k, v, table, args[4], "rows", dim**-0.5, dim)
            torch.testing.assert_close(got, contiguous_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)
        k, _ = contiguous_cache(lengths, slots, 1, 99, 320, torch.float32, latent=True)
        q = query(len(lengths), 7, 99, torch.float32, seed=7)
        args = (q, k, None, torch.tensor(slots), torch.tensor(lengths, dtype=torch.int32), 0.1, 37)
        got = cpu_decode.decode_attention_eager(q, k, None, torch.tensor(slots, dtype=torch.int32).unsqueeze(1),
                                                args[4], "rows", 0.1, 37)
        torch.testing.assert_close(got, contiguous_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_decode._library.cache_clear()


def test_dispatch_picks_the_cpu_kernel_only_on_cpu(monkeypatch):
    x = torch.zeros(2)
    assert use_cpu_kernel(x)
    assert not use_cpu_kernel(torch.zeros(2, device="meta"))
    monkeypatch.setenv("ARCHZOO_FORCE_TRITON", "1")  # the interpreter tests force Triton on CPU tensors
    assert not use_cpu_kernel(x)


def test_compiled_call_has_no_graph_break(paged_cache):
    """A custom op: torch.compile(fullgraph=True) traces through it, and the compiled call equals eager."""
    cache = paged_cache(SEQ_LENS, 16, 2, 32, 32, torch.float32, "cpu")
    q = query(len(SEQ_LENS), 4, 32, torch.float32)
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, 0.2)
    compiled = torch.compile(paged_decode_attention, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(*args), paged_decode_attention(*args), atol=0, rtol=0)


def test_bad_layout_is_refused():
    q = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="unknown cache layout 'columns'"):
        decode_attention(q, torch.zeros(1, 2, 4, 8), None, torch.zeros(1, 1, dtype=torch.int32),
                         torch.ones(1, dtype=torch.int32), "columns", 1.0, 8)


def test_int64_lengths_and_a_sliced_table(paged_cache):
    """Index tensors in other integer types or strides are read as the values they hold."""
    cache = paged_cache(SEQ_LENS, 16, 2, 32, 32, torch.float32, "cpu")
    q = query(len(SEQ_LENS), 4, 32, torch.float32)
    wide = torch.cat([cache.block_table, torch.full_like(cache.block_table, -1)], dim=1)[:, ::2]  # strided view
    wide[:, : cache.block_table.shape[1]] = cache.block_table
    args = (q, cache.k_pool, cache.v_pool)
    actual = decode_attention(*args, wide.long(), cache.seq_lens.long(), "blocks", 0.2, 32)
    expected = paged_decode_attention_ref(*args, cache.block_table, cache.seq_lens, 0.2)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_loading_the_kernels_keeps_subnormal_floats():
    """The library must not switch the process to flush-to-zero (GCC < 13 links crtfastmath.o under -ffast-math):
    afterwards 5e-324 would read as 0.0 everywhere, and a valid top_p=5e-324 would be refused."""
    import subprocess
    import sys

    script = ("from kernels.cpu_decode import _library; import sys; tiny = 5e-324; "
              "assert tiny * 1.0 > 0; assert _library() is not None; sys.exit(0 if tiny * 1.0 > 0 else 3)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"after loading the CPU kernels 5e-324 * 1.0 == 0.0: {result.stderr[-500:]}"


@pytest.mark.parametrize("compiler_script", ["exit 1", 'case "$1" in --version) echo fake-cc 1.0;; *) echo "x.c:1: error: no" >&2; exit 1;; esac'],
                         ids=["no compiler", "build fails"])
def test_a_missing_build_is_said_aloud(tmp_path, monkeypatch, compiler_script):
    """Without the kernels every CPU step runs the references, many times slower: that must not pass unnoticed."""
    from kernels import cpu_decode

    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\n{compiler_script}\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="references instead"):
        assert cpu_decode._library.__wrapped__() is None


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("rows", [16, 400], ids=["ring", "unrolled"])
def test_contiguous_strided_span_matches_the_float64_loop(dtype, rows):
    """A dilated window (6 keys, every 3rd: a span of 16) in a contiguous cache: a ring of 16 rows holding position p
    in row p % 16, or rows as long as the sequence; never-written rows hold NaN."""
    retention, kv_heads, dim = Retention(window=6, dilation=3), 2, 32
    lengths, slots = [5, 300, 16, 17], [2, 0, 3, 1]
    g = torch.Generator().manual_seed(rows)
    keys = [torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64) for n in lengths]
    values = [torch.randn(n, kv_heads, dim, generator=g, dtype=torch.float64) for n in lengths]
    k = torch.full((4, kv_heads, rows, dim), float("nan"), dtype=torch.float64)
    v = k.clone()
    for slot, n, sk, sv in zip(slots, lengths, keys, values):
        for p in range(max(0, n - retention.span), n):  # what the engine's ring still holds
            k[slot, :, p % rows], v[slot, :, p % rows] = sk[p], sv[p]
    q = query(len(lengths), 4, dim, torch.float64, seed=5)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(slots), seq_lens, dim**-0.5, dim)
    span = dict(starts=retention.span_starts(seq_lens), stride=3)
    actual = contiguous_decode_attention(*args, **span)
    torch.testing.assert_close(actual, contiguous_decode_attention_ref(*args, **span), **TOLERANCE[dtype])
    for b, n in enumerate(lengths):  # the float64 loop over the positions the query sees
        seen = [p for p in range(n) if (n - 1 - p) % 3 == 0 and (n - 1 - p) // 3 < 6]
        for h in range(4):
            kv = h // 2
            scores = torch.stack([q[b, h] @ keys[b][p, kv] for p in seen]) * dim**-0.5
            expected = torch.softmax(scores, 0) @ torch.stack([values[b][p, kv] for p in seen])
            torch.testing.assert_close(actual[b, h].double(), expected, **TOLERANCE[dtype])
