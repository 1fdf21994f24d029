"""Retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language Models"): linear
attention whose state decays by a per-head factor each step. A decode step (Triton beside its PyTorch reference) and
the chunked form for prefill and training.

Per (batch, head), with the state S [dk, dv] and a log decay g_t <= 0 (RetNet's fixed gamma_h = exp(g), or 1 where
the mixer stops a padded row's state; ssm/retnet.py):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T
    out_t = S_t^T (scale q_t),   scale = dk^-0.5 unless given

The scale goes on q, as flash-linear-attention's retention kernels apply it (its `chunk_retention` default); the
paper's pseudocode scales k instead, which gives the same outputs and a state dk^0.5 times smaller.
The decay is taken per token, not per head, so the same kernels serve padded rows (g = 0 there, no decay) and any
data-dependent scalar decay (fla's simple GLA, of which retention is the constant-decay case).

- `retention_decay_step`: one token per (batch, head); q, k [B, H, dk], v [B, H, dv], g [B, H]; the state
  [B, H, dk, dv] is updated in place (it is normally the engine's per-slot rows). Returns out [B, H, dv].
- `retention_decay_chunked`: prefill and training (PyTorch, differentiable); q, k [B, H, T, dk], v [B, H, T, dv],
  g [B, H, T], optional initial state (None = zeros). Returns (out, final state), new tensors.

Arithmetic in fp32 (fp64 stays fp64 in the chunked form); outputs in q's dtype; states in the dtype of the state
passed in (fp32 when none).
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools
import math

import torch
import torch.nn.functional as F

from .dispatch import jit_kernels, use_triton
from .tiles import cdiv, padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

# fp32 elements of a program's [dk, dv-tile] slice of S, as the gated delta step's: the step is memory-bound (each
# state element read and written once), so registers go to occupancy rather than wider tiles
_TILE_ELEMENTS = 2048


def _check_step_args(q, k, v, g, state) -> None:
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B, H, dk] and v [B, H, dv], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if g.shape != q.shape[:2]:
        raise ValueError(f"expected g {tuple(q.shape[:2])}, got {tuple(g.shape)}")
    if tuple(state.shape) != (*q.shape, v.shape[2]):
        raise ValueError(f"expected state {(*q.shape, v.shape[2])}, got {tuple(state.shape)}")


def _check_sequence_args(q, k, v, g, state, chunk_size) -> None:
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, H, T, dk] and v [B, H, T, dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if g.shape != q.shape[:3]:
        raise ValueError(f"expected g {tuple(q.shape[:3])}, got {tuple(g.shape)}")
    batch, heads, _, dim_k = q.shape
    if state is not None and tuple(state.shape) != (batch, heads, dim_k, v.shape[3]):
        raise ValueError(f"expected state {(batch, heads, dim_k, v.shape[3])}, got {tuple(state.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")


def retention_decay_step_ref(q, k, v, g, state, scale: float | None = None) -> torch.Tensor:
    _check_step_args(q, k, v, g, state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    new_state = state.float() * g.float().exp()[..., None, None] + k[..., :, None] * v[..., None, :]
    state.copy_(new_state)
    return torch.einsum("bhk,bhkv->bhv", q * scale, new_state).to(out_dtype)


def retention_decay_chunked(q, k, v, g, state=None, chunk_size: int = 64, scale: float | None = None):
    """Within a chunk of C steps, with gamma_i = g_1 + ... + g_i (log decay from the chunk's start):

        S_i   = e^{gamma_i} S_0 + sum_{j<=i} e^{gamma_i - gamma_j} k_j v_j^T
        out_i = e^{gamma_i} q_i S_0 + sum_{j<=i} e^{gamma_i - gamma_j} (q_i . k_j) v_j

    a masked C x C contraction plus the read of S_0 (the paper's chunkwise recurrent form, section 2.2); the chunks
    are then chained by the state recurrence. Every exponent is gamma_i - gamma_j (j <= i), gamma_i or
    gamma_C - gamma_j, all <= 0, so nothing overflows. A sequence shorter than chunk_size is one chunk of its own
    length (the chunk length changes rounding only, not the result).
    """
    _check_sequence_args(q, k, v, g, state, chunk_size)
    batch, heads, length, dim_k = q.shape
    dim_v = v.shape[3]
    scale = dim_k ** -0.5 if scale is None else scale
    out_dtype, compute = q.dtype, torch.promote_types(q.dtype, torch.float32)
    size = max(1, min(chunk_size, length))
    chunks = max(1, cdiv(length, size))  # T = 0 still runs one all-padding step, which returns the state unchanged
    pad = chunks * size - length  # padded steps have g = 0 and k = v = 0: no decay, no write

    def chunked(x):  # [b, h, t, ...] -> [b, h, chunks, size, ...], zero-padded, in the compute dtype
        x = F.pad(x.to(compute), (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(batch, heads, chunks, size, *x.shape[3:])

    q, k, v, g = chunked(q) * scale, chunked(k), chunked(v), chunked(g)
    gamma = g.cumsum(-1)  # [b, h, n, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # masked before exp: above the diagonal gamma_i - gamma_j is >= 0 and could overflow
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, -math.inf).exp()  # e^{gamma_i - gamma_j}
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk
    within = scores @ v  # [b, h, n, C, dv]
    q_read = q * gamma.exp()[..., None]  # reads S_0 decayed to each step
    k_write = k * (gamma[..., -1:] - gamma).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    carried = (torch.zeros(batch, heads, dim_k, dim_v, dtype=compute, device=q.device) if state is None
               else state.to(compute))
    outs = []
    for c in range(chunks):  # out of place throughout, so autograd can follow the chain of states
        outs.append(q_read[:, :, c] @ carried + within[:, :, c])
        carried = carried * chunk_decay[:, :, c] + k_write[:, :, c].transpose(-1, -2) @ v[:, :, c]
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * size, dim_v)[:, :, :length]
    return out.to(out_dtype), carried.to(torch.float32 if state is None else state.dtype)


def _step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, state_ptr, out_ptr, scale,
    stride_q_batch, stride_q_head, stride_q_dim,
    stride_k_batch, stride_k_head, stride_k_dim,
    stride_v_batch, stride_v_head, stride_v_dim,
    stride_g_batch, stride_g_head,
    stride_state_batch, stride_state_head, stride_state_k, stride_state_v,
    stride_out_batch, stride_out_head, stride_out_dim,
    DIM_K: tl.constexpr, DIM_K_PAD: tl.constexpr, DIM_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # one program per (batch, head, dv tile): every column of S evolves on its own, so a program needs all of dk
    # (the read q S sums over it) but only its dv columns, and no program reads what another writes
    batch = tl.program_id(0).to(tl.int64)  # int64: slot-pool strides times the slot index pass 2**31
    head = tl.program_id(1).to(tl.int64)
    dims_k = tl.arange(0, DIM_K_PAD)
    dims_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dims_k < DIM_K
    v_ok = dims_v < DIM_V

    q = tl.load(q_ptr + batch * stride_q_batch + head * stride_q_head + dims_k * stride_q_dim,
                mask=k_ok, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + batch * stride_k_batch + head * stride_k_head + dims_k * stride_k_dim,
                mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + batch * stride_v_batch + head * stride_v_head + dims_v * stride_v_dim,
                mask=v_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + batch * stride_g_batch + head * stride_g_head).to(tl.float32))

    tile = (state_ptr + batch * stride_state_batch + head * stride_state_head
            + dims_k[:, None] * stride_state_k + dims_v[None, :] * stride_state_v)
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32) * decay + k[:, None] * v[None, :]
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    # out from the fp32 state, before it is rounded to the state's dtype
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + batch * stride_out_batch + head * stride_out_head + dims_v * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=v_ok)


@functools.cache
def _jitted_kernel():
    return jit_kernels(globals(), _step_kernel)[0]


def retention_decay_step_triton(q, k, v, g, state, scale: float | None = None) -> torch.Tensor:
    _check_step_args(q, k, v, g, state)
    step_kernel = _jitted_kernel()
    batch, heads, dim_k = q.shape
    dim_v = v.shape[2]
    dim_k_pad = padded(dim_k)
    # the widest dv tile beside all of dk within the register budget, and at least 8 columns: a 32-byte sector a row
    block_v = min(padded(dim_v), max(8, _TILE_ELEMENTS // dim_k_pad))
    out = torch.empty(batch, heads, dim_v, dtype=q.dtype, device=q.device)
    step_kernel[(batch, heads, cdiv(dim_v, block_v))](
        q, k, v, g, state, out, dim_k ** -0.5 if scale is None else scale,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *state.stride(), *out.stride(),
        DIM_K=dim_k, DIM_K_PAD=dim_k_pad, DIM_V=dim_v, BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def retention_decay_step(q, k, v, g, state, scale: float | None = None) -> torch.Tensor:
    if use_triton(q, k, v, g, state):
        return retention_decay_step_triton(q, k, v, g, state, scale)
    return retention_decay_step_ref(q, k, v, g, state, scale)
