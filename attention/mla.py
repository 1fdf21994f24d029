"""Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one normalised latent per token plus a
rotary key shared by all heads, so the cache holds only [latent ; rope key]. Weight names follow HF DeepseekV3."""
import torch
from torch import nn

from cache.spec import CacheBatch, CacheSpec
from cache.layouts import ContiguousKV, fresh_attention
from cache.retention import FULL
from attention.reference import mla_reference
from attention.rope import RotaryEmbedding
from attention.norm import RMSNorm
from kernels import Linear, cpu_blocks, cpu_decode


def check_sizes(n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                q_lora_rank: int | None) -> None:
    sizes = dict(n_heads=n_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                 qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
    bad = {name: value for name, value in sizes.items() if value < 1}
    if q_lora_rank is not None and q_lora_rank < 1:
        bad["q_lora_rank"] = q_lora_rank
    if bad:
        raise ValueError(f"MLA sizes must be >= 1 (q_lora_rank may be None for a plain q_proj), got {bad}")


class MLAttention(nn.Module):
    # layers whose outputs meet in the query-key product (the latent feeds the keys as well as the values): AWQ
    # leaves their weights unclipped (zoo/quantize.py)
    query_key_projections = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-6,
        causal: bool = True,
    ):
        """causal: False lets every query see the whole sequence (a masked diffusion LM)."""
        super().__init__()
        check_sizes(n_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)
        self.layer_idx, self.causal = layer_idx, causal
        self.n_heads, self.kv_lora_rank, self.v_head_dim = n_heads, kv_lora_rank, v_head_dim
        self.nope_dim, self.rope_dim = qk_nope_head_dim, qk_rope_head_dim
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        q_out = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = Linear(d_model, q_out, bias=False)
        else:
            self.q_a_proj = Linear(d_model, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = Linear(n_heads * v_head_dim, d_model, bias=False)
        self.rope_base, self.rope = rope_base, RotaryEmbedding(qk_rope_head_dim, rope_base)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int,
                     qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None, **_) -> int:
        """Bytes of the parameters and buffers __init__ makes, from its arguments alone (the rest size nothing)."""
        check_sizes(n_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)
        q_out = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        query = d_model * q_out if q_lora_rank is None else (d_model + 1 + q_out) * q_lora_rank  # q_a, its norm, q_b
        key_value = (d_model * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank  # kv_a and its norm
                     + kv_lora_rank * n_heads * (qk_nope_head_dim + v_head_dim))  # kv_b
        output = n_heads * v_head_dim * d_model
        return (query + key_value + output) * dtype.itemsize + RotaryEmbedding.buffer_bytes(qk_rope_head_dim)

    def cache_spec(self) -> CacheSpec:
        return CacheSpec(kind="latent", kv_heads=1, head_dim=self.kv_lora_rank + self.rope_dim, value_dim=self.kv_lora_rank,
                         query_heads=self.n_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, batch: CacheBatch | None = None):
        """Uncached and prefill: the expanded form (per-head keys/values from the latent). Decode: weight absorption,
        MQA over the cached latent rows, so a step reads kv_lora_rank + qk_rope_head_dim elements per token."""
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, t, self.n_heads, -1).transpose(1, 2).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, T, rank]: one "head" shared by all
        q_rope, k_rope = self.rope.rotate(positions, q_rope, k_rope.unsqueeze(1))
        rows = torch.cat([latent, k_rope], dim=-1)
        if cache is not None:
            cache.write(rows, None, batch)
        if batch is None or batch.is_prefill:
            padding = None if self.causal or batch is None else batch.lengths
            out = self.expanded(q_nope, q_rope, latent, k_rope, positions, padding)
        else:
            out = self.absorbed(q_nope, q_rope, cache, batch)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.v_head_dim))

    def decode_residual(self, norm: nn.Module, x: torch.Tensor, positions, cache, batch: CacheBatch | None
                        ) -> torch.Tensor | None:
        """x + self(norm(x), ...) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere,
        where the block runs the two modules."""
        half = self.decode_half(norm, x, cache, batch)
        return None if half is None else cpu_blocks.run_half(half, x, positions, batch)

    def decode_half(self, norm: nn.Module, x: torch.Tensor, cache, batch: CacheBatch | None
                    ) -> "cpu_blocks.Half | None":
        """This layer's half of an eager CPU one-token causal decode step over a float contiguous latent cache, after
        an RMSNorm, with plain projections on the C GEMV (no q LoRA); None elsewhere."""
        if (batch is None or batch.step != "decode" or batch.checkpoints or batch.padded or batch.tree is not None
                or type(cache) is not ContiguousKV or cache.quantized or type(norm) is not RMSNorm or not self.causal
                or type(self) is not MLAttention
                or {"forward", "absorbed"} & vars(self).keys()):  # the fused half computes these itself
            return None
        weights = cpu_blocks.half_weights(self, norm, ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        if (weights is None
                or not cpu_blocks.gemv_half_fits(x, weights, norm.weight, self.kv_a_layernorm.weight, cache.k)
                or not cpu_decode.attention_fits(self.n_heads, 1, cache.k.shape[-1], self.kv_lora_rank, cache.k)):
            return None
        return cpu_blocks.Half("mla", (norm.weight, weights[0], weights[1], self.kv_a_layernorm.weight, weights[2],
                                       weights[3], self.rope.inv_freq), (cache.k,),
                               (norm.eps, self.kv_a_layernorm.eps, self.scale),
                               (self.n_heads, self.nope_dim, self.v_head_dim), cache=cache)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank], the per-head maps from the latent to keys and values."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def expanded(self, q_nope, q_rope, latent, k_rope, positions, lengths=None) -> torch.Tensor:
        """lengths [B]: a non-causal layer's right padding (keys at or past a row's length are hidden)."""
        b, _, t, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return fresh_attention(q, k, v, positions, FULL, self.scale, self.causal, lengths)

    def absorbed(self, q_nope, q_rope, cache, batch: CacheBatch) -> torch.Tensor:
        w_uk, w_uv = self.up_projections()
        # q·k_nope = (q W_UK)·latent: fold W_UK into the query, so keys stay in the latent space
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope], dim=-1)
        out_latent = cache.attend(q, batch, self.scale, value_dim=self.kv_lora_rank, causal=self.causal)  # [B, H, T, rank]
        return torch.einsum("bhtr,hvr->bhtv", out_latent, w_uv)  # W_UV applied after attention

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 oracle: the uncached (non-absorbed) form written plainly (attention/reference.py)."""
        return mla_reference(self, x)
