"""Every Triton kernel against its PyTorch reference on the device, in fp32, fp16 and bf16, on the kernel suites'
inputs (tests/kernels: their builders, shapes and fp32 / fp16 tolerances): paged decode attention over GQA groups,
windows and sinks, MLA decode, the paged KV write, Mamba-1 and Mamba-2 state updates, the linear-attention step and
chunked prefill, the gated delta, retention and RWKV-7 steps, the MoE grouped matmul, the dequantizing GEMV and
one-byte KV decode. The suites' own bf16 tests at model-sized shapes, which skip without CUDA, are collected here
too."""
import pytest
import torch

import test_gated_delta as gated_delta_suite
import test_linear_attention_kernels as linear_suite
import test_mla_attention as mla_suite
import test_paged_attention as paged_suite
import test_paged_write as write_suite
import test_grouped_matmul as grouped_suite
import test_quantized_kernels as quantized_suite
import test_retention_decay as retention_suite
import test_rwkv7_kernels as rwkv7_suite
import test_selective_state_update as ssu_suite
from cache import Retention
from cache.quantized_rows import quantize_rows
from kernels import (
    linear_attention_chunked_ref, linear_attention_chunked_triton, linear_attention_step_ref,
    linear_attention_step_triton, mla_decode_attention_ref, mla_decode_attention_triton, paged_decode_attention_ref,
    paged_decode_attention_triton, selective_state_update_ref, selective_state_update_triton, write_paged_kv_ref,
    write_paged_kv_triton,
)
from kernels.gated_delta import gated_delta_step_ref, gated_delta_step_triton
from kernels.grouped_matmul import grouped_matmul_ref, grouped_matmul_triton
from kernels.quantized_matmul import int4_dequantize, int8_matmul_ref, quantized_gemv_triton
from kernels.retention_decay import retention_decay_step_ref, retention_decay_step_triton
from kernels.rwkv7 import rwkv7_step_ref, rwkv7_step_triton
from spans import visible_span
from ssm.gated_deltanet import l2_normalize
from zoo.quantize import quantize_int4, quantize_int8

# The suites' model-sized bf16 tests (head_dim 128 over 4097 keys, DeepSeek-V3's latent, Mamba-2 2.7B heads, ...)
from test_gated_delta import test_triton_step_bf16_on_gpu as test_gated_delta_bf16_model_shapes  # noqa: F401
from test_linear_attention_kernels import (  # noqa: F401
    test_triton_bf16_on_gpu as test_linear_attention_bf16_model_shapes,
)
from test_mla_attention import test_triton_bf16_on_gpu as test_mla_bf16_model_shapes  # noqa: F401
from test_paged_attention import test_triton_bf16_on_gpu as test_paged_attention_bf16_model_shapes  # noqa: F401
from test_retention_decay import (  # noqa: F401
    test_triton_step_bf16_on_gpu as test_retention_decay_bf16_model_shapes,
)
from test_rwkv7_kernels import test_triton_step_bf16_on_gpu as test_rwkv7_bf16_model_shapes  # noqa: F401
from test_selective_state_update import test_triton_bf16_on_gpu as test_ssu_bf16_model_shapes  # noqa: F401

# bf16 keeps 8 mantissa bits: O(1) outputs rounded once are 2^-8 apart; the suites' bf16 GPU tests allow this too
BF16 = dict(atol=2e-2, rtol=2e-2)
# (head layout, retention) pairs: every GQA group shape unbounded, the bounded policies on a grouped layout
ATTENTION_CASES = {"mha": ("mha", None), "gqa": ("gqa", None), "mqa": ("mqa", None),
                   "gqa-window": ("gqa", Retention(window=40)), "gqa-sinks": ("gqa", Retention(sinks=4, window=20)),
                   "mqa-window": ("mqa", Retention(window=16)),
                   "gqa-dilated": ("gqa", Retention(window=12, dilation=3))}


def tolerance(suite, dtype: torch.dtype) -> dict:
    """A kernel suite's fp32 / fp16 tolerance; bf16's is one for all."""
    return BF16 if dtype == torch.bfloat16 else suite.TOLERANCE[dtype]


@pytest.mark.parametrize("case", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_paged_decode_attention(device, paged_cache, kernel_dtype, case):
    layout, retention = case
    num_heads, num_kv_heads = paged_suite.HEAD_LAYOUTS[layout]
    seq_lens = paged_suite.SEQ_LENS
    cache = paged_cache(seq_lens, 16, num_kv_heads, 32, 32, kernel_dtype, device, retention=retention,
                        head_major=True)
    q = paged_suite.make_query(len(seq_lens), num_heads, 32, kernel_dtype, device)
    args = (q, cache.k_pool, cache.v_pool, cache.block_table, cache.seq_lens, 32**-0.5)
    span = visible_span(retention, cache.seq_lens)
    torch.testing.assert_close(paged_decode_attention_triton(*args, **span), paged_decode_attention_ref(*args, **span),
                               **tolerance(paged_suite, kernel_dtype))


@pytest.mark.parametrize("num_heads", [5, 16])
def test_mla_decode_attention(device, paged_cache, kernel_dtype, num_heads):
    width, value_dim = mla_suite.WIDTHS["w80"]  # both parts of the row padded inside the kernel
    latent_pool, block_table, seq_lens = mla_suite.latent_cache(paged_cache, mla_suite.SEQ_LENS, 16, width,
                                                                kernel_dtype, device)
    q = mla_suite.make_query(len(mla_suite.SEQ_LENS), num_heads, width, kernel_dtype, device)
    args = (q, latent_pool, block_table, seq_lens, width**-0.5, value_dim)
    torch.testing.assert_close(mla_decode_attention_triton(*args), mla_decode_attention_ref(*args),
                               **tolerance(mla_suite, kernel_dtype))


@pytest.mark.parametrize("head_major", [False, True], ids=["position-major", "head-major"])
def test_paged_kv_write(device, kernel_dtype, head_major):
    k, v = write_suite.make_tokens(24, 20, kernel_dtype, device)
    slot_mapping = torch.tensor(write_suite.SLOTS, device=device)
    expected_k, expected_v = write_suite.make_pools(24, 20, kernel_dtype, device)
    write_paged_kv_ref(k, v, expected_k, expected_v, slot_mapping)
    k_pool, v_pool = write_suite.make_pools(24, 20, kernel_dtype, device, head_major)
    write_paged_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)  # a copy: exact in every dtype


@pytest.mark.parametrize("layout", ["mamba1", "mamba2_g2"])
def test_selective_state_update(device, kernel_dtype, layout):
    shape = ssu_suite.LAYOUTS[layout]
    inputs = ssu_suite.make_inputs(shape, kernel_dtype, device, **ssu_suite.OPTIONS["all"])
    state, ref_state = (ssu_suite.make_state(shape, kernel_dtype, device) for _ in range(2))
    y = selective_state_update_triton(state, **inputs)
    ref_y = selective_state_update_ref(ref_state, **inputs)
    torch.testing.assert_close(y, ref_y, **tolerance(ssu_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **tolerance(ssu_suite, kernel_dtype))


def test_linear_attention_step(device, kernel_dtype):
    """Five tokens through the step on every other row of an fp32 state pool, as the engine hands it."""
    q, k, v = linear_suite.make_sequence(3, 2, 5, 80, 72, kernel_dtype, device, seed=5)
    state_pool, normalizer_pool = linear_suite.make_initial(6, 2, 80, 72, torch.float32, device)
    state, normalizer = state_pool[1::2], normalizer_pool[1::2]
    ref_state, ref_normalizer = state.clone(), normalizer.clone()
    out = linear_suite.steps(linear_attention_step_triton, q, k, v, state, normalizer)
    ref_out = linear_suite.steps(linear_attention_step_ref, q, k, v, ref_state, ref_normalizer)
    torch.testing.assert_close(out, ref_out, **tolerance(linear_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **linear_suite.STATE_TOLERANCE)
    torch.testing.assert_close(normalizer, ref_normalizer, **linear_suite.STATE_TOLERANCE)


def test_linear_attention_chunked(device, kernel_dtype):
    """100 tokens over chunks of 64 from an fp32 initial state: a ragged last chunk."""
    q, k, v = linear_suite.make_sequence(2, 2, 100, 12, 20, kernel_dtype, device)
    initial = linear_suite.make_initial(2, 2, 12, 20, torch.float32, device)
    out, state, normalizer = linear_attention_chunked_triton(q, k, v, *initial, chunk_size=64)
    ref_out, ref_state, ref_normalizer = linear_attention_chunked_ref(q, k, v, *initial, chunk_size=64)
    torch.testing.assert_close(out, ref_out, **tolerance(linear_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **linear_suite.STATE_TOLERANCE)
    torch.testing.assert_close(normalizer, ref_normalizer, **linear_suite.STATE_TOLERANCE)


def test_gated_delta_step(device, kernel_dtype):
    """Four tokens, dk 128 and dv 72 (several value tiles), on every other row of an fp32 state pool."""
    q, k, v, g, beta = gated_delta_suite.make_inputs(3, 2, 4, 128, 72, kernel_dtype, device, seed=5)
    q, k = l2_normalize(q.float()).to(kernel_dtype), l2_normalize(k.float()).to(kernel_dtype)
    pool = gated_delta_suite.make_state(6, 2, 128, 72, device=device)
    state = pool[1::2]
    ref_state = state.clone()
    out = gated_delta_suite.steps(gated_delta_step_triton, q, k, v, g, beta, state)
    ref_out = gated_delta_suite.steps(gated_delta_step_ref, q, k, v, g, beta, ref_state)
    torch.testing.assert_close(out, ref_out, **tolerance(gated_delta_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **gated_delta_suite.STATE_TOLERANCE)


def test_retention_decay_step(device, kernel_dtype):
    """Four tokens, dk 128 and dv 72 (several value tiles), on every other row of an fp32 state pool."""
    q, k, v, g = retention_suite.make_inputs(3, 2, 4, 128, 72, kernel_dtype, device, seed=5)
    pool = retention_suite.make_state(6, 2, 128, 72, device=device)
    state = pool[1::2]
    ref_state = state.clone()
    out = retention_suite.steps(retention_decay_step_triton, q, k, v, g, state)
    ref_out = retention_suite.steps(retention_decay_step_ref, q, k, v, g, ref_state)
    torch.testing.assert_close(out, ref_out, **tolerance(retention_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **retention_suite.STATE_TOLERANCE)


def test_rwkv7_step(device, kernel_dtype):
    """Four tokens, dk 128 and dv 72 (several value tiles), on every other row of an fp32 state pool."""
    inputs = rwkv7_suite.make_inputs(3, 2, 4, 128, 72, kernel_dtype, device, seed=5)
    pool = rwkv7_suite.make_state(6, 2, 128, 72, device=device)
    state = pool[1::2]
    ref_state = state.clone()
    out = rwkv7_suite.steps(rwkv7_step_triton, *inputs, state)
    ref_out = rwkv7_suite.steps(rwkv7_step_ref, *inputs, ref_state)
    torch.testing.assert_close(out, ref_out, **tolerance(rwkv7_suite, kernel_dtype))
    torch.testing.assert_close(state, ref_state, **rwkv7_suite.STATE_TOLERANCE)


@pytest.mark.parametrize("tokens", [1, 40])
def test_moe_grouped_matmul(device, kernel_dtype, tokens):
    """A decode-sized and a prefill-sized batch routed top 2 of 8 experts, skewed so some experts are empty."""
    experts, source = grouped_suite.routed(tokens, 8, 2, seed=tokens, skew=True)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).to(device, kernel_dtype)
    weight = (torch.randn(8, 320, 256, generator=g) / 16).to(device, kernel_dtype)
    experts, source = experts.to(device), source.to(device)
    torch.testing.assert_close(grouped_matmul_triton(x, weight, experts, source),
                               grouped_matmul_ref(x, weight, experts, source), **tolerance(grouped_suite, kernel_dtype))


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("scheme, group", [("int8", 0), ("int4", 64)], ids=["int8", "int4"])
def test_dequantizing_gemv(device, kernel_dtype, scheme, group, rows):
    generator = torch.Generator().manual_seed(rows + group)
    weight = torch.randn(100, 128, generator=generator)  # 100 output channels: a partial last tile
    x = torch.randn(rows, 128, generator=generator).to(device, kernel_dtype)
    # The reference does in fp32 what the kernel does: it is given the scales and zeros rounded to the activations'
    # dtype, and an int4 weight is dequantized in fp32 and rounded to that dtype once before its product (tl.dot).
    # In bf16 either rounding alone moves outputs by up to 0.08, past the tolerance (as the H100 runs showed).
    if scheme == "int8":
        q, scales = (t.to(device) for t in quantize_int8(weight))
        scales, zeros = scales.to(kernel_dtype), None
        want = int8_matmul_ref(x.float(), q, scales.float())
    else:
        q, scales, zeros = (t.to(device) for t in quantize_int4(weight, group))
        scales, zeros = scales.to(kernel_dtype), zeros.to(kernel_dtype)
        dequantized = int4_dequantize(q, scales.float(), zeros.float(), group, torch.float32)
        want = torch.nn.functional.linear(x.float(), dequantized.to(kernel_dtype).float())
    got = quantized_gemv_triton(x, q, scales, zeros, group)
    torch.testing.assert_close(got.float(), want, **tolerance(quantized_suite, kernel_dtype))


def skip_fp8_before_sm89(kv_format: str, device: torch.device) -> None:
    if kv_format == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("float8 e4m3 needs sm_89 or later (the engine refuses fp8 there too)")


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_one_byte_paged_decode_attention(device, paged_cache, kernel_dtype, kv_format):
    skip_fp8_before_sm89(kv_format, device)
    cache = paged_cache([1, 19, 70, 33], 16, 2, 32, 32, torch.float32, "cpu", head_major=True)
    k_values, k_scales = quantize_rows(cache.k_pool.nan_to_num(), kv_format)  # unowned NaN slots are never read
    v_values, v_scales = quantize_rows(cache.v_pool.nan_to_num(), kv_format)
    q = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1)).to(device, kernel_dtype)
    args = (q, k_values.to(device), v_values.to(device), cache.block_table.to(device), cache.seq_lens.to(device),
            32**-0.5)
    scales = dict(k_scales=k_scales.to(device, kernel_dtype), v_scales=v_scales.to(device, kernel_dtype))
    torch.testing.assert_close(paged_decode_attention_triton(*args, **scales).float(),
                               paged_decode_attention_ref(*args, **scales).float(),
                               **tolerance(quantized_suite, kernel_dtype))


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_one_byte_mla_decode_attention(device, paged_cache, kernel_dtype, kv_format):
    """The engine's latent rows: 32 value columns with a scale, and 16 rotary columns 8x larger with their own."""
    skip_fp8_before_sm89(kv_format, device)
    cache = paged_cache([1, 19, 70, 33], 16, 1, 48, 48, torch.float32, "cpu")
    rows = cache.k_pool[:, :, 0] * torch.cat([torch.ones(32), torch.full((16,), 8.0)])
    latent, latent_scales = quantize_rows(rows.nan_to_num(), kv_format, 32)
    q = torch.randn(4, 5, 48, generator=torch.Generator().manual_seed(4)).to(device, kernel_dtype)
    args = (q, latent.to(device), cache.block_table.to(device), cache.seq_lens.to(device), 0.2, 32)
    scales = latent_scales.to(device, kernel_dtype)
    torch.testing.assert_close(mla_decode_attention_triton(*args, latent_scales=scales).float(),
                               mla_decode_attention_ref(*args, latent_scales=scales).float(),
                               **tolerance(quantized_suite, kernel_dtype))
