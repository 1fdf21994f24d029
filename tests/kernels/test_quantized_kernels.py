"""The int8 / int4 Triton kernels equal their references under the interpreter (fp32 and fp16 compute): the
dequantizing GEMV against dequantize-then-multiply, and the paged and MLA decode attentions over int8 pools against the references on the
dequantized pools."""
import pytest
import torch

from cache.quantized_rows import quantize_rows
from kernels.mla_attention import mla_decode_attention_ref, mla_decode_attention_triton
from kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from kernels.quantized_matmul import int4_matmul_ref, int8_matmul_ref, quantized_gemv_triton
from kernels.row_scales import spread_scales
from zoo.quantize import quantize_int4, quantize_int8

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("scheme,group", [("int8", 0), ("int4", 32), ("int4", 64)])
def test_dequantizing_gemv_equals_the_reference(force_triton, scheme, group, rows, dtype):
    generator = torch.Generator().manual_seed(rows + group)
    weight = torch.randn(100, 128, generator=generator)  # 100 channels: a partial last tile of 64
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    if scheme == "int8":
        q, scales = quantize_int8(weight)
        want = int8_matmul_ref(x.float(), q, scales)
        got = quantized_gemv_triton(x, q, scales.to(dtype), None)
    else:
        q, scales, zeros = quantize_int4(weight, group)
        want = int4_matmul_ref(x.float(), q, scales, zeros, group)
        got = quantized_gemv_triton(x, q, scales.to(dtype), zeros.to(dtype), group)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_one_byte_paged_decode_equals_the_reference(force_triton, paged_cache, heads, dtype, kv_format):
    cache = paged_cache([1, 19, 70, 33], 16, heads[1], 32, 32, torch.float32, "cpu", head_major=True)
    # the pool's unused NaN slots are never read
    k_values, k_scales = quantize_rows(cache.k_pool.nan_to_num(), kv_format)
    v_values, v_scales = quantize_rows(cache.v_pool.nan_to_num(), kv_format)
    q = torch.randn(4, heads[0], 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (q, k_values, v_values, cache.block_table, cache.seq_lens, 32 ** -0.5)
    want = paged_decode_attention_ref(*args, k_scales=k_scales, v_scales=v_scales)
    dequantized = paged_decode_attention_ref(q.float(), k_values.float() * k_scales, v_values.float() * v_scales,
                                             *args[3:])
    torch.testing.assert_close(want.float(), dequantized, **TOLERANCE[dtype])
    got = paged_decode_attention_triton(*args, k_scales=k_scales.to(dtype), v_scales=v_scales.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("split", [None, 32])
@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_byte_mla_decode_equals_the_reference(force_triton, paged_cache, dtype, kv_format, split):
    """An int8 or fp8 latent pool: 48-wide rows of which the first 32 are the value, with one scale per row or (split
    32, the engine's latent rows) one for the value columns and one for the other 16, which here are 8x larger. Rows
    no sequence owns get NaN scales, so a kernel that reads one shows it."""
    cache = paged_cache([1, 19, 70, 33], 16, 1, 48, 48, torch.float32, "cpu")
    rows = cache.k_pool[:, :, 0] * torch.cat([torch.ones(32), torch.full((16,), 8.0)])  # [blocks, block_size, 48]
    latent, latent_scales = quantize_rows(rows.nan_to_num(), kv_format, split)
    latent_scales[rows.isnan().any(-1)] = float("nan")
    q = torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = (q, latent, cache.block_table, cache.seq_lens, 0.2, 32)
    want = mla_decode_attention_ref(*args, latent_scales=latent_scales)
    dequantized = mla_decode_attention_ref(q.float(), latent.float() * spread_scales(latent_scales, split, 48),
                                           *args[2:])
    torch.testing.assert_close(want.float(), dequantized, **TOLERANCE[dtype])
    got = mla_decode_attention_triton(*args, latent_scales=latent_scales.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_reads_one_byte_caches_in_every_layout(paged_cache, dtype, kv_format):
    """The compiled CPU decode kernel on int8 or fp8 rows and their scales: paged (GQA and an MLA latent) and contiguous,
    against the references on the same rows."""
    from kernels import cpu_decode, cpu_kernels_available
    from kernels.contiguous_attention import contiguous_decode_attention, contiguous_decode_attention_ref
    from kernels.mla_attention import mla_decode_attention, mla_decode_attention_ref
    if not cpu_kernels_available():
        pytest.skip("no C compiler: the CPU kernels did not build")
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    cache = paged_cache([1, 19, 70, 33], 16, 2, 32, 32, torch.float32, "cpu", head_major=True)
    k, ks = quantize_rows(cache.k_pool.nan_to_num(), kv_format)
    v, vs = quantize_rows(cache.v_pool.nan_to_num(), kv_format)
    ks, vs = ks.to(dtype), vs.to(dtype)
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = (q, k, v, cache.block_table, cache.seq_lens, 32 ** -0.5)
    assert cpu_decode.fits(q, k, 2, 32, ks)
    torch.testing.assert_close(cpu_decode.paged_decode_attention_cpu(*args, k_scales=ks, v_scales=vs).float(),
                               paged_decode_attention_ref(*args, k_scales=ks, v_scales=vs).float(), **tolerance)
    latent, latent_scales = k[:, :, 0], ks[:, :, 0]  # one latent row per token: KV head 0's keys
    mla_args = (q, latent, cache.block_table, cache.seq_lens, 0.1, 16)
    torch.testing.assert_close(mla_decode_attention(*mla_args, latent_scales).float(),
                               mla_decode_attention_ref(*mla_args, latent_scales).float(), **tolerance)
    # the engine's latent rows: a scale for the 16 value columns and one for the rest
    latent, latent_scales = quantize_rows(cache.k_pool[:, :, 0].nan_to_num(), kv_format, split=16)
    latent_scales = latent_scales.to(dtype)
    torch.testing.assert_close(mla_decode_attention(*mla_args[:1], latent, *mla_args[2:], latent_scales).float(),
                               mla_decode_attention_ref(*mla_args[:1], latent, *mla_args[2:], latent_scales).float(),
                               **tolerance)
    rows, row_scales = quantize_rows(torch.randn(3, 2, 40, 32, generator=torch.Generator().manual_seed(3)), kv_format)
    row_scales = row_scales.to(dtype)
    slots, lengths = torch.tensor([2, 0]), torch.tensor([40, 7], dtype=torch.int32)
    want = contiguous_decode_attention_ref(q[:2], rows.to(dtype) * row_scales, rows.to(dtype) * row_scales, slots,
                                           lengths, 0.2, 32)
    got = contiguous_decode_attention(q[:2], rows, rows, slots, lengths, 0.2, 32, k_scales=row_scales,
                                      v_scales=row_scales)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)
    rows, row_scales = quantize_rows(torch.randn(3, 1, 40, 32, generator=torch.Generator().manual_seed(6)), kv_format,
                                     split=24)  # a contiguous latent cache: 24 value columns, then 8
    row_scales = row_scales.to(dtype)
    dequantized = rows.to(dtype) * spread_scales(row_scales, 24, 32)
    want = contiguous_decode_attention_ref(q[:2], dequantized, None, slots, lengths, 0.2, 24)
    got = contiguous_decode_attention(q[:2], rows, None, slots, lengths, 0.2, 24, k_scales=row_scales)
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_cpu_kernel_reads_every_fp8_value():
    """One cached token: attention returns its value row exactly, so a row holding every float8 e4m3 bit pattern
    (subnormals, both zeros, the largest, negatives; not the NaN pattern, which quantized rows never hold) must come
    back as torch converts it."""
    from kernels import cpu_decode, cpu_kernels_available
    if not cpu_kernels_available():
        pytest.skip("no C compiler: the CPU kernels did not build")
    patterns = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)  # 256 wide
    values = patterns.view(torch.float8_e4m3fn).reshape(1, 1, 1, 256)
    keys = torch.zeros(1, 1, 1, 256, dtype=torch.float8_e4m3fn)
    scales = torch.ones(1, 1, 1, 1)
    q = torch.randn(1, 2, 256)
    got = cpu_decode.contiguous_decode_attention_cpu(q, keys, values, torch.tensor([0]), torch.tensor([1]), 0.1, 256,
                                                     k_scales=scales, v_scales=scales)
    assert torch.equal(got, values.float().reshape(1, 1, 256).expand(1, 2, 256))
