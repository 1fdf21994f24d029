"""Causal linear attention with a normalizer (Katharopoulos et al. 2020) over already feature-mapped q, k.

The mixer applies the feature map (elu+1, a Taylor map, ...); these kernels receive phi(q), phi(k) and
do not scale q (fla's naive reference scales by dk^-0.5 by default; Katharopoulos does not).

    S_t = S_0 + sum_{s<=t} k_s v_s^T      [dk, dv]
    z_t = z_0 + sum_{s<=t} k_s            [dk]
    out_t = (q_t S_t) / (q_t . z_t + eps)

- `linear_attention_step`: one decode token per (batch, head); q, k [B, H, dk], v [B, H, dv]; the
  state [B, H, dk, dv] and normalizer [B, H, dk] are updated in place.
- `linear_attention_chunked`: prefill; q, k [B, H, T, dk], v [B, H, T, dv], optional initial state and
  normalizer (None = zeros). Inside a chunk the causal term (q k^T, lower-triangle masked) times v,
  across chunks the carried state. Returns (out, final state, final normalizer), new tensors.
- `linear_attention_parallel_ref`: the masked quadratic form, the oracle for both.

Arithmetic in fp32; outputs in q's dtype; states in the dtype of the state passed in (fp32 when none).
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch

from .dispatch import jit_kernels, use_triton
from .tiles import padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

# fp32 elements of one register tile (S's [dk, dv-tile] slice, or a [chunk, dk] block of q or k):
# 4096 at 4 warps is 32 registers a thread per tile, as paged_attention's fp16 K/V tiles
_TILE_ELEMENTS = 4096


def _check_step_args(q, k, v, state, normalizer) -> None:
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B, H, dk] and v [B, H, dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(state.shape) != (*q.shape, v.shape[2]) or tuple(normalizer.shape) != tuple(q.shape):
        raise ValueError(f"expected state {(*q.shape, v.shape[2])} and normalizer {tuple(q.shape)}, "
                         f"got {tuple(state.shape)} and {tuple(normalizer.shape)}")


def _check_sequence_args(q, k, v, state, normalizer) -> None:
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, H, T, dk] and v [B, H, T, dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, _, dim_k = q.shape
    if state is not None and tuple(state.shape) != (batch, heads, dim_k, v.shape[3]):
        raise ValueError(f"expected state {(batch, heads, dim_k, v.shape[3])}, got {tuple(state.shape)}")
    if normalizer is not None and tuple(normalizer.shape) != (batch, heads, dim_k):
        raise ValueError(f"expected normalizer {(batch, heads, dim_k)}, got {tuple(normalizer.shape)}")


def linear_attention_step_ref(q, k, v, state, normalizer, eps: float = 1e-6) -> torch.Tensor:
    _check_step_args(q, k, v, state, normalizer)
    out_dtype = q.dtype
    q, k = q.float(), k.float()
    new_state = state.float() + k[..., :, None] * v.float()[..., None, :]
    new_normalizer = normalizer.float() + k
    state.copy_(new_state)
    normalizer.copy_(new_normalizer)
    numerator = torch.einsum("bhk,bhkv->bhv", q, new_state)
    denominator = (q * new_normalizer).sum(-1, keepdim=True) + eps
    return (numerator / denominator).to(out_dtype)


def _initial_states(q, v, state, normalizer):
    batch, heads, _, dim_k = q.shape
    state = torch.zeros(batch, heads, dim_k, v.shape[3], device=q.device) if state is None else state.float()
    normalizer = torch.zeros(batch, heads, dim_k, device=q.device) if normalizer is None else normalizer.float()
    return state, normalizer


def linear_attention_parallel_ref(q, k, v, eps: float = 1e-6, *, state=None, normalizer=None) -> torch.Tensor:
    """The masked quadratic form: out_t = (q_t S_0 + sum_{s<=t} (q_t . k_s) v_s) / (q_t . z_0 + sum_{s<=t} q_t . k_s + eps)."""
    _check_sequence_args(q, k, v, state, normalizer)
    initial_state, initial_normalizer = _initial_states(q, v, state, normalizer)
    out_dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    length = q.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
    numerator = q @ initial_state + scores @ v
    denominator = (q @ initial_normalizer[..., None]).squeeze(-1) + scores.sum(-1) + eps
    return (numerator / denominator[..., None]).to(out_dtype)


def linear_attention_chunked_ref(q, k, v, state=None, normalizer=None, chunk_size: int = 64, eps: float = 1e-6):
    _check_sequence_args(q, k, v, state, normalizer)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    state_dtype = torch.float32 if state is None else state.dtype
    normalizer_dtype = torch.float32 if normalizer is None else normalizer.dtype
    carried_state, carried_normalizer = _initial_states(q, v, state, normalizer)
    out = torch.empty(*v.shape, device=q.device)
    for start in range(0, q.shape[2], chunk_size):
        chunk = slice(start, start + chunk_size)
        q_c, k_c, v_c = q[:, :, chunk].float(), k[:, :, chunk].float(), v[:, :, chunk].float()
        length = q_c.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = (q_c @ k_c.transpose(-1, -2)).masked_fill(~causal, 0.0)  # within the chunk
        numerator = q_c @ carried_state + scores @ v_c  # earlier chunks through the carried state
        denominator = (q_c @ carried_normalizer[..., None]).squeeze(-1) + scores.sum(-1) + eps
        out[:, :, chunk] = numerator / denominator[..., None]
        carried_state = carried_state + k_c.transpose(-1, -2) @ v_c
        carried_normalizer = carried_normalizer + k_c.sum(2)
    # copy=True: with T = 0 the carried tensors may still be the caller's own
    return (out.to(q.dtype), carried_state.to(state_dtype, copy=True),
            carried_normalizer.to(normalizer_dtype, copy=True))


def _step_kernel(
    q_ptr, k_ptr, v_ptr, state_ptr, normalizer_ptr, out_ptr, eps,
    stride_q_batch, stride_q_head, stride_q_dim,
    stride_k_batch, stride_k_head, stride_k_dim,
    stride_v_batch, stride_v_head, stride_v_dim,
    stride_state_batch, stride_state_head, stride_state_k, stride_state_v,
    stride_norm_batch, stride_norm_head, stride_norm_dim,
    stride_out_batch, stride_out_head, stride_out_dim,
    DIM_K: tl.constexpr, DIM_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # one program owns a whole (batch, head) state: every element is read once and written once, so no
    # program reads what another wrote (a dv-split grid would race on the shared normalizer)
    batch = tl.program_id(0).to(tl.int64)  # int64: slot-pool strides times the slot index pass 2**31
    head = tl.program_id(1).to(tl.int64)
    q_row = q_ptr + batch * stride_q_batch + head * stride_q_head
    k_row = k_ptr + batch * stride_k_batch + head * stride_k_head
    v_row = v_ptr + batch * stride_v_batch + head * stride_v_head
    state_rows = state_ptr + batch * stride_state_batch + head * stride_state_head
    norm_row = normalizer_ptr + batch * stride_norm_batch + head * stride_norm_head

    denominator = tl.zeros([BLOCK_K], tl.float32)
    for k_start in range(0, DIM_K, BLOCK_K):
        dims_k = k_start + tl.arange(0, BLOCK_K)
        k_ok = dims_k < DIM_K
        q = tl.load(q_row + dims_k * stride_q_dim, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_row + dims_k * stride_k_dim, mask=k_ok, other=0.0).to(tl.float32)
        z = tl.load(norm_row + dims_k * stride_norm_dim, mask=k_ok, other=0.0).to(tl.float32) + k
        tl.store(norm_row + dims_k * stride_norm_dim, z.to(normalizer_ptr.dtype.element_ty), mask=k_ok)
        denominator += q * z
    denominator_total = tl.sum(denominator, axis=0) + eps

    for v_start in range(0, DIM_V, BLOCK_V):
        dims_v = v_start + tl.arange(0, BLOCK_V)
        v_ok = dims_v < DIM_V
        v = tl.load(v_row + dims_v * stride_v_dim, mask=v_ok, other=0.0).to(tl.float32)
        numerator = tl.zeros([BLOCK_V], tl.float32)
        for k_start in range(0, DIM_K, BLOCK_K):
            dims_k = k_start + tl.arange(0, BLOCK_K)
            k_ok = dims_k < DIM_K
            q = tl.load(q_row + dims_k * stride_q_dim, mask=k_ok, other=0.0).to(tl.float32)
            k = tl.load(k_row + dims_k * stride_k_dim, mask=k_ok, other=0.0).to(tl.float32)
            tile = state_rows + dims_k[:, None] * stride_state_k + dims_v[None, :] * stride_state_v
            tile_ok = k_ok[:, None] & v_ok[None, :]
            state = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32) + k[:, None] * v[None, :]
            tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
            numerator += tl.sum(q[:, None] * state, axis=0)
        tl.store(out_ptr + batch * stride_out_batch + head * stride_out_head + dims_v * stride_out_dim,
                 (numerator / denominator_total).to(out_ptr.dtype.element_ty), mask=v_ok)


def _chunked_kernel(
    q_ptr, k_ptr, v_ptr, state_ptr, normalizer_ptr, out_ptr, final_state_ptr, final_normalizer_ptr,
    length, eps,
    stride_q_batch, stride_q_head, stride_q_time, stride_q_dim,
    stride_k_batch, stride_k_head, stride_k_time, stride_k_dim,
    stride_v_batch, stride_v_head, stride_v_time, stride_v_dim,
    stride_state_batch, stride_state_head, stride_state_k, stride_state_v,
    stride_norm_batch, stride_norm_head, stride_norm_dim,
    stride_out_batch, stride_out_head, stride_out_time, stride_out_dim,
    stride_final_batch, stride_final_head, stride_final_k, stride_final_v,
    stride_final_norm_batch, stride_final_norm_head, stride_final_norm_dim,
    DIM_K: tl.constexpr, DIM_K_PAD: tl.constexpr, DIM_V: tl.constexpr, BLOCK_V: tl.constexpr,
    CHUNK: tl.constexpr, HAS_STATE: tl.constexpr, HAS_NORMALIZER: tl.constexpr,
):
    # one program per (batch, head, dv tile) walks the chunks in order, carrying its [dk, dv-tile] slice of S
    # and all of z in fp32 registers; z is recomputed by every dv tile (dk adds a chunk) and stored by tile 0
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    v_tile = tl.program_id(2)
    dims_k = tl.arange(0, DIM_K_PAD)
    dims_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dims_k < DIM_K
    v_ok = dims_v < DIM_V
    state_ok = k_ok[:, None] & v_ok[None, :]

    if HAS_STATE:
        state = tl.load(state_ptr + batch * stride_state_batch + head * stride_state_head
                        + dims_k[:, None] * stride_state_k + dims_v[None, :] * stride_state_v,
                        mask=state_ok, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([DIM_K_PAD, BLOCK_V], tl.float32)
    if HAS_NORMALIZER:
        normalizer = tl.load(normalizer_ptr + batch * stride_norm_batch + head * stride_norm_head
                             + dims_k * stride_norm_dim, mask=k_ok, other=0.0).to(tl.float32)
    else:
        normalizer = tl.zeros([DIM_K_PAD], tl.float32)

    steps = tl.arange(0, CHUNK)
    causal = steps[:, None] >= steps[None, :]
    q_rows = q_ptr + batch * stride_q_batch + head * stride_q_head
    k_rows = k_ptr + batch * stride_k_batch + head * stride_k_head
    v_rows = v_ptr + batch * stride_v_batch + head * stride_v_head
    out_rows = out_ptr + batch * stride_out_batch + head * stride_out_head
    for start in range(0, length, CHUNK):
        times = start + steps
        time_ok = times < length  # rows past the end load as 0 and add nothing to S or z
        qk_ok = time_ok[:, None] & k_ok[None, :]
        q = tl.load(q_rows + times[:, None] * stride_q_time + dims_k[None, :] * stride_q_dim, mask=qk_ok, other=0.0)
        k = tl.load(k_rows + times[:, None] * stride_k_time + dims_k[None, :] * stride_k_dim, mask=qk_ok, other=0.0)
        v = tl.load(v_rows + times[:, None] * stride_v_time + dims_v[None, :] * stride_v_dim,
                    mask=time_ok[:, None] & v_ok[None, :], other=0.0)
        # "ieee": fp32 inputs would otherwise be rounded to tf32; ignored for 16-bit inputs
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        scores = tl.where(causal, scores, 0.0)
        q32 = q.to(tl.float32)
        # S and the scores stay fp32: S sums the whole prefix, and unnormalized feature-map scores can pass
        # fp16's 65504 (a Taylor map grows as (q.k)^2)
        numerator = tl.dot(q32, state, input_precision="ieee")
        numerator = tl.dot(scores, v.to(tl.float32), numerator, input_precision="ieee")
        denominator = tl.sum(q32 * normalizer[None, :], axis=1) + tl.sum(scores, axis=1) + eps
        tl.store(out_rows + times[:, None] * stride_out_time + dims_v[None, :] * stride_out_dim,
                 (numerator / denominator[:, None]).to(out_ptr.dtype.element_ty),
                 mask=time_ok[:, None] & v_ok[None, :])
        state = tl.dot(tl.trans(k), v, state, input_precision="ieee")
        normalizer += tl.sum(k.to(tl.float32), axis=0)

    tl.store(final_state_ptr + batch * stride_final_batch + head * stride_final_head
             + dims_k[:, None] * stride_final_k + dims_v[None, :] * stride_final_v,
             state.to(final_state_ptr.dtype.element_ty), mask=state_ok)
    if v_tile == 0:
        tl.store(final_normalizer_ptr + batch * stride_final_norm_batch + head * stride_final_norm_head
                 + dims_k * stride_final_norm_dim, normalizer.to(final_normalizer_ptr.dtype.element_ty), mask=k_ok)


@functools.cache
def _jitted_kernels():
    return jit_kernels(globals(), _step_kernel, _chunked_kernel)


def linear_attention_step_triton(q, k, v, state, normalizer, eps: float = 1e-6) -> torch.Tensor:
    _check_step_args(q, k, v, state, normalizer)
    step_kernel, _ = _jitted_kernels()
    batch, heads, dim_k = q.shape
    dim_v = v.shape[2]
    block_k = min(64, padded(dim_k))
    block_v = min(64, padded(dim_v))  # a 64 x 64 fp32 state tile: 32 registers a thread at 4 warps
    out = torch.empty(batch, heads, dim_v, dtype=q.dtype, device=q.device)
    step_kernel[(batch, heads)](
        q, k, v, state, normalizer, out, eps,
        *q.stride(), *k.stride(), *v.stride(), *state.stride(), *normalizer.stride(), *out.stride(),
        DIM_K=dim_k, DIM_V=dim_v, BLOCK_K=block_k, BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def linear_attention_chunked_triton(q, k, v, state=None, normalizer=None, chunk_size: int = 64, eps: float = 1e-6):
    """`chunk_size` bounds the kernel's chunk (rounded up to a power of two >= 16, lowered further when dk is
    wide so the [chunk, dk] tiles fit in registers); the chunk length changes rounding only, not the result."""
    _check_sequence_args(q, k, v, state, normalizer)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    _, chunked_kernel = _jitted_kernels()
    batch, heads, length, dim_k = q.shape
    dim_v = v.shape[3]
    dim_k_pad = padded(dim_k)
    fitting = max(16, _TILE_ELEMENTS // dim_k_pad)  # the widest tile beside dk that stays in the budget
    block_v = min(64, fitting, padded(dim_v))
    chunk = min(64, fitting, padded(chunk_size))
    out = torch.empty(batch, heads, length, dim_v, dtype=q.dtype, device=q.device)
    final_state = torch.empty(batch, heads, dim_k, dim_v, device=q.device,
                              dtype=torch.float32 if state is None else state.dtype)
    final_normalizer = torch.empty(batch, heads, dim_k, device=q.device,
                                   dtype=torch.float32 if normalizer is None else normalizer.dtype)
    chunked_kernel[(batch, heads, -(-dim_v // block_v))](
        q, k, v, q if state is None else state, q if normalizer is None else normalizer,
        out, final_state, final_normalizer, length, eps,
        *q.stride(), *k.stride(), *v.stride(),
        *(state.stride() if state is not None else (0,) * 4),
        *(normalizer.stride() if normalizer is not None else (0,) * 3),
        *out.stride(), *final_state.stride(), *final_normalizer.stride(),
        DIM_K=dim_k, DIM_K_PAD=dim_k_pad, DIM_V=dim_v, BLOCK_V=block_v, CHUNK=chunk,
        HAS_STATE=state is not None, HAS_NORMALIZER=normalizer is not None,
        num_warps=4 if dim_k_pad <= 128 else 8,
    )
    return out, final_state, final_normalizer


def linear_attention_step(q, k, v, state, normalizer, eps: float = 1e-6) -> torch.Tensor:
    if use_triton(q, k, v, state, normalizer):
        return linear_attention_step_triton(q, k, v, state, normalizer, eps)
    return linear_attention_step_ref(q, k, v, state, normalizer, eps)


def linear_attention_chunked(q, k, v, state=None, normalizer=None, chunk_size: int = 64, eps: float = 1e-6):
    tensors = [t for t in (q, k, v, state, normalizer) if t is not None]
    if use_triton(*tensors):
        return linear_attention_chunked_triton(q, k, v, state, normalizer, chunk_size, eps)
    return linear_attention_chunked_ref(q, k, v, state, normalizer, chunk_size, eps)
