"""RWKV-7's state update (Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State Evolution"): a decode step
(Triton beside its PyTorch reference) and the chunked form for prefill and training.

Per (batch, head), with the state S [dk, dv] (keys along rows: the transpose of the paper's [dv, dk] S), a per-channel
log decay log_w_t <= 0 ([dk]), the removal key kk_t (L2-normalised, [dk]), the in-context learning rate a_t in
(0, 1)^dk, the key k_t, value v_t and receptance r_t:

    S_t = (diag(w_t) - (a_t * kk_t) kk_t^T) S_{t-1} + k_t v_t^T,     w_t = exp(log_w_t)
    out_t = S_t^T r_t                                                   (no 1/sqrt(dk) scale, as RWKV-7)

The paper writes it as S_t = S_{t-1} (diag(w_t) - kk_t^T (a_t * kk_t)) + v_t^T k_t with S [dv, dk]; transposing gives
the line above. It is flash-linear-attention's diagonal-plus-low-rank (DPLR) rule with its read vector -kk_t and write
vector kk_t * a_t (fla's `chunk_rwkv7(r, w, k, v, a=-kk, b=kk * a)`). The low-rank part reads the state before the
decay: the transition is diag(w) plus a rank-one term, not diag(w) times one. Each column of S (one value channel)
evolves on its own, as in the delta rule.

- `rwkv7_step`: one token per (batch, head); r, log_w, k, kk, a [B, H, dk], v [B, H, dv]; the state [B, H, dk, dv]
  is updated in place (normally the engine's per-slot rows). Returns out [B, H, dv].
- `rwkv7_chunked`: prefill and training (PyTorch, differentiable); the same names with a T axis, [B, H, T, ...],
  and an optional initial state (None = zeros). Returns (out, final state), new tensors.

Arithmetic in fp32 (fp64 stays fp64 in the chunked form); outputs in r's dtype; states in the dtype of the state
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

# fp32 elements of a program's [dk, dv-tile] slice of S. The step is memory-bound, so registers go to occupancy: with
# five key-side vectors beside the tile (the gated delta step has two), 2048 compiled to 160 registers a thread at
# dk = 64 for sm_80 and 1024 to 80 (4 warps; tests/kernels/gpu_compile.py's "rwkv7-step"; not timed on hardware)
_TILE_ELEMENTS = 1024
KEY_SIDE = ("r", "log_w", "k", "kk", "a")  # the per-key-channel inputs, [.., dk] each


def _check_shapes(key_side: dict, v: torch.Tensor, state, lead: int) -> None:
    """lead: 2 for a step's [B, H], 3 for a sequence's [B, H, T]."""
    r = key_side["r"]
    if r.dim() != lead + 1 or v.dim() != lead + 1 or v.shape[:lead] != r.shape[:lead]:
        layout = "[B, H, dk] and v [B, H, dv]" if lead == 2 else "[B, H, T, dk] and v [B, H, T, dv]"
        raise ValueError(f"expected r, log_w, k, kk, a {layout}, got r {tuple(r.shape)} and v {tuple(v.shape)}")
    for name, tensor in key_side.items():
        if tensor.shape != r.shape:
            raise ValueError(f"expected {name} {tuple(r.shape)} like r, got {tuple(tensor.shape)}")
    want = (*r.shape[:2], r.shape[-1], v.shape[-1])
    if state is not None and tuple(state.shape) != want:
        raise ValueError(f"expected state {want}, got {tuple(state.shape)}")


def rwkv7_step_ref(r, log_w, k, v, kk, a, state) -> torch.Tensor:
    _check_shapes(dict(r=r, log_w=log_w, k=k, kk=kk, a=a), v, state, lead=2)
    out_dtype = r.dtype
    r, log_w, k, v, kk, a = (t.float() for t in (r, log_w, k, v, kk, a))
    old = state.float()
    recalled = torch.einsum("bhk,bhkv->bhv", kk, old)  # what the old state returns for the removal key
    new_state = (old * log_w.exp()[..., None] - (kk * a)[..., None] * recalled[..., None, :]
                 + k[..., None] * v[..., None, :])
    state.copy_(new_state)
    return torch.einsum("bhk,bhkv->bhv", r, new_state).to(out_dtype)


def rwkv7_chunked(r, log_w, k, v, kk, a, state=None, chunk_size: int = 16):
    """Within a chunk of C steps, with G_i = log_w_1 + ... + log_w_i per channel (G_0 = 0), write the rank-one
    term's contribution as b_j u_j^T with b_j = -(a_j * kk_j) and u_j = S_{j-1}^T kk_j. Then

        S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} (b_j u_j^T + k_j v_j^T)             (e^{..} along dk)
        u_i = (kk_i e^{G_{i-1}})^T S_0 + sum_{j<i} <kk_i e^{G_{i-1} - G_j}, b_j> u_j + <kk_i e^{G_{i-1} - G_j}, k_j> v_j

    so the u solve the unit-lower-triangular system (I - A_kb) u = A_kk v + (kk e^{G_prev}) S_0: the WY/UT form of the
    DPLR transition (as fla's dplr chunkwise form). Outputs are C x C contractions plus the read of S_0; the chunks
    are then chained by the state recurrence. The relative decays are built as [C, C, dk] tensors from the exponents
    G_i - G_j (j <= i) and G_{i-1} - G_j (j < i), masked to -inf elsewhere before exp, so every exponent taken is
    <= 0 and nothing overflows however strong the decay (hence a small C). A sequence shorter than chunk_size is one
    chunk of its own length (the chunk length changes rounding only, not the result).
    """
    _check_shapes(dict(r=r, log_w=log_w, k=k, kk=kk, a=a), v, state, lead=3)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    batch, heads, length, dim_k = r.shape
    dim_v = v.shape[3]
    out_dtype, compute = r.dtype, torch.promote_types(r.dtype, torch.float32)
    size = max(1, min(chunk_size, length))
    chunks = max(1, cdiv(length, size))  # T = 0 still runs one all-padding step, which returns the state unchanged
    pad = chunks * size - length  # padded steps: no decay (log_w = 0), no removal (a = 0), no write (k = 0)

    def chunked(x):  # [b, h, t, d] -> [b, h, chunks, size, d], zero-padded, in the compute dtype
        x = F.pad(x.to(compute), (0, 0, 0, pad))
        return x.reshape(batch, heads, chunks, size, x.shape[-1])

    r, log_w, k, v, kk, a = (chunked(t) for t in (r, log_w, k, v, kk, a))
    write = -(kk * a)  # b_j: where the removed recall is written
    cumulative = log_w.cumsum(-2)  # G_i [b, h, n, C, dk]
    previous = cumulative - log_w  # G_{i-1}: the sums before each step's own decay
    steps = torch.arange(size, device=r.device)
    through = steps[:, None] >= steps[None, :]  # j <= i
    before = steps[:, None] > steps[None, :]  # j < i
    # [b, h, n, C(i), C(j), dk]: e^{G_i - G_j} for j <= i and e^{G_{i-1} - G_j} for j < i, zero elsewhere
    decay_through = relative_decay(cumulative, cumulative, through)
    decay_before = relative_decay(previous, cumulative, before)
    system = torch.einsum("...ic,...jc,...ijc->...ij", kk, write, decay_before)  # A_kb, strictly lower
    reads_v = torch.einsum("...ic,...jc,...ijc->...ij", kk, k, decay_before)  # A_kk
    rhs = torch.cat([reads_v @ v, kk * previous.exp()], dim=-1)
    # the solver reads only the strict lower triangle and takes the diagonal as ones: it solves (I - A_kb) x = rhs
    solved = torch.linalg.solve_triangular(-system, rhs, upper=False, unitriangular=True)
    values, state_reads = solved.split([dim_v, dim_k], dim=-1)  # u = values + state_reads @ S_0
    out_b = torch.einsum("...ic,...jc,...ijc->...ij", r, write, decay_through)
    out_k = torch.einsum("...ic,...jc,...ijc->...ij", r, k, decay_through)
    r_read = r * cumulative.exp()  # reads S_0 decayed to each step
    to_end = (cumulative[..., -1:, :] - cumulative).exp()  # e^{G_C - G_j}: each write decayed to the chunk's end
    write_end, k_end = write * to_end, k * to_end
    chunk_decay = cumulative[..., -1, :].exp()[..., None]  # [b, h, n, dk, 1]

    carried = (torch.zeros(batch, heads, dim_k, dim_v, dtype=compute, device=r.device) if state is None
               else state.to(compute))
    outs = []
    for c in range(chunks):  # out of place throughout, so autograd can follow the chain of states
        u = values[:, :, c] + state_reads[:, :, c] @ carried
        outs.append(r_read[:, :, c] @ carried + out_b[:, :, c] @ u + out_k[:, :, c] @ v[:, :, c])
        carried = (carried * chunk_decay[:, :, c] + write_end[:, :, c].transpose(-1, -2) @ u
                   + k_end[:, :, c].transpose(-1, -2) @ v[:, :, c])
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * size, dim_v)[:, :, :length]
    return out.to(out_dtype), carried.to(torch.float32 if state is None else state.dtype)


def relative_decay(later: torch.Tensor, earlier: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """e^{later_i - earlier_j} [.., C, C, dk] where keep[i, j], else 0; the exponent is masked before exp, so the
    positive ones (past the diagonal) are never taken."""
    exponent = later[..., :, None, :] - earlier[..., None, :, :]
    return exponent.masked_fill(~keep[:, :, None], -math.inf).exp()


def _step_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, kk_ptr, a_ptr, state_ptr, out_ptr,
    stride_r_batch, stride_r_head, stride_r_dim,
    stride_w_batch, stride_w_head, stride_w_dim,
    stride_k_batch, stride_k_head, stride_k_dim,
    stride_v_batch, stride_v_head, stride_v_dim,
    stride_kk_batch, stride_kk_head, stride_kk_dim,
    stride_a_batch, stride_a_head, stride_a_dim,
    stride_state_batch, stride_state_head, stride_state_k, stride_state_v,
    stride_out_batch, stride_out_head, stride_out_dim,
    DIM_K: tl.constexpr, DIM_K_PAD: tl.constexpr, DIM_V: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # one program per (batch, head, dv tile): each column of S evolves on its own (the transition acts on dk, and
    # S^T kk reads one column at a time), so a program needs all of dk but only its dv columns
    batch = tl.program_id(0).to(tl.int64)  # int64: slot-pool strides times the slot index pass 2**31
    head = tl.program_id(1).to(tl.int64)
    dims_k = tl.arange(0, DIM_K_PAD)
    dims_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dims_k < DIM_K
    v_ok = dims_v < DIM_V

    r = tl.load(r_ptr + batch * stride_r_batch + head * stride_r_head + dims_k * stride_r_dim,
                mask=k_ok, other=0.0).to(tl.float32)
    # padded key channels: log_w 0 (w 1) keeps their zero rows zero
    w = tl.exp(tl.load(w_ptr + batch * stride_w_batch + head * stride_w_head + dims_k * stride_w_dim,
                       mask=k_ok, other=0.0).to(tl.float32))
    k = tl.load(k_ptr + batch * stride_k_batch + head * stride_k_head + dims_k * stride_k_dim,
                mask=k_ok, other=0.0).to(tl.float32)
    kk = tl.load(kk_ptr + batch * stride_kk_batch + head * stride_kk_head + dims_k * stride_kk_dim,
                 mask=k_ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + batch * stride_a_batch + head * stride_a_head + dims_k * stride_a_dim,
                mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + batch * stride_v_batch + head * stride_v_head + dims_v * stride_v_dim,
                mask=v_ok, other=0.0).to(tl.float32)

    tile = (state_ptr + batch * stride_state_batch + head * stride_state_head
            + dims_k[:, None] * stride_state_k + dims_v[None, :] * stride_state_v)
    tile_ok = k_ok[:, None] & v_ok[None, :]
    state = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32)
    recalled = tl.sum(state * kk[:, None], axis=0)  # S^T kk from the state before the decay
    state = state * w[:, None] - (kk * a)[:, None] * recalled[None, :] + k[:, None] * v[None, :]
    tl.store(tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)
    # out from the fp32 state, before it is rounded to the state's dtype
    out = tl.sum(state * r[:, None], axis=0)
    tl.store(out_ptr + batch * stride_out_batch + head * stride_out_head + dims_v * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=v_ok)


@functools.cache
def _jitted_kernel():
    return jit_kernels(globals(), _step_kernel)[0]


def rwkv7_step_triton(r, log_w, k, v, kk, a, state) -> torch.Tensor:
    _check_shapes(dict(r=r, log_w=log_w, k=k, kk=kk, a=a), v, state, lead=2)
    step_kernel = _jitted_kernel()
    batch, heads, dim_k = r.shape
    dim_v = v.shape[2]
    dim_k_pad = padded(dim_k)
    # the widest dv tile beside all of dk within the register budget, and at least 8 columns: a 32-byte sector a row
    block_v = min(padded(dim_v), max(8, _TILE_ELEMENTS // dim_k_pad))
    out = torch.empty(batch, heads, dim_v, dtype=r.dtype, device=r.device)
    step_kernel[(batch, heads, cdiv(dim_v, block_v))](
        r, log_w, k, v, kk, a, state, out,
        *r.stride(), *log_w.stride(), *k.stride(), *v.stride(), *kk.stride(), *a.stride(), *state.stride(),
        *out.stride(),
        DIM_K=dim_k, DIM_K_PAD=dim_k_pad, DIM_V=dim_v, BLOCK_V=block_v,
        num_warps=4,
    )
    return out


def rwkv7_step(r, log_w, k, v, kk, a, state) -> torch.Tensor:
    if use_triton(r, log_w, k, v, kk, a, state):
        return rwkv7_step_triton(r, log_w, k, v, kk, a, state)
    return rwkv7_step_ref(r, log_w, k, v, kk, a, state)
