"""The int8 / int4 Triton kernels equal their references under the interpreter (fp32 and fp16 compute): the
dequantizing GEMV against dequantize-then-multiply, and the paged decode attention over an int8 pool against the
reference on the dequantized pool."""
import pytest
import torch

from cache.quantized_rows import quantize_rows
from kernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from kernels.quantized_matmul import int4_matmul_ref, int8_matmul_ref, quantized_gemv_triton
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_int8_paged_decode_equals_the_reference(force_triton, paged_cache, heads, dtype):
    cache = paged_cache([1, 19, 70, 33], 16, heads[1], 32, 32, torch.float32, "cpu", head_major=True)
    k_values, k_scales = quantize_rows(cache.k_pool.nan_to_num())  # the pool's unused NaN slots are never read
    v_values, v_scales = quantize_rows(cache.v_pool.nan_to_num())
    q = torch.randn(4, heads[0], 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (q, k_values, v_values, cache.block_table, cache.seq_lens, 32 ** -0.5)
    want = paged_decode_attention_ref(*args, k_scales=k_scales, v_scales=v_scales)
    dequantized = paged_decode_attention_ref(q.float(), k_values * k_scales, v_values * v_scales, *args[3:])
    torch.testing.assert_close(want.float(), dequantized, **TOLERANCE[dtype])
    got = paged_decode_attention_triton(*args, k_scales=k_scales.to(dtype), v_scales=v_scales.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
