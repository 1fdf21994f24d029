"""One Mamba decode step for a batch of slots: the selective-scan recurrence advanced by one token.

mamba-ssm's `selective_state_update` semantics and signature. Two layouts:

- Mamba-1: state [B, dim, N]; x, dt, z [B, dim]; A [dim, N]; B, C [B, N]; D, dt_bias [dim].
- Mamba-2: state [B, H, P, N]; x, dt, z [B, H, P]; A [H, P, N]; B, C [B, G, N]; D, dt_bias [H, P].
  Head h reads group h // (H // G). Mamba-2 callers pass their per-head dt, A, D and dt_bias as
  stride-0 expanded views over P (and N): every input may have any strides, 0 included.

    dt <- softplus(dt + dt_bias)            (bias and softplus each optional)
    state <- state * exp(A * dt) + (dt * B) * x      (B broadcast over P, x over N)
    y <- sum_N(state * C) + D * x,   then y * silu(z) when z is given

`state` is updated in place (it is normally a view of the engine's per-slot pool). Arithmetic in
fp32; the state is stored back in its own dtype and y returned in x's dtype. y is taken from the
fp32 state before it is rounded to the state dtype (as mamba-ssm's Triton kernel does).
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch
import torch.nn.functional as F

from . import cpu_decode
from .dispatch import jit_kernels, use_cpu_kernel, use_triton
from .tiles import padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call

# state tile elements per program: with fp32 arithmetic, 2048 keeps state, dA, dB and their products
# in registers at 4 warps; the step is memory-bound (each state element is read and written once)
_TILE_ELEMENTS = 2048


def _as_multihead(state, x, dt, A, B, C, D, z, dt_bias):
    """Validate shapes (in the caller's layout, so errors name the tensors as passed) and view the Mamba-1
    layout as Mamba-2's with one head and one group: views only, so the in-place update reaches the caller."""
    if state.dim() not in (3, 4):
        raise ValueError(f"expected state [B, dim, N] (Mamba-1) or [B, H, P, N] (Mamba-2), got {tuple(state.shape)}")
    mamba1 = state.dim() == 3
    rows, dstate = tuple(state.shape[:-1]), state.shape[-1]  # (B, dim) or (B, H, P)
    per_row = rows[1:]  # (dim,) or (H, P)
    for name, tensor, shape in [("x", x, rows), ("dt", dt, rows), ("z", z, rows), ("A", A, (*per_row, dstate)),
                                ("D", D, per_row), ("dt_bias", dt_bias, per_row)]:
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} for state {tuple(state.shape)}")
    expected_bc = "[B, N]" if mamba1 else "[B, G, N]"
    if B.dim() != 3 - mamba1 or B.shape != C.shape or B.shape[0] != rows[0] or B.shape[-1] != dstate:
        raise ValueError(f"expected B and C {expected_bc} with B = {rows[0]}, N = {dstate} for state "
                         f"{tuple(state.shape)}, got {tuple(B.shape)} and {tuple(C.shape)}")
    if mamba1:
        state, A, B, C = state.unsqueeze(1), A.unsqueeze(0), B.unsqueeze(1), C.unsqueeze(1)
        x, dt = x.unsqueeze(1), dt.unsqueeze(1)
        z = None if z is None else z.unsqueeze(1)
        D = None if D is None else D.unsqueeze(0)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
    if B.shape[1] == 0 or state.shape[1] % B.shape[1]:
        raise ValueError(f"{state.shape[1]} heads do not split into {B.shape[1]} groups")
    return state, x, dt, A, B, C, D, z, dt_bias


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    out_shape = x.shape
    state, x, dt, A, B, C, D, z, dt_bias = _as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
    heads_per_group = state.shape[1] // B.shape[1]
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A.float() * dt[..., None])  # [B, H, P, N]
    B = B.float().repeat_interleave(heads_per_group, dim=1)  # [B, H, N]: head h reads group h // heads_per_group
    C = C.float().repeat_interleave(heads_per_group, dim=1)
    new_state = state.float() * decay + (dt[..., None] * B[:, :, None, :]) * x.float()[..., None]
    state.copy_(new_state)
    y = (new_state * C[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.float() * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype).reshape(out_shape)


def _update_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, out_ptr,
    heads_per_group,
    stride_state_batch, stride_state_head, stride_state_dim, stride_state_n,
    stride_x_batch, stride_x_head, stride_x_dim,
    stride_dt_batch, stride_dt_head, stride_dt_dim,
    stride_dt_bias_head, stride_dt_bias_dim,
    stride_A_head, stride_A_dim, stride_A_n,
    stride_B_batch, stride_B_group, stride_B_n,
    stride_C_batch, stride_C_group, stride_C_n,
    stride_D_head, stride_D_dim,
    stride_z_batch, stride_z_head, stride_z_dim,
    stride_out_batch, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr, DSTATE: tl.constexpr, DSTATE_PAD: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    row_tile = tl.program_id(0)
    # int64: a slot pool's batch stride times the slot index can pass 2**31 elements
    batch = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    group = head // heads_per_group

    rows = row_tile * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    cols = tl.arange(0, DSTATE_PAD)
    row_ok = rows < HEAD_DIM
    col_ok = cols < DSTATE
    tile_ok = row_ok[:, None] & col_ok[None, :]

    x = tl.load(x_ptr + batch * stride_x_batch + head * stride_x_head + rows * stride_x_dim,
                mask=row_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + batch * stride_dt_batch + head * stride_dt_head + rows * stride_dt_dim,
                 mask=row_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + head * stride_dt_bias_head + rows * stride_dt_bias_dim,
                      mask=row_ok, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        # torch's softplus threshold: above 20, log(1 + e^dt) == dt in fp32 and exp could overflow
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    A = tl.load(A_ptr + head * stride_A_head + rows[:, None] * stride_A_dim + cols[None, :] * stride_A_n,
                mask=tile_ok, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + batch * stride_B_batch + group * stride_B_group + cols * stride_B_n,
                mask=col_ok, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + batch * stride_C_batch + group * stride_C_group + cols * stride_C_n,
                mask=col_ok, other=0.0).to(tl.float32)

    state_tile = (state_ptr + batch * stride_state_batch + head * stride_state_head
                  + rows[:, None] * stride_state_dim + cols[None, :] * stride_state_n)
    state = tl.load(state_tile, mask=tile_ok, other=0.0).to(tl.float32)
    state = state * tl.exp(A * dt[:, None]) + (dt[:, None] * B[None, :]) * x[:, None]
    tl.store(state_tile, state.to(state_ptr.dtype.element_ty), mask=tile_ok)

    y = tl.sum(state * C[None, :], axis=1)  # padded columns hold 0: A, B, C and the state load are masked to 0
    if HAS_D:
        y += x * tl.load(D_ptr + head * stride_D_head + rows * stride_D_dim, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + batch * stride_z_batch + head * stride_z_head + rows * stride_z_dim,
                    mask=row_ok, other=0.0).to(tl.float32)
        y *= z * tl.sigmoid(z)
    tl.store(out_ptr + batch * stride_out_batch + head * stride_out_head + rows * stride_out_dim,
             y.to(out_ptr.dtype.element_ty), mask=row_ok)


@functools.cache
def _jitted_kernels():
    return jit_kernels(globals(), _update_kernel)[0]


def selective_state_update_triton(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    out_shape = x.shape
    state, x, dt, A, B, C, D, z, dt_bias = _as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
    update_kernel = _jitted_kernels()
    batch, num_heads, head_dim, dstate = state.shape
    dstate_pad = padded(dstate, minimum=1)
    rows_per_program = min(padded(head_dim, minimum=1), max(1, _TILE_ELEMENTS // dstate_pad))
    out = torch.empty(batch, num_heads, head_dim, dtype=x.dtype, device=x.device)

    def strides(tensor, ndim):
        # an absent optional input: its pointer is never read (the HAS_* flag is off)
        return tensor.stride() if tensor is not None else (0,) * ndim

    grid = (-(-head_dim // rows_per_program), batch, num_heads)
    update_kernel[grid](
        state, x, dt, x if dt_bias is None else dt_bias, A, B, C, x if D is None else D, x if z is None else z, out,
        num_heads // B.shape[1],
        *state.stride(), *x.stride(), *dt.stride(), *strides(dt_bias, 2), *A.stride(), *B.stride(), *C.stride(),
        *strides(D, 2), *strides(z, 3), *out.stride(),
        HEAD_DIM=head_dim, DSTATE=dstate, DSTATE_PAD=dstate_pad, ROWS_PER_PROGRAM=rows_per_program,
        HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None, HAS_Z=z is not None, DT_SOFTPLUS=bool(dt_softplus),
        num_warps=4,
    )
    return out.reshape(out_shape)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    tensors = [t for t in (state, x, dt, A, B, C, D, z, dt_bias) if t is not None]
    if use_triton(*tensors):
        return selective_state_update_triton(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    if use_cpu_kernel(*tensors) and cpu_decode.state_update_fits(state):
        out_shape = x.shape
        args = _as_multihead(state, x, dt, A, B, C, D, z, dt_bias)
        return cpu_decode.selective_state_update_cpu(*args, dt_softplus=dt_softplus).reshape(out_shape)
    return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
