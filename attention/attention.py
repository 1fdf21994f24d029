"""Softmax attention with grouped KV heads: MHA (kv_heads = heads), GQA (a divisor), MQA (1)."""
import torch
import torch.nn.functional as F
from torch import nn

from attention.cache_spec import CacheBatch, CacheSpec
from attention.rope import RotaryEmbedding, apply_rope


class Attention(nn.Module):
    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_base: float = 10000.0,
        max_seq_len: int = 2048,
        bias: bool = False,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(f"n_heads and n_kv_heads must be >= 1, got n_heads={n_heads}, n_kv_heads={n_kv_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}; "
                f"allowed n_kv_heads: {[k for k in range(1, n_heads + 1) if n_heads % k == 0]}"
            )
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; pass head_dim explicitly")
            head_dim = d_model // n_heads
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.rope = RotaryEmbedding(head_dim, max_seq_len, rope_base)

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kind="kv", kv_heads=self.n_kv_heads, head_dim=self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, batch: CacheBatch | None = None):
        """x: [B, T, d_model]. Without a cache: causal attention over x. With one: write this step's K/V, then attend."""
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.write(k, v, batch)
        if cache is None or batch.is_prefill:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            out = cache.attend(q, batch, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
