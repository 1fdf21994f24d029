"""Scatter new tokens' K/V into a paged KV cache.

k [N, KVH, Dk], v [N, KVH, Dv]; k_pool/v_pool [num_blocks, block_size, KVH, D], any strides with the last dim
contiguous (the engine's pools are head-major views); slot_mapping [N], flat slot = block * block_size + offset,
negative = skip (padding token).
v = v_pool = None writes keys only: an MLA latent cache holds one row per token, [latent ; rope key].
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch

from .dispatch import jit_kernels, use_triton
from .tiles import padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call


def _check_args(k, v, k_pool, v_pool, slot_mapping) -> None:
    if (v is None) != (v_pool is None):
        raise ValueError("pass v and v_pool together, or neither for a keys-only write")
    if v is None:  # check the keys alone, through the same rules
        v, v_pool = k, k_pool
    if k.dim() != 3 or v.dim() != 3 or slot_mapping.shape != (k.shape[0],) or v.shape[0] != k.shape[0]:
        raise ValueError("expected k [N, KVH, Dk], v [N, KVH, Dv] and slot_mapping [N]")
    if k_pool.shape[2:] != k.shape[1:] or v_pool.shape[2:] != v.shape[1:]:
        raise ValueError(f"tokens {tuple(k.shape)}/{tuple(v.shape)} do not fit pools "
                         f"{tuple(k_pool.shape)}/{tuple(v_pool.shape)}")
    if k_pool.shape[:2] != v_pool.shape[:2]:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in blocks")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("k_pool and v_pool need their last dim contiguous")


def write_paged_kv_ref(k, v, k_pool, v_pool, slot_mapping) -> None:
    _check_args(k, v, k_pool, v_pool, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_pool.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_pool[blocks, offsets] = k[keep].to(k_pool.dtype)
    if v is not None:
        v_pool[blocks, offsets] = v[keep].to(v_pool.dtype)


def _write_kernel(
    k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_mapping_ptr,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_kp_block, stride_kp_pos, stride_kp_head,
    stride_vp_block, stride_vp_pos, stride_vp_head,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr,
    DIM_K: tl.constexpr, DIM_K_PAD: tl.constexpr, DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
    HAS_VALUES: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)  # never form a pointer before the pool, even a masked one
    block, in_block = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, NUM_KV_HEADS_PAD)
    head_ok = heads < tl.where(keep, NUM_KV_HEADS, 0)  # a skipped token writes no heads

    dims_k = tl.arange(0, DIM_K_PAD)
    mask_k = head_ok[:, None] & (dims_k < DIM_K)[None, :]
    new_k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims_k[None, :] * stride_k_dim,
                    mask=mask_k)
    k_dest = (k_pool_ptr + block * stride_kp_block + in_block * stride_kp_pos + heads[:, None] * stride_kp_head
              + dims_k[None, :])
    tl.store(k_dest, new_k.to(k_pool_ptr.dtype.element_ty), mask=mask_k)

    if HAS_VALUES:
        dims_v = tl.arange(0, DIM_V_PAD)
        mask_v = head_ok[:, None] & (dims_v < DIM_V)[None, :]
        new_v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head
                        + dims_v[None, :] * stride_v_dim, mask=mask_v)
        v_dest = (v_pool_ptr + block * stride_vp_block + in_block * stride_vp_pos + heads[:, None] * stride_vp_head
                  + dims_v[None, :])
        tl.store(v_dest, new_v.to(v_pool_ptr.dtype.element_ty), mask=mask_v)


@functools.cache
def _jitted_kernel():
    return jit_kernels(globals(), _write_kernel)[0]


def write_paged_kv_triton(k, v, k_pool, v_pool, slot_mapping) -> None:
    _check_args(k, v, k_pool, v_pool, slot_mapping)
    num_tokens, num_kv_heads, dim_k = k.shape
    if num_tokens == 0:
        return
    has_values = v is not None
    # a keys-only write compiles without the value half (HAS_VALUES), so the stand-ins below are never read
    v, v_pool = (v, v_pool) if has_values else (k, k_pool)
    dim_v = v.shape[2]
    _jitted_kernel()[(num_tokens,)](
        k, v, k_pool, v_pool, slot_mapping, *k.stride(), *v.stride(), *k_pool.stride()[:3], *v_pool.stride()[:3],
        BLOCK_SIZE=k_pool.shape[1], NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PAD=padded(num_kv_heads, minimum=1),
        DIM_K=dim_k, DIM_K_PAD=padded(dim_k, minimum=1),
        DIM_V=dim_v, DIM_V_PAD=padded(dim_v, minimum=1), HAS_VALUES=has_values,
    )


@torch.library.custom_op("archzoo::write_paged_kv", mutates_args=("k_pool", "v_pool"))
def _write_paged_kv_op(k: torch.Tensor, v: torch.Tensor | None, k_pool: torch.Tensor, v_pool: torch.Tensor | None,
                       slot_mapping: torch.Tensor) -> None:
    """The reference as one opaque op: its skip mask has a data-dependent size, which would break a compiled
    decode step's graph at every layer (and then recompile the rest per layer)."""
    write_paged_kv_ref(k, v, k_pool, v_pool, slot_mapping)


def write_paged_kv(k, v, k_pool, v_pool, slot_mapping) -> None:
    if use_triton(k, v, k_pool, v_pool, slot_mapping):
        write_paged_kv_triton(k, v, k_pool, v_pool, slot_mapping)
    else:
        _write_paged_kv_op(k, v, k_pool, v_pool, slot_mapping)
