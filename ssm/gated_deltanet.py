"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"): linear
attention whose fixed-size state is edited by the delta rule and decayed by a Mamba-2-style scalar gate per head.

Per head h, with q_t, k_t in R^dk (L2-normalised, q also scaled by dk^-0.5) and v_t in R^dv:
    g_t = -exp(A_log) · softplus(a_t + dt_bias) <= 0,   alpha_t = exp(g_t),   beta_t = sigmoid(b_t)
    S_t = alpha_t S_{t-1} + beta_t k_t (v_t - alpha_t S_{t-1}^T k_t)^T          (S: [dk, dv])
    o_t = S_t^T q_t
The state transition alpha_t (I - beta_t k_t k_t^T) has eigenvalues alpha_t and alpha_t (1 - beta_t) (|k_t| = 1), all
positive with beta_t in (0, 1). eigenvalues="signed" (Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues") takes beta_t = 2 sigmoid(b_t) in (0, 2), so alpha_t (1 - beta_t) lies in
(-alpha_t, alpha_t): near beta_t = 2 a reflection, with which the recurrence can track parity. The kernels assume
nothing about beta's range.
q, k and v come through a short causal depthwise conv (width d_conv) and SiLU; the output is
RMSNorm(o_t) · SiLU(gate_t) per head (norm before gate), then out_proj.

Prefill and training run the chunked (WY/UT) form, decode one recurrent step (kernels/gated_delta.py). Per layer and
sequence the cache holds the conv's last d_conv - 1 inputs and the state [n_heads, dk, dv], in fp32.

Semantics (gate and decay parametrisation, L2 norm eps, norm-before-gate output) checked against transformers'
Qwen3-Next layer (Qwen3NextGatedDeltaNet) and flash-linear-attention's GatedDeltaNet; the projections are laid out
plainly (q, k, v, gate, b, a in one in_proj) rather than in Qwen3-Next's per-key-head interleaving.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.heads import default_head_dim
from cache.spec import CacheBatch, CacheSpec
from kernels import Linear
from kernels.gated_delta import gated_delta_chunked, gated_delta_step

L2_EPS = 1e-6  # inside the square root, as fla's l2norm and Qwen3-Next's
# the transition's eigenvalues: in (0, 1] with beta = sigmoid(b), in (-1, 1] with beta = 2 sigmoid(b)
EIGENVALUES = ("positive", "signed")


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


class GatedHeadNorm(nn.Module):
    """RMSNorm(o) · silu(gate) over each head's dv channels, one weight shared by the heads (norm before gate, as
    Qwen3-Next's RMSNormGated and fla's FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * o * F.silu(gate.float())


def checked_head_dim(d_model: int, n_heads: int, head_dim: int | None, expand_v: int, d_conv: int) -> int:
    """The sizes checked; head_dim with its default (d_model // n_heads) filled in."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    head_dim = default_head_dim(d_model, n_heads, head_dim)
    for name, value in (("head_dim", head_dim), ("expand_v", expand_v), ("d_conv", d_conv)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return head_dim


class GatedDeltaNet(nn.Module):
    # layers whose outputs meet in the query-key product (in_proj holds q and k with v and the gates): AWQ leaves
    # their weights unclipped (zoo/quantize.py)
    query_key_projections = ("in_proj",)

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        head_dim: int | None = None,
        expand_v: int = 1,
        d_conv: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-6,
        eigenvalues: str = "positive",
    ):
        """head_dim: each head's key width dk (default d_model // n_heads); its value width is dv = head_dim * expand_v.
        d_conv: width of the causal conv over q, k, v. chunk_size: tokens per chunk of the chunked (prefill) form.
        eigenvalues: "positive" (beta = sigmoid(b)) or "signed" (beta = 2 sigmoid(b), Grazzi et al. 2024)."""
        super().__init__()
        head_dim = checked_head_dim(d_model, n_heads, head_dim, expand_v, d_conv)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0 (it keeps the output RMSNorm finite), got {norm_eps}")
        if eigenvalues not in EIGENVALUES:
            raise ValueError(f"unknown eigenvalues {eigenvalues!r}; allowed: {', '.join(EIGENVALUES)}")
        self.eigenvalues = eigenvalues
        self.layer_idx, self.n_heads, self.head_dim, self.value_dim = layer_idx, n_heads, head_dim, head_dim * expand_v
        self.d_conv, self.chunk_size = d_conv, chunk_size
        key_width, value_width = n_heads * head_dim, n_heads * self.value_dim
        self.conv_dim = 2 * key_width + value_width  # channels through the conv: q, k, v
        # in_proj rows: q, k, v (through the conv), the output gate, then b (-> beta) and a (-> decay) per head
        self.in_proj = Linear(d_model, self.conv_dim + value_width + 2 * n_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.norm = GatedHeadNorm(self.value_dim, norm_eps)
        self.out_proj = Linear(value_width, d_model, bias=False)
        self.reset_decay_parameters()

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, head_dim: int | None, expand_v: int, d_conv: int,
                     **_) -> int:
        """Bytes of the parameters __init__ makes, from its arguments alone (the rest size nothing)."""
        head_dim = checked_head_dim(d_model, n_heads, head_dim, expand_v, d_conv)
        value_dim = head_dim * expand_v
        key_width, value_width = n_heads * head_dim, n_heads * value_dim
        conv_dim = 2 * key_width + value_width
        elements = (d_model * (conv_dim + value_width + 2 * n_heads)  # in_proj
                    + conv_dim * d_conv  # depthwise conv1d, no bias
                    + 2 * n_heads  # A_log, dt_bias
                    + value_dim  # the gated head norm, shared by the heads
                    + value_width * d_model)  # out_proj
        return elements * dtype.itemsize

    @torch.no_grad()
    def reset_decay_parameters(self, dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4) -> None:
        """fla's init: A uniform in (0, 16] (from 0.01, as Qwen3-Next, so log A stays finite), dt log-uniform in
        [dt_min, dt_max] stored through softplus^-1: decays alpha = exp(-A dt) start between ~0.2 and ~1."""
        self.A_log.copy_(torch.empty(self.n_heads).uniform_(0.01, 16).log())
        dt = torch.exp(torch.rand(self.n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt

    def cache_spec(self) -> CacheSpec:
        # fp32 whatever the model's dtype: S is a running, decayed sum that 16-bit floats stop resolving
        return CacheSpec(kind="state", state_shapes=(("conv", (self.conv_dim, self.d_conv - 1)),
                                                     ("ssm", (self.n_heads, self.head_dim, self.value_dim))),
                         state_dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions=None, cache=None, batch: CacheBatch | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. Without a cache: the chunked form from a zero state. With one
        (StateSlots): continue this batch's states (zeros on prefill), one recurrent step for a single decode token,
        then write them back. Positions are unused: the state carries the order."""
        b, t, _ = x.shape
        qkv, gate, beta_logit, a = self.in_proj(x).split(
            [self.conv_dim, self.n_heads * self.value_dim, self.n_heads, self.n_heads], dim=-1)
        states = cache.read(batch) if cache is not None else None
        history = qkv.new_zeros(b, self.conv_dim, self.d_conv - 1) if states is None else states["conv"]
        window = torch.cat([history.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # the conv's inputs, oldest first
        qkv, history = self.conv(window)
        q, k, v = self.heads(qkv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay, <= 0
        beta = self.write_strength(beta_logit.float())
        if states is not None and batch.is_decode:
            ssm = states["ssm"]  # updated in place by the step
            o = gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, 0], beta[:, 0], ssm).unsqueeze(2)
        elif states is not None and batch.checkpoints:  # the engine may keep any prefix: the state after each token
            ssm, outs, ssms = states["ssm"], [], []
            for i in range(t):
                outs.append(gated_delta_step(q[:, :, i], k[:, :, i], v[:, :, i], g[:, i], beta[:, i], ssm))
                ssms.append(ssm.clone())  # the step updates it in place
            o = torch.stack(outs, 2)
            # each token's conv history: the d_conv - 1 inputs ending at it
            histories = torch.stack([window[..., i + 1: i + self.d_conv] for i in range(t)], 1)
            cache.write_steps({"conv": histories, "ssm": torch.stack(ssms, 1)}, batch)
            return self.output(o, gate, x.dtype)
        else:
            if batch is not None and batch.padded:  # past a row's end: no decay, no write, so its state stops there
                real = batch.real_tokens().unsqueeze(-1)
                g, beta = g * real, beta * real
                index = batch.last_tokens()[:, None] + 1 + torch.arange(self.d_conv - 1, device=x.device)
                history = window.gather(2, index[:, None, :].expand(b, self.conv_dim, self.d_conv - 1))
            o, ssm = gated_delta_chunked(q, k, v, g.transpose(1, 2), beta.transpose(1, 2),
                                         None if states is None else states["ssm"], chunk_size=self.chunk_size)
        if cache is not None:
            cache.write({"conv": history, "ssm": ssm}, batch)
        return self.output(o, gate, x.dtype)

    def write_strength(self, beta_logit: torch.Tensor) -> torch.Tensor:
        """beta_t from b_t: sigmoid, doubled for signed eigenvalues (the positive range stays exactly sigmoid)."""
        beta = torch.sigmoid(beta_logit)
        return 2 * beta if self.eigenvalues == "signed" else beta

    def output(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [B, H, T, dv] -> gated norm, out_proj -> [B, T, d_model]."""
        y = self.norm(o.transpose(1, 2), gate.unflatten(-1, (self.n_heads, self.value_dim)))
        return self.out_proj(y.flatten(-2).to(dtype))

    def conv(self, window: torch.Tensor):
        """window [B, conv_dim, d_conv - 1 + T]: the d_conv - 1 inputs before this call, then its T -> silu(conv)
        [B, T, conv_dim] and the last d_conv - 1 inputs, the next call's history."""
        # not [..., -(d_conv - 1):], which with d_conv = 1 would keep everything instead of nothing
        history = window[..., window.shape[-1] - (self.d_conv - 1):]
        out = F.silu(F.conv1d(window, self.conv1d.weight, groups=self.conv_dim))
        return out.transpose(1, 2), history

    def heads(self, qkv: torch.Tensor):
        """[B, T, conv_dim] -> q, k [B, H, T, dk] (L2-normalised, fp32) and v [B, H, T, dv]."""
        key_width = self.n_heads * self.head_dim
        q, k, v = qkv.split([key_width, key_width, self.n_heads * self.value_dim], dim=-1)
        q, k = (l2_normalize(x.float().unflatten(-1, (self.n_heads, self.head_dim))).transpose(1, 2) for x in (q, k))
        return q, k, v.unflatten(-1, (self.n_heads, self.value_dim)).transpose(1, 2)

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer step by step in float64, written for clarity: the oracle for forward()."""
        f64 = torch.float64
        H, dk, dv, width = self.n_heads, self.head_dim, self.value_dim, self.d_conv
        projected = x.to(f64) @ self.in_proj.weight.to(f64).T
        qkv, gate, beta_logit, a = projected.split([self.conv_dim, H * dv, H, H], dim=-1)
        conv_weight = self.conv1d.weight.to(f64)[:, 0]  # [conv_dim, d_conv]; tap d_conv - 1 is the current input
        A = torch.exp(self.A_log.to(f64))
        batch, length, _ = x.shape
        out = torch.zeros(batch, length, H, dv, dtype=f64, device=x.device)
        for b in range(batch):
            S = torch.zeros(H, dk, dv, dtype=f64, device=x.device)
            for t in range(length):
                # causal conv: inputs t - d_conv + 1 .. t, zeros before the sequence
                mixed = sum(conv_weight[:, j] * qkv[b, t - (width - 1) + j] for j in range(width)
                            if t - (width - 1) + j >= 0)
                mixed = F.silu(mixed)
                q, k, v = mixed.split([H * dk, H * dk, H * dv])
                q, k, v = q.view(H, dk), k.view(H, dk), v.view(H, dv)
                q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(dk)
                k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
                alpha = torch.exp(-A * F.softplus(a[b, t] + self.dt_bias.to(f64)))  # [H]
                beta = torch.sigmoid(beta_logit[b, t]) * (2 if self.eigenvalues == "signed" else 1)
                for h in range(H):
                    recalled = alpha[h] * S[h].T @ k[h]  # what the decayed state returns for k
                    S[h] = alpha[h] * S[h] + beta[h] * torch.outer(k[h], v[h] - recalled)
                    o = S[h].T @ q[h]
                    rms = torch.sqrt((o * o).mean() + self.norm.eps)
                    z = gate[b, t, h * dv:(h + 1) * dv]
                    out[b, t, h] = self.norm.weight.to(f64) * (o / rms) * z * torch.sigmoid(z)
        return (out.flatten(-2) @ self.out_proj.weight.to(f64).T).to(x.dtype)
