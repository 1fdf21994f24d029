"""Decode attention over a paged KV cache: one new query token per sequence.

Layout: q [B, H, Dk]; k_pool [num_blocks, block_size, KVH, Dk]; v_pool [num_blocks, block_size,
KVH, Dv], any strides (the engine's pools are head-major views, see cache/layouts.py);
block_table [B, max_blocks] (entry j = pool block holding positions j*block_size ..);
seq_lens [B] (valid keys per sequence, the current token included). Query head h reads KV head
h // (H // KVH). Output [B, H, Dv] in q's dtype, softmax computed in fp32.

Which keys a query sees (the cache's retention policy, reduced to what a kernel needs): the first
`sinks` positions and the span from starts[b] to seq_lens[b] - 1, i.e. positions
[0, min(sinks, starts[b])) and [starts[b], seq_lens[b]); starts None = 0 (every key). A sliding
window W has starts = seq_len - W, attention sinks add sinks = S, chunked attention starts its span at
its chunk. stride r > 1 (a dilated window, no sinks) sees every r-th position of the span: starts[b],
starts[b] + r, ..., seq_lens[b] - 1 (starts on the newest query's stride). Keys outside are never
read: the engine returns blocks that leave the span to the pool and sets their table entries to -1.
max_keys bounds the keys any query sees (the policy's visible capacity; None: the block table's), which
sizes the Triton splits without a device sync.

One-byte pools (the engine's kv_dtype "int8" or "fp8", cache/quantized_rows.py): k_pool and v_pool hold int8 or
float8 e4m3 rows and k_scales, v_scales [num_blocks, block_size, KVH, 1] one scale per row; a key is k * k_scale. The
kernel folds the scales into the scores (q . k * k_scale) and the probabilities (p * v_scale before p . v), so no row
is dequantized.

The PyTorch reference is the CPU path and the oracle. The Triton kernel is split-K
"flash-decoding": stage 1 gives each (sequence, KV head, split) program the whole GQA group of
query heads and one slice of the sequence, walked through the block table with an online softmax;
stage 2 merges the slices' partial outputs by their log-sum-exp.
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch

from . import cpu_decode
from .dispatch import jit_kernels, use_cpu_kernel, use_triton
from .tiles import cdiv, padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 16
_PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep its memory pipe busy


def _check_args(q, k_pool, v_pool, block_table, seq_lens, starts, sinks, max_keys, stride: int = 1) -> None:
    if q.dim() != 3 or k_pool.dim() != 4 or v_pool.dim() != 4:
        raise ValueError("expected q [B, H, D] and pools [num_blocks, block_size, KVH, D]")
    if k_pool.shape[:3] != v_pool.shape[:3]:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ")
    num_heads, num_kv_heads = q.shape[1], k_pool.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} KV heads")
    if q.shape[2] != k_pool.shape[3]:
        raise ValueError(f"query dim {q.shape[2]} != key dim {k_pool.shape[3]}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or seq_lens.shape != (q.shape[0],):
        raise ValueError("expected block_table [B, max_blocks] and seq_lens [B]")
    if starts is not None and starts.shape != seq_lens.shape:
        raise ValueError(f"starts {tuple(starts.shape)} must be [B] like seq_lens {tuple(seq_lens.shape)}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0 positions, got {sinks}")
    if max_keys is not None and max_keys < 1:
        raise ValueError(f"max_keys must be at least 1 key, got {max_keys}")
    if stride < 1 or (stride > 1 and (starts is None or sinks)):
        raise ValueError(f"stride must be >= 1, and above 1 only with starts and no sinks; got stride={stride}, "
                         f"sinks={sinks}, starts {'given' if starts is not None else 'None'}")


def visible_positions(seq_lens, starts, sinks: int, stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, L] positions each sequence reads, [B, L] which of them are real): its sinks, then its span's every
    stride-th position."""
    lengths = seq_lens.long()
    starts = torch.zeros_like(lengths) if starts is None else starts.long()
    sink_count = starts.clamp(max=sinks)
    count = sink_count + torch.div(lengths - 1 - starts, stride, rounding_mode="floor") + 1
    index = torch.arange(int(count.max()), device=seq_lens.device)[None, :]
    positions = torch.where(index < sink_count[:, None], index,
                            (index - sink_count[:, None]) * stride + starts[:, None])
    return positions, index < count[:, None]


def paged_decode_attention_ref(
    q, k_pool, v_pool, block_table, seq_lens, scale: float, starts=None, sinks: int = 0, max_keys: int | None = None,
    k_scales=None, v_scales=None, stride: int = 1,
) -> torch.Tensor:
    _check_args(q, k_pool, v_pool, block_table, seq_lens, starts, sinks, max_keys, stride)
    batch, num_heads, _ = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    # each sequence gathers only the keys it sees: other table entries may already be -1
    positions, valid = visible_positions(seq_lens, starts, sinks, stride)
    positions = torch.where(valid, positions, 0)
    pages = block_table.gather(1, positions // block_size).long()
    # invalid positions may map to unused table entries (-1): point them at block 0, masked below
    pages, offsets = torch.where(valid, pages, 0), positions % block_size
    keys = k_pool[pages, offsets].float()  # [B, L, KVH, Dk]
    values = v_pool[pages, offsets].float()
    if k_scales is not None:  # one-byte rows: each times its scale
        keys, values = keys * k_scales[pages, offsets].float(), values * v_scales[pages, offsets].float()
    # zero the masked values: a never-written slot of a torch.empty pool may hold NaN
    values = values.masked_fill(~valid[:, :, None, None], 0.0)
    queries = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, -1)
    scores = torch.einsum("bkgd,blkd->bkgl", queries, keys) * scale
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(batch, num_heads, -1).to(q.dtype)


def _split_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, seq_lens_ptr, starts_ptr, partial_out_ptr, partial_lse_ptr,
    k_scales_ptr, v_scales_ptr,
    scale, sinks, stride, split_len,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_pos, stride_k_head, stride_k_dim,
    stride_v_block, stride_v_pos, stride_v_head, stride_v_dim,
    stride_table_seq, stride_table_entry,
    stride_ks_block, stride_ks_pos, stride_ks_head, stride_vs_block, stride_vs_pos, stride_vs_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    DIM_K: tl.constexpr, DIM_K_PAD: tl.constexpr, DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS_PER_STEP: tl.constexpr, HAS_STARTS: tl.constexpr, QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    span_start = tl.load(starts_ptr + seq) if HAS_STARTS else 0
    sink_count = tl.minimum(span_start, sinks) if HAS_STARTS else 0
    # the splits tile the visible keys alone, numbered 0.. (sinks first, then the span's every stride-th position):
    # blocks outside are never loaded (their table entries may be -1)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, sink_count + (seq_len - 1 - span_start) // stride + 1)

    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims_k = tl.arange(0, DIM_K_PAD)
    dims_v = tl.arange(0, DIM_V_PAD)
    dim_k_ok = dims_k < DIM_K
    dim_v_ok = dims_v < DIM_V

    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims_k[None, :] * stride_q_dim,
        mask=row_ok[:, None] & dim_k_ok[None, :], other=0.0,
    )
    # one-byte rows are multiplied in the scales' dtype (exact: int8 and e4m3 fit fp16 / bf16); float pools in their own
    compute_dtype = k_scales_ptr.dtype.element_ty if QUANTIZED else k_pool_ptr.dtype.element_ty
    q = q.to(compute_dtype)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_V_PAD], tl.float32)
    for step_start in range(split_start, split_end, KEYS_PER_STEP):
        index = step_start + tl.arange(0, KEYS_PER_STEP)
        pos_ok = index < split_end
        positions = tl.where(index < sink_count, index, (index - sink_count) * stride + span_start)
        block = tl.load(
            block_table_ptr + seq * stride_table_seq + (positions // BLOCK_SIZE) * stride_table_entry,
            mask=pos_ok, other=0,
        ).to(tl.int64)  # int64: block * stride overflows int32 in large pools
        in_block = positions % BLOCK_SIZE
        k_rows = k_pool_ptr + block * stride_k_block + in_block * stride_k_pos + kv_head * stride_k_head
        keys = tl.load(k_rows[:, None] + dims_k[None, :] * stride_k_dim,
                       mask=pos_ok[:, None] & dim_k_ok[None, :], other=0.0).to(compute_dtype)
        # "ieee": fp32 inputs would otherwise be rounded to tf32; ignored for 16-bit inputs
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
        if QUANTIZED:
            k_scale = tl.load(k_scales_ptr + block * stride_ks_block + in_block * stride_ks_pos
                              + kv_head * stride_ks_head, mask=pos_ok, other=0.0).to(tl.float32)
            scores = scores * k_scale[None, :]
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v_rows = v_pool_ptr + block * stride_v_block + in_block * stride_v_pos + kv_head * stride_v_head
        values = tl.load(v_rows[:, None] + dims_v[None, :] * stride_v_dim,
                         mask=pos_ok[:, None] & dim_v_ok[None, :], other=0.0).to(compute_dtype)
        weighted = probs
        if QUANTIZED:
            v_scale = tl.load(v_scales_ptr + block * stride_vs_block + in_block * stride_vs_pos
                              + kv_head * stride_vs_head, mask=pos_ok, other=0.0).to(tl.float32)
            weighted = probs * v_scale[None, :]
        acc = acc * rescale[:, None] + tl.dot(weighted.to(compute_dtype), values, input_precision="ieee")
        running_max = new_max

    # a split past the end of a short sequence saw no keys: output 0 with weight exp(-inf) = 0
    has_keys = running_sum > 0.0
    safe_sum = tl.where(has_keys, running_sum, 1.0)
    partial_out = acc / safe_sum[:, None]
    partial_lse = tl.where(has_keys, running_max + tl.log(safe_sum), float("-inf"))
    partial_rows = (seq * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
    tl.store(partial_lse_ptr + partial_rows, partial_lse, mask=row_ok)
    tl.store(partial_out_ptr + partial_rows[:, None] * DIM_V + dims_v[None, :], partial_out,
             mask=row_ok[:, None] & dim_v_ok[None, :])


def _merge_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_out_seq, stride_out_head, stride_out_dim,
    NUM_SPLITS: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_V_PAD)
    dim_ok = dims < DIM_V
    partial_rows = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits

    lse = tl.load(partial_lse_ptr + partial_rows, mask=split_ok, other=float("-inf"))
    # split 0 starts at the first visible key and seq_len >= 1, so it holds a key and the max is finite
    weights = tl.exp(lse - tl.max(lse, axis=0))
    partial_out = tl.load(partial_out_ptr + partial_rows[:, None] * DIM_V + dims[None, :],
                          mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(weights[:, None] * partial_out, axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _jitted_kernels():
    return jit_kernels(globals(), _split_kernel, _merge_kernel)


def _tile_shape(dim_pad: int, element_size: int) -> tuple[int, int]:
    """(keys per step, warps) that keep the K/V tiles in registers (no spills in ptxas for sm_90)."""
    tile_elements = 4096 if element_size <= 2 else 1024  # exact fp32 tl.dot needs more registers
    return min(64, max(16, tile_elements // dim_pad)), 4 if dim_pad <= 128 else 8


def _default_num_splits(max_len: int, programs_per_split: int, device: torch.device) -> int:
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits_to_fill_gpu = cdiv(_PROGRAMS_PER_SM * sm_count, programs_per_split)
    return max(1, min(cdiv(max_len, _MIN_KEYS_PER_SPLIT), splits_to_fill_gpu, _MAX_SPLITS))


def paged_decode_attention_triton(
    q, k_pool, v_pool, block_table, seq_lens, scale: float, num_splits: int | None = None, starts=None,
    sinks: int = 0, max_keys: int | None = None, k_scales=None, v_scales=None, stride: int = 1,
) -> torch.Tensor:
    _check_args(q, k_pool, v_pool, block_table, seq_lens, starts, sinks, max_keys, stride)
    split_kernel, merge_kernel = _jitted_kernels()
    batch, num_heads, dim_k = q.shape
    block_size, num_kv_heads, dim_v = v_pool.shape[1], v_pool.shape[2], v_pool.shape[3]
    group = num_heads // num_kv_heads
    # the table's capacity bounds the longest sequence without a device sync (reading seq_lens would
    # need one); callers size the table to their longest sequence, so the bound is tight
    max_len = block_table.shape[1] * block_size
    span = max_len if max_keys is None else min(max_keys, max_len)  # keys one sequence can see
    if num_splits is None:
        num_splits = _default_num_splits(span, batch * num_kv_heads, q.device)
    dim_k_pad, dim_v_pad = padded(dim_k), padded(dim_v)
    quantized = k_scales is not None
    compute_size = k_scales.element_size() if quantized else k_pool.element_size()
    keys_per_step, num_warps = _tile_shape(max(dim_k_pad, dim_v_pad), compute_size)
    split_len = cdiv(cdiv(span, num_splits), keys_per_step) * keys_per_step

    partial_out = torch.empty(batch, num_heads, num_splits, dim_v, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_heads, dim_v, dtype=q.dtype, device=q.device)
    split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_pool, v_pool, block_table, seq_lens, seq_lens if starts is None else starts, partial_out, partial_lse,
        k_scales if quantized else q, v_scales if quantized else q,  # unread without QUANTIZED
        scale, sinks, stride, split_len,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *block_table.stride(),
        *(k_scales.stride()[:3] + v_scales.stride()[:3] if quantized else (0,) * 6),
        GROUP=group, GROUP_PAD=padded(group), DIM_K=dim_k, DIM_K_PAD=dim_k_pad,
        DIM_V=dim_v, DIM_V_PAD=dim_v_pad, BLOCK_SIZE=block_size, KEYS_PER_STEP=keys_per_step,
        HAS_STARTS=starts is not None, QUANTIZED=quantized, num_warps=num_warps,
    )
    merge_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, *out.stride(),
        NUM_SPLITS=num_splits, NUM_SPLITS_PAD=padded(num_splits, minimum=1),
        DIM_V=dim_v, DIM_V_PAD=dim_v_pad,
    )
    return out


def paged_decode_attention(
    q, k_pool, v_pool, block_table, seq_lens, scale: float, starts=None, sinks: int = 0, max_keys: int | None = None,
    k_scales=None, v_scales=None, stride: int = 1,
) -> torch.Tensor:
    """k_scales, v_scales: a one-byte (int8 / fp8) pool's row scales (None: float pools). stride: a dilated span."""
    args = (q, k_pool, v_pool, block_table, seq_lens, scale)
    scales = dict(k_scales=k_scales, v_scales=v_scales, stride=stride)
    if use_triton(q, k_pool, v_pool, block_table, seq_lens):
        return paged_decode_attention_triton(*args, starts=starts, sinks=sinks, max_keys=max_keys, **scales)
    if use_cpu_kernel(q, k_pool, v_pool) and cpu_decode.fits(q, k_pool, k_pool.shape[2], v_pool.shape[3], k_scales):
        return cpu_decode.paged_decode_attention_cpu(*args, starts=starts, sinks=sinks, max_keys=max_keys, **scales)
    return paged_decode_attention_ref(*args, starts=starts, sinks=sinks, max_keys=max_keys, **scales)
