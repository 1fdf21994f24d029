"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax replaced by a feature map phi,
so causal attention becomes a fixed-size recurrent state per head.

    out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps),   S_t = sum_{s<=t} phi(k_s) (x) v_s,   z_t = sum_{s<=t} phi(k_s)

No RoPE, no softmax, no query scaling. The state per sequence is S [n_heads, dk, dv] plus z [n_heads, dk], with dk the
width after the feature map.

Feature maps:
- "elu": phi(x) = elu(x) + 1 (Katharopoulos); dk = feature_dim (default head_dim).
- "taylor": Based's 2nd-order Taylor map of exp(q.k / sqrt(f)) (Arora et al. 2024; Zoology's TaylorExp):
  phi(x) = [1, x / f^(1/4), vec(x x^T) / (sqrt(2) sqrt(f))], so phi(q).phi(k) = 1 + u + u^2/2 with u = q.k / sqrt(f);
  dk = 1 + f + f^2. q and k are projected to a small feature_dim f (default 16) first, keeping the state small.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from attention.heads import default_head_dim
from attention.norm import RMSNorm
from attention.reference import linear_attention_reference
from cache.spec import CacheBatch, CacheSpec
from cache.state_slots import StateSlots
from kernels import Linear, cpu_blocks, linear_attention_chunked, linear_attention_parallel_ref
from kernels import linear_attention_step

FEATURE_MAPS = ("elu", "taylor")


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """[..., f] -> [..., 1 + f + f^2]; phi(q).phi(k) = 1 + u + u^2/2, u = q.k/sqrt(f): always >= 1/2, so z stays positive."""
    f = x.shape[-1]
    second = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2 * f)
    return torch.cat([x.new_ones(*x.shape[:-1], 1), x / f**0.25, second], dim=-1)


def feature_width(feature_map: str, feature_dim: int) -> int:
    return feature_dim if feature_map == "elu" else 1 + feature_dim + feature_dim**2


def head_sizes(d_model: int, n_heads: int, head_dim: int | None, feature_map: str,
               feature_dim: int | None) -> tuple[int, int]:
    """(head_dim, feature_dim) with their defaults filled in, checked."""
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {feature_map!r}; allowed: {', '.join(FEATURE_MAPS)}")
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    head_dim = default_head_dim(d_model, n_heads, head_dim)
    if feature_dim is None:
        feature_dim = head_dim if feature_map == "elu" else 16
    for name, value in (("head_dim", head_dim), ("feature_dim", feature_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return head_dim, feature_dim


class LinearAttention(nn.Module):
    # layers whose outputs meet in the query-key product: AWQ leaves their weights unclipped (zoo/quantize.py)
    query_key_projections = ("q_proj", "k_proj")

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        head_dim: int | None = None,
        feature_map: str = "elu",
        feature_dim: int | None = None,
        chunk_size: int = 64,
        eps: float = 1e-6,
    ):
        """head_dim: width of each head's values (default d_model // n_heads).
        feature_dim: width of each head's q and k before the feature map (default head_dim for "elu", 16 for "taylor").
        chunk_size: tokens per chunk of the chunked (prefill) form."""
        super().__init__()
        head_dim, feature_dim = head_sizes(d_model, n_heads, head_dim, feature_map, feature_dim)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0 (it keeps the normalizer away from zero), got {eps}")
        self.layer_idx, self.n_heads, self.head_dim = layer_idx, n_heads, head_dim
        self.feature_map, self.feature_dim, self.chunk_size, self.eps = feature_map, feature_dim, chunk_size, eps
        self.state_dim = feature_width(feature_map, feature_dim)  # dk: what S and z are indexed by
        self.phi = elu_feature_map if feature_map == "elu" else taylor_feature_map
        self.q_proj = Linear(d_model, n_heads * feature_dim, bias=False)
        self.k_proj = Linear(d_model, n_heads * feature_dim, bias=False)
        self.v_proj = Linear(d_model, n_heads * head_dim, bias=False)
        self.o_proj = Linear(n_heads * head_dim, d_model, bias=False)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, head_dim: int | None, feature_map: str,
                     feature_dim: int | None, **_) -> int:
        """Bytes of the parameters __init__ makes, from its arguments alone (the rest size nothing)."""
        head_dim, feature_dim = head_sizes(d_model, n_heads, head_dim, feature_map, feature_dim)
        return 2 * d_model * n_heads * (feature_dim + head_dim) * dtype.itemsize  # q and k; v and o

    def cache_spec(self) -> CacheSpec:
        # fp32 whatever the model's dtype: S and z are running sums, which 16-bit floats stop resolving
        return CacheSpec(kind="state", state_shapes=(("kv", (self.n_heads, self.state_dim, self.head_dim)),
                                                     ("normalizer", (self.n_heads, self.state_dim))),
                         state_dtype=torch.float32)

    def project(self, x: torch.Tensor):
        """x [B, T, d_model] -> feature-mapped q, k [B, H, T, dk] and v [B, H, T, dv]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.feature_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.feature_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        return self.phi(q), self.phi(k), v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """The masked quadratic form over x: O(T^2), for checks."""
        q, k, v = self.project(x)
        return self.merge(linear_attention_parallel_ref(q, k, v, self.eps))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, batch: CacheBatch | None = None):
        """x: [B, T, d_model]. Without a cache: the chunked form from a zero state. With one (StateSlots): continue
        this batch's states (zeros on prefill), one recurrent step for a single decode token, then write them back.
        positions are unused (no RoPE): the state carries the order."""
        q, k, v = self.project(x)
        if cache is None:
            out, _, _ = linear_attention_chunked(q, k, v, chunk_size=self.chunk_size, eps=self.eps)
            return self.merge(out)
        states = cache.read(batch)
        s, z = states["kv"], states["normalizer"]
        if batch.is_decode:
            out = linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], s, z, self.eps).unsqueeze(2)
        elif batch.checkpoints:  # the engine may keep any prefix: the state after each token
            outs, kvs, normalizers = [], [], []
            for i in range(q.shape[2]):
                outs.append(linear_attention_step(q[:, :, i], k[:, :, i], v[:, :, i], s, z, self.eps))
                kvs.append(s.clone())  # the step updates s and z in place
                normalizers.append(z.clone())
            cache.write_steps({"kv": torch.stack(kvs, 1), "normalizer": torch.stack(normalizers, 1)}, batch)
            return self.merge(torch.stack(outs, 2))
        else:
            if batch.padded:  # a padded token's key feature 0 adds nothing to S or z: the state stops at a row's end
                k = k * batch.real_tokens()[:, None, :, None]
            out, s, z = linear_attention_chunked(q, k, v, s, z, chunk_size=self.chunk_size, eps=self.eps)
        cache.write({"kv": s, "normalizer": z}, batch)
        return self.merge(out)

    def decode_residual(self, norm: nn.Module, x: torch.Tensor, positions, cache, batch: CacheBatch | None
                        ) -> torch.Tensor | None:
        """x + self(norm(x), ...) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere,
        where the block runs the two modules."""
        half = self.decode_half(norm, x, cache, batch)
        return None if half is None else cpu_blocks.run_half(half, x, positions, batch)

    def decode_half(self, norm: nn.Module, x: torch.Tensor, cache, batch: CacheBatch | None
                    ) -> "cpu_blocks.Half | None":
        """This layer's half of an eager CPU one-token decode step over the engine's state slots, after an RMSNorm,
        with the elu + 1 feature map and plain projections on the C GEMV; None elsewhere."""
        if (batch is None or batch.step != "decode" or batch.checkpoints or batch.padded
                or type(cache) is not StateSlots or type(norm) is not RMSNorm or not self.plain()):
            return None
        weights = cpu_blocks.half_weights(self, norm, ("q_proj", "k_proj", "v_proj", "o_proj"))
        kv, normalizer = cache.tensors["kv"], cache.tensors["normalizer"]
        if (weights is None or not cpu_blocks.gemv_half_fits(x, weights, norm.weight)
                or kv.dtype != torch.float32 or normalizer.dtype != torch.float32 or kv.device != x.device):
            return None
        return cpu_blocks.Half("linear_attention", (norm.weight, *weights), (kv, normalizer), (norm.eps, self.eps))

    def plain(self) -> bool:
        """This class's own decode step with the elu + 1 feature map, which the fused half computes itself: not a
        subclass's, nor one whose phi or step was replaced on the instance."""
        return type(self) is LinearAttention and self.phi is elu_feature_map and "forward" not in vars(self)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The float64 oracle: the recurrence, one token at a time (attention/reference.py)."""
        return linear_attention_reference(self, x)
