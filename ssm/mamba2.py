"""Mamba-2 (SSD): a selective state-space mixer with a scalar decay per head, in plain PyTorch.

Weight names follow mamba-ssm's Mamba2 and HF's Mamba2Mixer (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj),
so state dicts move both ways. Per layer and sequence the cache holds the last d_conv inputs of the causal conv
(x, B and C channels) and the SSM state [n_heads, head_dim, d_state].

Recurrence per head h (heads h share the B/C group h // (n_heads / n_groups)):
    dt_t = softplus(dt_raw_t + dt_bias),  a_t = exp(dt_t · A)  with A = -exp(A_log)
    S_t = a_t · S_{t-1} + dt_t · x_t ⊗ B_t        (S: [head_dim, d_state])
    y_t = S_t · C_t + D · x_t
Prefill runs it as the chunked SSD scan (quadratic inside a chunk, the recurrence between chunks); decode is
one step of it. The output is RMSNorm(y · silu(z)) per group (norm_before_gate=False), then out_proj.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.norm import RMSNorm
from cache.spec import CacheBatch, CacheSpec
from cache.state_slots import StateSlots
from ssm.reference import mamba2_reference
from kernels import Linear, cpu_blocks, cpu_decode, selective_state_update


class GatedRMSNorm(nn.Module):
    """RMSNorm(x · silu(z)) over groups of `group_size` channels (mamba-ssm RMSNormGated, norm_before_gate=False)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(z.float())
        groups = x.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.flatten(-2).to(dtype)


class Mamba2(nn.Module):
    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        d_state: int = 64,
        d_conv: int = 4,
        expand: int = 2,
        head_dim: int = 64,
        n_groups: int = 1,
        chunk_size: int = 64,
        conv_bias: bool = True,
        bias: bool = False,
        norm_eps: float = 1e-5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
    ):
        super().__init__()
        d_inner = expand * d_model
        check_settings(d_model, d_state, d_conv, expand, head_dim, n_groups, chunk_size, dt_min, dt_max)
        self.layer_idx = layer_idx
        self.d_inner, self.d_state, self.d_conv = d_inner, d_state, d_conv
        self.head_dim, self.n_heads, self.n_groups = head_dim, d_inner // head_dim, n_groups
        self.chunk_size = chunk_size
        self.conv_dim = d_inner + 2 * n_groups * d_state  # channels through the conv: x, B, C
        # in_proj rows: z (gate), x, B, C, dt, in mamba-ssm's order
        self.in_proj = Linear(d_model, d_inner + self.conv_dim + self.n_heads, bias=bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=d_conv - 1,
                                bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.norm = GatedRMSNorm(d_inner, d_inner // n_groups, norm_eps)
        self.out_proj = Linear(d_inner, d_model, bias=bias)
        self.reset_ssm_parameters(dt_min, dt_max, dt_init_floor)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, d_state: int, d_conv: int, expand: int, head_dim: int,
                     n_groups: int, chunk_size: int, conv_bias: bool, bias: bool, dt_min: float, dt_max: float,
                     **_) -> int:
        """Bytes of the parameters __init__ makes, from its arguments alone (the rest size nothing)."""
        check_settings(d_model, d_state, d_conv, expand, head_dim, n_groups, chunk_size, dt_min, dt_max)
        d_inner = expand * d_model
        n_heads, conv_dim = d_inner // head_dim, d_inner + 2 * n_groups * d_state
        in_width = d_inner + conv_dim + n_heads
        elements = (d_model * in_width + (in_width + d_model if bias else 0)  # in_proj, out_proj biases
                    + conv_dim * (d_conv + (1 if conv_bias else 0))  # depthwise conv1d
                    + 3 * n_heads  # dt_bias, A_log, D
                    + d_inner  # the gated norm
                    + d_inner * d_model)  # out_proj
        return elements * dtype.itemsize

    @torch.no_grad()
    def reset_ssm_parameters(self, dt_min: float, dt_max: float, dt_init_floor: float) -> None:
        """mamba-ssm's init: A uniform in [1, 16], D = 1, dt log-uniform in [dt_min, dt_max] stored through softplus^-1."""
        self.A_log.copy_(torch.empty(self.n_heads).uniform_(1, 16).log())
        self.D.fill_(1.0)
        dt = torch.exp(torch.rand(self.n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kind="state", state_shapes=(("conv", (self.conv_dim, self.d_conv)),
                                                     ("ssm", (self.n_heads, self.head_dim, self.d_state))))

    def forward(self, x: torch.Tensor, positions=None, cache=None, batch: CacheBatch | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. Without a cache the scan starts from a zero state; with one
        (StateSlots) it starts from the sequences' states and writes the new ones back. Positions are not used."""
        b, t, _ = x.shape
        states = cache.read(batch) if cache is not None else None
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        if states is not None and batch.is_decode:
            y, conv_state, ssm_state = self.step(z[:, 0], xbc[:, 0], dt[:, 0], states["conv"], states["ssm"])
            y = y[:, None]
        elif states is not None and batch.checkpoints:  # the engine may keep any prefix: the state after each token
            y, steps = self.steps(z, xbc, dt, states["conv"], states["ssm"])
            cache.write_steps(steps, batch)
            return self.out_proj(y)
        else:
            y, conv_state, ssm_state = self.scan(z, xbc, dt, states, batch.last_tokens() if batch and batch.padded else None)
        if cache is not None:
            cache.write({"conv": conv_state, "ssm": ssm_state}, batch)
        return self.out_proj(y)

    def split_xbc(self, xbc: torch.Tensor):
        """[..., conv_dim] -> x [..., n_heads, head_dim], B and C [..., n_groups, d_state]."""
        x, B, C = xbc.split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        return (x.unflatten(-1, (self.n_heads, self.head_dim)), B.unflatten(-1, (self.n_groups, self.d_state)),
                C.unflatten(-1, (self.n_groups, self.d_state)))

    def scan(self, z, xbc, dt, states, last: torch.Tensor | None = None):
        """Whole-sequence path (uncached forward, prefill, or several new tokens of a running sequence). last [B]: each
        row's last real token in a right-padded batch, whose states are kept from there (None: the last of all)."""
        b = xbc.shape[0]
        xbc = xbc.transpose(1, 2)  # [B, conv_dim, T]
        if states is None:
            history = xbc.new_zeros(b, self.conv_dim, self.d_conv - 1)
            initial = None
        else:
            history, initial = states["conv"][..., 1:].to(xbc.dtype), states["ssm"]
        window = torch.cat([history, xbc], dim=-1)  # the d_conv - 1 inputs before this call, then this call's
        if last is None:
            conv_state = window[..., -self.d_conv:]  # t >= 1, so the window holds at least d_conv inputs
        else:  # the d_conv inputs ending at each row's last real token
            index = last[:, None] + torch.arange(self.d_conv, device=window.device)
            conv_state = window.gather(2, index[:, None, :].expand(b, self.conv_dim, self.d_conv))
        xbc = F.silu(F.conv1d(window, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)).transpose(1, 2)
        x, B, C = self.split_xbc(xbc)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if last is not None:  # dt = 0 past a row's end: decay 1 and no input, so its state stops at its last token
            dt = dt * (torch.arange(dt.shape[1], device=dt.device) <= last[:, None]).unsqueeze(-1)
        A = -torch.exp(self.A_log.float())
        y, ssm_state = ssd_scan(x, dt, A, B, C, self.chunk_size, D=self.D, initial_state=initial)
        y = self.norm(y.flatten(-2).to(z.dtype), z)
        return y, conv_state, ssm_state

    def steps(self, z, xbc, dt, conv_state, ssm_state):
        """A few new tokens one recurrent step at a time (a speculative verification): y [B, T, d_inner] and the
        states after each token, [B, T, ...] each."""
        ys, convs, ssms = [], [], []
        for i in range(xbc.shape[1]):
            y, conv_state, ssm_state = self.step(z[:, i], xbc[:, i], dt[:, i], conv_state, ssm_state)
            ys.append(y)
            convs.append(conv_state)
            ssms.append(ssm_state.clone())  # step updates it in place
        return torch.stack(ys, 1), {"conv": torch.stack(convs, 1), "ssm": torch.stack(ssms, 1)}

    def step(self, z, xbc, dt, conv_state, ssm_state):
        """One new token per sequence: z/xbc/dt [B, ...] -> y [B, d_inner] and the updated states."""
        conv_state = torch.cat([conv_state[..., 1:], xbc[..., None].to(conv_state.dtype)], dim=-1)
        xbc = (conv_state * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            xbc = xbc + self.conv1d.bias
        x, B, C = self.split_xbc(F.silu(xbc).to(z.dtype))
        p, n = self.head_dim, self.d_state
        # mamba-ssm's Mamba2.step: per-head dt, A, D and dt_bias broadcast over head_dim (and d_state) as views
        A = (-torch.exp(self.A_log.float()))[:, None, None].expand(-1, p, n)
        y = selective_state_update(ssm_state, x, dt[..., None].expand(-1, -1, p), A, B, C,
                                   D=self.D[:, None].expand(-1, p), dt_bias=self.dt_bias[:, None].expand(-1, p),
                                   dt_softplus=True)
        y = self.norm(y.flatten(-2), z)
        return y, conv_state, ssm_state

    def decode_residual(self, norm: nn.Module, x: torch.Tensor, positions, cache, batch: CacheBatch | None
                        ) -> torch.Tensor | None:
        """x + self(norm(x), ...) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere,
        where the block runs the two modules."""
        half = self.decode_half(norm, x, cache, batch)
        return None if half is None else cpu_blocks.run_half(half, x, positions, batch)

    def decode_half(self, norm: nn.Module, x: torch.Tensor, cache, batch: CacheBatch | None
                    ) -> "cpu_blocks.Half | None":
        """This layer's half of an eager CPU one-token decode step over the engine's state slots in x's dtype, after
        an RMSNorm, with plain bias-free projections on the C GEMV; None elsewhere."""
        if (batch is None or batch.step != "decode" or batch.checkpoints or batch.padded
                or type(cache) is not StateSlots or type(norm) is not RMSNorm or type(self) is not Mamba2
                or type(self.norm) is not GatedRMSNorm
                or {"forward", "step", "split_xbc"} & vars(self).keys()):  # the fused half computes these itself
            return None
        weights = cpu_blocks.half_weights(self, norm, ("in_proj", "out_proj"))
        conv, ssm, conv_bias = cache.tensors["conv"], cache.tensors["ssm"], self.conv1d.bias
        # every parameter in x's dtype: the half reads them as they are (kernels/cpu/mamba2_half.c)
        if (weights is None or not cpu_blocks.gemv_half_fits(x, weights, norm.weight, self.conv1d.weight, self.dt_bias,
                                                             self.A_log, self.D, self.norm.weight,
                                                             *(() if conv_bias is None else (conv_bias,)))
                or conv.dtype != x.dtype or ssm.dtype != x.dtype or not cpu_decode.state_update_fits(ssm)):
            return None
        return cpu_blocks.Half("mamba2", (norm.weight, weights[0], self.conv1d.weight[:, 0], self.conv1d.bias,
                                          self.dt_bias, self.A_log, self.D, self.norm.weight, weights[1]),
                               (conv, ssm), (norm.eps, self.norm.eps), (self.n_groups,))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 oracle: the recurrence, one token at a time (ssm/reference.py)."""
        return mamba2_reference(self, x)


def divisors(n: int) -> list[int]:
    """n's divisors in order, found up to its square root (an inner width may be 2^27)."""
    low = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return low + [n // k for k in reversed(low) if k * k != n]


def check_settings(d_model, d_state, d_conv, expand, head_dim, n_groups, chunk_size, dt_min, dt_max) -> None:
    if d_model < 1 or expand < 1:
        raise ValueError(f"d_model and expand must be >= 1, got d_model={d_model}, expand={expand}")
    if d_state <= 0:
        raise ValueError(f"d_state (SSM state size per head channel) must be >= 1, got {d_state}")
    if d_conv < 1:
        raise ValueError(f"d_conv (causal conv width) must be >= 1, got {d_conv}")
    d_inner = expand * d_model
    if head_dim < 1 or d_inner % head_dim:
        raise ValueError(f"head_dim={head_dim} must divide expand*d_model={d_inner}; "
                         f"allowed head_dim: {divisors(d_inner)}")
    n_heads = d_inner // head_dim
    if n_groups < 1 or n_heads % n_groups:
        raise ValueError(f"n_heads={n_heads} (expand*d_model/head_dim) is not divisible by n_groups={n_groups}; "
                         f"allowed n_groups: {divisors(n_heads)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")


def ssd_scan(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None):
    """The chunked SSD scan: x [b, t, h, p], dt [b, t, h] (after softplus), A [h] (negative), B, C [b, t, g, n],
    D [h], initial_state [b, h, p, n] -> (y [b, t, h, p], final state [b, h, p, n]).

    Computes in float32 (float64 stays float64); y is returned in x's dtype, the state in float32/64."""
    if x.is_cuda:
        fused = cuda_chunk_scan()
        if fused is not None:
            y, final = fused(x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=True)
            return y, final
    return ssd_scan_ref(x, dt, A, B, C, chunk_size, D=D, initial_state=initial_state)


_CUDA_SCAN = []


def cuda_chunk_scan():
    """mamba-ssm's fused Triton scan when it is installed; imported on first CUDA use only (never on CPU)."""
    if not _CUDA_SCAN:
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        except ImportError:
            mamba_chunk_scan_combined = None
        _CUDA_SCAN.append(mamba_chunk_scan_combined)
    return _CUDA_SCAN[0]


def ssd_scan_ref(x, dt, A, B, C, chunk_size: int, D=None, initial_state=None):
    """ssd_scan in PyTorch. Heads are split as (group g, head within group r); l and s index positions in a chunk."""
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    compute = torch.promote_types(x.dtype, torch.float32)
    out_dtype = x.dtype
    q = chunk_size
    chunks = max(1, -(-t // q))
    pad = chunks * q - t  # padded steps get dt = 0: no decay, no input, so the final state is the state after t

    def chunked(v, *inner):
        v = v.to(compute)
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad))
        return v.reshape(b, chunks, q, *inner)

    x, dt = chunked(x, g, r, p), chunked(dt, g, r)
    B, C = chunked(B, g, n), chunked(C, g, n)
    a = dt * A.to(compute).view(g, r)  # log decay per step [b, c, l, g, r]
    xdt = x * dt[..., None]
    cum = a.cumsum(2)
    # Decay from step s to step l within a chunk: exp(sum of a over (s, l]); summed per entry for precision.
    seg = a.permute(0, 1, 3, 4, 2)[..., :, None].expand(*a.shape[:2], g, r, q, q)  # [b, c, g, r, l, s]: a_l
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    strict = causal.tril(-1)
    decay = seg.masked_fill(~strict, 0).cumsum(-2).masked_fill(~causal, -math.inf).exp()
    scores = torch.einsum("bclgn,bcsgn->bcgls", C, B)[:, :, :, None] * decay  # [b, c, g, r, l, s]
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xdt)
    # Each chunk's contribution to the state at its end, then the recurrence across chunks.
    to_end = torch.exp(cum[:, :, -1:] - cum)
    contrib = torch.einsum("bclgn,bclgrp->bcgrpn", B, xdt * to_end[..., None])
    chunk_decay = torch.exp(cum[:, :, -1])  # [b, c, g, r]
    state = (torch.zeros(b, g, r, p, n, dtype=compute, device=x.device) if initial_state is None
             else initial_state.to(compute).reshape(b, g, r, p, n))
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * chunk_decay[:, c, ..., None, None] + contrib[:, c]
    starts = torch.stack(starts, 1)  # state entering each chunk [b, c, g, r, p, n]
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", C, starts) * cum.exp()[..., None]
    y = y.reshape(b, chunks * q, h, p)[:, :t]
    if D is not None:
        y = y + x.reshape(b, chunks * q, h, p)[:, :t] * D.to(compute)[:, None]
    return y.to(out_dtype), state.reshape(b, h, p, n)
