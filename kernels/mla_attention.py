"""MLA decode attention, weights absorbed, over a paged latent cache: one new query token per sequence.

Layout: q [B, H, W]; latent_pool [num_blocks, block_size, W], one row per token, W = kv_lora_rank +
qk_rope_head_dim (DeepSeek-V2/V3: 512 + 64); block_table [B, max_blocks] (-1 = unused entry);
seq_lens [B]. Every query head attends to the same rows (MQA with one group of all H heads):
score = q . row * scale, value = row[:value_dim], the latent itself. Output [B, H, value_dim] in q's
dtype, softmax computed in fp32.

The generic paged kernel could run this over two views of the pool, but would load each row twice,
once as key and once as value. The Triton kernel here loads a row once and uses it as both, so decode
reads only the latent. Split-K like paged_attention: stage 1 gives each (head tile, split, sequence)
program a slice of the sequence with an online softmax, stage 2 merges the slices by log-sum-exp.

A one-byte pool (the engine's kv_dtype "int8" or "fp8") comes with latent_scales [num_blocks, block_size, 1], one
scale per row, or [num_blocks, block_size, 2], one for the latent (the first value_dim columns) and one for the
rest (cache/quantized_rows.py): the kernel folds the scales into the score's two dot products and the latent's
into its probability, as paged_attention does, so no row is dequantized.
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch

from . import cpu_decode, paged_attention
from .dispatch import jit_kernels, use_cpu_kernel, use_triton
from .paged_attention import _default_num_splits, _tile_shape
from .row_scales import spread_scales
from .tiles import cdiv, padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

# 16 is tl.dot's smallest M; at W = 576 a larger tile would hold [heads, 512] fp32 accumulators
# beyond the register file, so 128 heads run as 8 programs that share each row through L2
_HEADS_PER_PROGRAM = 16


def _check_args(q, latent_pool, block_table, seq_lens, value_dim) -> None:
    if q.dim() != 3 or latent_pool.dim() != 3:
        raise ValueError(f"expected q [B, H, W] and latent_pool [num_blocks, block_size, W], "
                         f"got {tuple(q.shape)} and {tuple(latent_pool.shape)}")
    if q.shape[2] != latent_pool.shape[2]:
        raise ValueError(f"query width {q.shape[2]} != latent row width {latent_pool.shape[2]}")
    if not 1 <= value_dim <= q.shape[2]:
        raise ValueError(f"value_dim {value_dim} must lie in 1..{q.shape[2]} (the latent row width)")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError(f"expected block_table [B, max_blocks] and seq_lens [B] for B = {q.shape[0]}, "
                         f"got {tuple(block_table.shape)} and {tuple(seq_lens.shape)}")


def mla_decode_attention_ref(q, latent_pool, block_table, seq_lens, scale: float, value_dim: int,
                             latent_scales=None) -> torch.Tensor:
    _check_args(q, latent_pool, block_table, seq_lens, value_dim)
    block_size = latent_pool.shape[1]
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=q.device)
    valid = positions < seq_lens[:, None]  # [B, L]
    pages = block_table[:, positions // block_size].long()
    # invalid positions may map to unused table entries (-1): point them at slot 0, masked below
    slots = torch.where(valid, pages * block_size + positions % block_size, 0)
    # zero the masked rows: a never-written slot of a torch.empty pool may hold NaN
    rows = latent_pool.flatten(0, 1)[slots].float()  # [B, L, W]
    if latent_scales is not None:  # one-byte rows times their scales
        rows = rows * spread_scales(latent_scales.flatten(0, 1)[slots].float(), value_dim, rows.shape[-1])
    rows = rows.masked_fill(~valid[:, :, None], 0.0)
    scores = torch.einsum("bhw,blw->bhl", q.float(), rows) * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhl,blv->bhv", probs, rows[..., :value_dim]).to(q.dtype)


def _split_kernel(
    q_ptr, latent_pool_ptr, scales_ptr, block_table_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    scale, split_len,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_pool_block, stride_pool_pos, stride_pool_dim,
    stride_scales_block, stride_scales_pos, stride_scales_part,
    stride_table_seq, stride_table_entry,
    NUM_HEADS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    VALUE_DIM: tl.constexpr, VALUE_PAD: tl.constexpr, REST_DIM: tl.constexpr, REST_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS_PER_STEP: tl.constexpr, QUANTIZED: tl.constexpr, REST_SCALED: tl.constexpr,
):
    head_tile = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    heads = head_tile * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_ok = heads < NUM_HEADS
    # a row is [value part ; rest] (rest = the rope key), each padded to a power of two on its own:
    # 512 + 64 needs no padding, where 576 as one piece would pad to 1024
    dims_v = tl.arange(0, VALUE_PAD)
    dims_r = VALUE_DIM + tl.arange(0, REST_PAD)
    dim_v_ok = dims_v < VALUE_DIM
    dim_r_ok = dims_r < VALUE_DIM + REST_DIM

    # one-byte rows are multiplied in the scales' dtype (exact: int8 and e4m3 fit fp16 / bf16); float pools in their own
    compute_dtype = scales_ptr.dtype.element_ty if QUANTIZED else latent_pool_ptr.dtype.element_ty
    q_rows = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q_value = tl.load(q_rows + dims_v[None, :] * stride_q_dim, mask=head_ok[:, None] & dim_v_ok[None, :],
                      other=0.0).to(compute_dtype)
    q_rest = tl.load(q_rows + dims_r[None, :] * stride_q_dim, mask=head_ok[:, None] & dim_r_ok[None, :],
                     other=0.0).to(compute_dtype)

    running_max = tl.full([HEADS_PER_PROGRAM], float("-inf"), tl.float32)
    running_sum = tl.zeros([HEADS_PER_PROGRAM], tl.float32)
    acc = tl.zeros([HEADS_PER_PROGRAM, VALUE_PAD], tl.float32)
    for step_start in range(split_start, split_end, KEYS_PER_STEP):
        positions = step_start + tl.arange(0, KEYS_PER_STEP)
        pos_ok = positions < split_end
        block = tl.load(
            block_table_ptr + seq * stride_table_seq + (positions // BLOCK_SIZE) * stride_table_entry,
            mask=pos_ok, other=0,
        ).to(tl.int64)  # int64: block * stride overflows int32 in large pools
        rows = latent_pool_ptr + block * stride_pool_block + (positions % BLOCK_SIZE) * stride_pool_pos
        latent = tl.load(rows[:, None] + dims_v[None, :] * stride_pool_dim,
                         mask=pos_ok[:, None] & dim_v_ok[None, :], other=0.0).to(compute_dtype)
        rope = tl.load(rows[:, None] + dims_r[None, :] * stride_pool_dim,
                       mask=pos_ok[:, None] & dim_r_ok[None, :], other=0.0).to(compute_dtype)
        # "ieee": fp32 inputs would otherwise be rounded to tf32; ignored for 16-bit inputs
        scores = tl.dot(q_value, tl.trans(latent), input_precision="ieee")
        rest_scores = tl.dot(q_rest, tl.trans(rope), input_precision="ieee")
        if QUANTIZED:  # q . (row * s) = (q . row) * s, for each part of the row with its own scale
            row_scales = scales_ptr + block * stride_scales_block + (positions % BLOCK_SIZE) * stride_scales_pos
            latent_scales = tl.load(row_scales, mask=pos_ok, other=0.0).to(tl.float32)
            scores = scores * latent_scales[None, :]
            if REST_SCALED:
                rest_scales = tl.load(row_scales + stride_scales_part, mask=pos_ok, other=0.0).to(tl.float32)
                rest_scores = rest_scores * rest_scales[None, :]
            else:
                rest_scores = rest_scores * latent_scales[None, :]
        scores += rest_scores
        scores = tl.where(pos_ok[None, :], scores * scale, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        # the value is the latent already loaded as the key: no second read; an int8 row's scale goes on its weight
        weights = probs
        if QUANTIZED:
            weights = probs * latent_scales[None, :]
        acc = acc * rescale[:, None] + tl.dot(weights.to(compute_dtype), latent, input_precision="ieee")
        running_max = new_max

    # a split past the end of a short sequence saw no keys: output 0 with weight exp(-inf) = 0
    has_keys = running_sum > 0.0
    safe_sum = tl.where(has_keys, running_sum, 1.0)
    partial_out = acc / safe_sum[:, None]
    partial_lse = tl.where(has_keys, running_max + tl.log(safe_sum), float("-inf"))
    partial_rows = (seq * NUM_HEADS + heads) * tl.num_programs(1) + split  # the layout the merge kernel reads
    tl.store(partial_lse_ptr + partial_rows, partial_lse, mask=head_ok)
    tl.store(partial_out_ptr + partial_rows[:, None] * VALUE_DIM + dims_v[None, :], partial_out,
             mask=head_ok[:, None] & dim_v_ok[None, :])


@functools.cache
def _jitted_kernels():
    # stage 2 is paged_attention's merge: the partials match it
    return jit_kernels(globals(), _split_kernel)[0], paged_attention._jitted_kernels()[1]


def mla_decode_attention_triton(
    q, latent_pool, block_table, seq_lens, scale: float, value_dim: int, num_splits: int | None = None,
    latent_scales=None,
) -> torch.Tensor:
    """latent_scales [num_blocks, block_size, 1 or 2]: a one-byte pool's row scales (None: a float pool)."""
    _check_args(q, latent_pool, block_table, seq_lens, value_dim)
    quantized = latent_scales is not None
    split_kernel, merge_kernel = _jitted_kernels()
    batch, num_heads, width = q.shape
    block_size = latent_pool.shape[1]
    head_tiles = cdiv(num_heads, _HEADS_PER_PROGRAM)
    # the table's capacity bounds the longest sequence without a device sync (as in paged_attention)
    max_len = block_table.shape[1] * block_size
    if num_splits is None:
        num_splits = _default_num_splits(max_len, batch * head_tiles, q.device)
    value_pad, rest_pad = padded(value_dim), padded(width - value_dim)
    compute_size = latent_scales.element_size() if quantized else latent_pool.element_size()
    keys_per_step, num_warps = _tile_shape(padded(value_pad + rest_pad), compute_size)
    split_len = cdiv(cdiv(max_len, num_splits), keys_per_step) * keys_per_step

    partial_out = torch.empty(batch, num_heads, num_splits, value_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_heads, value_dim, dtype=q.dtype, device=q.device)
    # head tiles vary fastest, so the programs reading the same rows run side by side and hit L2
    split_kernel[(head_tiles, num_splits, batch)](
        q, latent_pool, latent_scales if quantized else q, block_table, seq_lens, partial_out, partial_lse,  # q: unread
        scale, split_len,
        *q.stride(), *latent_pool.stride(), *(latent_scales.stride() if quantized else (0, 0, 0)),
        *block_table.stride(),
        NUM_HEADS=num_heads, HEADS_PER_PROGRAM=_HEADS_PER_PROGRAM,
        VALUE_DIM=value_dim, VALUE_PAD=value_pad, REST_DIM=width - value_dim, REST_PAD=rest_pad,
        BLOCK_SIZE=block_size, KEYS_PER_STEP=keys_per_step, QUANTIZED=quantized,
        REST_SCALED=quantized and latent_scales.shape[-1] == 2, num_warps=num_warps,
    )
    merge_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, *out.stride(),
        NUM_SPLITS=num_splits, NUM_SPLITS_PAD=padded(num_splits, minimum=1),
        DIM_V=value_dim, DIM_V_PAD=value_pad,
    )
    return out


def mla_decode_attention(q, latent_pool, block_table, seq_lens, scale: float, value_dim: int,
                         latent_scales=None) -> torch.Tensor:
    """latent_scales [num_blocks, block_size, 1 or 2]: a one-byte pool's row scales (None: a float pool)."""
    if use_triton(q, latent_pool, block_table, seq_lens):
        return mla_decode_attention_triton(q, latent_pool, block_table, seq_lens, scale, value_dim,
                                           latent_scales=latent_scales)
    scales = None if latent_scales is None else latent_scales.unsqueeze(2)
    if use_cpu_kernel(q, latent_pool) and cpu_decode.fits(q, latent_pool, 1, value_dim, scales):
        return cpu_decode.mla_decode_attention_cpu(q, latent_pool, block_table, seq_lens, scale, value_dim, scales)
    return mla_decode_attention_ref(q, latent_pool, block_table, seq_lens, scale, value_dim, latent_scales)
