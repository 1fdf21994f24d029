"""Multi-scale retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large Language Models"):
linear attention with a fixed, per-head exponential decay and rotary positions.

Per head h = 0 .. H-1, with q_t, k_t in R^dk (RoPE-rotated by their absolute positions) and v_t in R^dv:
    gamma_h = 1 - 2^(-5-h)                              (the paper's multi-scale decays, section 2.2)
    S_t = gamma_h S_{t-1} + k_t v_t^T                   (S: [dk, dv])
    o_t = S_t^T (q_t / sqrt(dk))
so that o_t = sum_{s<=t} gamma_h^(t-s) (q_t . k_s / sqrt(dk)) v_s: RoPE makes q_t . k_s depend on t - s, as the
paper's e^{i theta n} (xPos without its length-extrapolation scaling). dk^-0.5 goes on q, as in
flash-linear-attention's retention kernels (the paper's pseudocode puts it on k: the same outputs, a state dk^0.5
times larger here). The value head is expand_v (default 2) times the key head, as in the paper and fla's layer.
The output is RMSNorm(o_t) * swish(g_t) per head (one norm weight shared by the heads), then o_proj: fla's
MultiScaleRetention (fla/layers/multiscale_retention.py, its FusedRMSNormGated path), which replaces the paper's
GroupNorm with an RMSNorm; RoPE in the rotate-half layout, as fla's default.

Prefill and training run the chunked form, decode one recurrent step (kernels/retention_decay.py). Per layer and
sequence the cache holds only the state [n_heads, dk, dv], in fp32.
"""
import math

import torch
from torch import nn

from attention.heads import default_head_dim
from attention.rope import RotaryEmbedding, apply_rope
from cache.spec import CacheBatch, CacheSpec
from kernels import Linear
from kernels.retention_decay import retention_decay_chunked, retention_decay_step
from ssm.gated_deltanet import GatedHeadNorm


def checked_head_dim(d_model: int, n_heads: int, head_dim: int | None, expand_v: int) -> int:
    """The sizes checked; head_dim with its default (d_model // n_heads) filled in."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    head_dim = default_head_dim(d_model, n_heads, head_dim)
    for name, value in (("head_dim", head_dim), ("expand_v", expand_v)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if head_dim % 2:  # RoPE turns channels in pairs
        raise ValueError(f"head_dim must be even (RoPE rotates pairs of channels), got {head_dim}")
    return head_dim


def check_settings(chunk_size: int, norm_eps: float, rope_base: float) -> None:
    """The settings that size nothing."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not norm_eps > 0:
        raise ValueError(f"norm_eps must be > 0 (it keeps the output RMSNorm finite), got {norm_eps}")
    if not rope_base > 0:
        raise ValueError(f"rope_base must be > 0 (RoPE's frequencies are its negative powers), got {rope_base}")


def log_decays(n_heads: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """log gamma_h = log(1 - 2^(-5-h)), [n_heads]; log1p keeps it exact where gamma_h is within 2^-24 of 1."""
    exponents = -5.0 - torch.arange(n_heads, device=device, dtype=dtype)
    return torch.log1p(-(2.0 ** exponents))


class MultiScaleRetention(nn.Module):
    # layers whose outputs meet in the query-key product: AWQ leaves their weights unclipped (zoo/quantize.py)
    query_key_projections = ("q_proj", "k_proj")

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        head_dim: int | None = None,
        expand_v: int = 2,
        chunk_size: int = 64,
        norm_eps: float = 1e-6,
        rope_base: float = 10000.0,
    ):
        """head_dim: each head's key width dk (default d_model // n_heads, even for RoPE); its value width is
        dv = head_dim * expand_v. chunk_size: tokens per chunk of the chunked (prefill) form. norm_eps: the output
        RMSNorm's. rope_base: RoPE's base (the model's, unless given)."""
        super().__init__()
        head_dim = checked_head_dim(d_model, n_heads, head_dim, expand_v)
        check_settings(chunk_size, norm_eps, rope_base)
        self.layer_idx, self.n_heads, self.head_dim, self.value_dim = layer_idx, n_heads, head_dim, head_dim * expand_v
        self.chunk_size, self.rope_base = chunk_size, rope_base
        key_width, value_width = n_heads * head_dim, n_heads * self.value_dim
        self.q_proj = Linear(d_model, key_width, bias=False)
        self.k_proj = Linear(d_model, key_width, bias=False)
        self.v_proj = Linear(d_model, value_width, bias=False)
        self.g_proj = Linear(d_model, value_width, bias=False)  # the swish output gate
        self.norm = GatedHeadNorm(self.value_dim, norm_eps)
        self.o_proj = Linear(value_width, d_model, bias=False)
        self.rope = RotaryEmbedding(head_dim, rope_base)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, head_dim: int | None, expand_v: int,
                     chunk_size: int, norm_eps: float, rope_base: float, **_) -> int:
        """Bytes of the parameters and buffers __init__ makes, from its arguments alone."""
        head_dim = checked_head_dim(d_model, n_heads, head_dim, expand_v)
        check_settings(chunk_size, norm_eps, rope_base)
        value_dim = head_dim * expand_v
        key_width, value_width = n_heads * head_dim, n_heads * value_dim
        elements = (2 * d_model * key_width  # q_proj, k_proj
                    + 2 * d_model * value_width  # v_proj, g_proj
                    + value_dim  # the gated head norm, shared by the heads
                    + value_width * d_model)  # o_proj
        return elements * dtype.itemsize + RotaryEmbedding.buffer_bytes(head_dim)

    def cache_spec(self) -> CacheSpec:
        # fp32 whatever the model's dtype: S is a running, decayed sum that 16-bit floats stop resolving
        return CacheSpec(kind="state", state_shapes=(("retention", (self.n_heads, self.head_dim, self.value_dim)),),
                         state_dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions=None, cache=None, batch: CacheBatch | None = None) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]. positions [B, T] rotate q and k (default 0 .. T-1). Without a
        cache: the chunked form from a zero state. With one (StateSlots): continue this batch's states (zeros on
        prefill), one recurrent step for a single decode token, then write them back."""
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        q, k, v = self.heads(x, positions)
        gate = self.g_proj(x)
        # log gamma_h at every token: the kernels take a decay per token, which padding sets to 0
        g = log_decays(self.n_heads, x.device, q.dtype)[None, :, None].expand(b, self.n_heads, t)
        states = cache.read(batch) if cache is not None else None
        if states is not None and batch.is_decode:
            state = states["retention"]  # updated in place by the step
            o = retention_decay_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], state).unsqueeze(2)
        elif states is not None and batch.checkpoints:  # the engine may keep any prefix: the state after each token
            state, outs, saved = states["retention"], [], []
            for i in range(t):
                outs.append(retention_decay_step(q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], state))
                saved.append(state.clone())  # the step updates it in place
            cache.write_steps({"retention": torch.stack(saved, 1)}, batch)
            return self.output(torch.stack(outs, 2), gate, x.dtype)
        else:
            if batch is not None and batch.padded:  # past a row's end: no decay, no write, so its state stops there
                real = batch.real_tokens()[:, None, :]  # [B, 1, T]
                g, k = g * real, k * real[..., None]
            o, state = retention_decay_chunked(q, k, v, g, None if states is None else states["retention"],
                                               chunk_size=self.chunk_size)
        if cache is not None:
            cache.write({"retention": state}, batch)
        return self.output(o, gate, x.dtype)

    def heads(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, d_model] -> q, k [B, H, T, dk] (RoPE-rotated, fp32 or wider) and v [B, H, T, dv]."""
        compute = torch.promote_types(x.dtype, torch.float32)  # the state's sums want at least fp32 inputs
        q, k = (proj(x).to(compute).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)
                for proj in (self.q_proj, self.k_proj))
        cos, sin = self.rope(positions, compute)
        v = self.v_proj(x).unflatten(-1, (self.n_heads, self.value_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [B, H, T, dv] -> gated norm, o_proj -> [B, T, d_model]."""
        y = self.norm(o.transpose(1, 2), gate.unflatten(-1, (self.n_heads, self.value_dim)))
        return self.o_proj(y.flatten(-2).to(dtype))

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer step by step in float64 at positions 0 .. T-1, written for clarity: the oracle for
        forward()."""
        f64 = torch.float64
        H, dk, dv = self.n_heads, self.head_dim, self.value_dim
        xd = x.to(f64)
        q_all, k_all, v_all, gate = (xd @ proj.weight.to(f64).T for proj in (self.q_proj, self.k_proj, self.v_proj,
                                                                              self.g_proj))
        frequencies = self.rope_base ** (-torch.arange(0, dk, 2, dtype=f64, device=x.device) / dk)  # [dk / 2]
        batch, length, _ = x.shape
        out = torch.zeros(batch, length, H, dv, dtype=f64, device=x.device)
        for b in range(batch):
            S = torch.zeros(H, dk, dv, dtype=f64, device=x.device)
            for t in range(length):
                cos, sin = torch.cos(t * frequencies), torch.sin(t * frequencies)
                q, k, v = q_all[b, t].view(H, dk), k_all[b, t].view(H, dk), v_all[b, t].view(H, dv)
                for h in range(H):
                    # RoPE on pairs (i, i + dk/2): the rotation by angle t * frequency_i
                    qh = torch.cat([q[h, :dk // 2] * cos - q[h, dk // 2:] * sin,
                                    q[h, dk // 2:] * cos + q[h, :dk // 2] * sin])
                    kh = torch.cat([k[h, :dk // 2] * cos - k[h, dk // 2:] * sin,
                                    k[h, dk // 2:] * cos + k[h, :dk // 2] * sin])
                    gamma = 1 - 2.0 ** (-5 - h)
                    S[h] = gamma * S[h] + torch.outer(kh, v[h])
                    o = S[h].T @ qh / math.sqrt(dk)
                    rms = torch.sqrt((o * o).mean() + self.norm.eps)
                    z = gate[b, t, h * dv:(h + 1) * dv]
                    out[b, t, h] = self.norm.weight.to(f64) * (o / rms) * z * torch.sigmoid(z)
        return (out.flatten(-2) @ self.o_proj.weight.to(f64).T).to(x.dtype)
