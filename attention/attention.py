"""Softmax attention with grouped KV heads: MHA (kv_heads = heads), GQA (a divisor), MQA (1); optionally over a
bounded set of keys (a sliding window, attention sinks + a window, a local chunk), or reading the keys and values of
an earlier layer (cross-layer attention)."""
import torch
from torch import nn

from attention.heads import default_head_dim
from attention.norm import RMSNorm
from cache.layouts import ContiguousKV, fresh_attention
from cache.retention import Retention
from cache.spec import CacheBatch, CacheSpec
from attention.reference import attention_reference
from attention.rope import RotaryEmbedding
from kernels import Linear, cpu_blocks, cpu_decode


def check_heads(n_heads: int, n_kv_heads: int) -> None:
    if n_heads < 1 or n_kv_heads < 1:
        raise ValueError(f"n_heads and n_kv_heads must be >= 1, got n_heads={n_heads}, n_kv_heads={n_kv_heads}")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}; "
            f"allowed n_kv_heads: {[k for k in range(1, n_heads + 1) if n_heads % k == 0]}"
        )


def head_sizes(d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """(n_kv_heads, head_dim) with their defaults (n_heads; d_model // n_heads) filled in, checked."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    check_heads(n_heads, n_kv_heads)
    head_dim = default_head_dim(d_model, n_heads, head_dim)
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return n_kv_heads, head_dim


# q/k RMSNorm before RoPE: "head" over each head, one gain shared by the heads (Qwen3); "all" over all heads (OLMoE)
QK_NORMS = ("head", "all")


def check_qk_norm(qk_norm: str | None) -> None:
    if qk_norm is not None and qk_norm not in QK_NORMS:
        raise ValueError(f"unknown qk_norm {qk_norm!r}; allowed: {', '.join(QK_NORMS)} or None")


def qk_norm_widths(qk_norm: str | None, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(q_norm, k_norm) gain sizes; (0, 0) without a q/k norm."""
    check_qk_norm(qk_norm)
    if qk_norm is None:
        return 0, 0
    if qk_norm == "head":
        return head_dim, head_dim
    return n_heads * head_dim, n_kv_heads * head_dim


PROJECTIONS = ("q_proj", "o_proj", "k_proj", "v_proj")  # the order the fused half takes them


class Attention(nn.Module):
    # layers whose outputs meet in the query-key product: AWQ leaves their weights unclipped (zoo/quantize.py)
    query_key_projections = ("q_proj", "k_proj")

    def __init__(
        self,
        d_model: int,
        layer_idx: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_base: float = 10000.0,
        bias: bool = False,
        window: int | None = None,
        sinks: int = 0,
        chunk: int | None = None,
        dilation: int = 1,
        kv_source: int | None = None,
        causal: bool = True,
        qk_norm: str | None = None,
        norm_eps: float = 1e-5,
        score: str | None = None,
        budget: int | None = None,
    ):
        """window: each query sees the newest `window` keys, itself included (HF Mistral's sliding_window).
        sinks: with a window, the first `sinks` positions stay visible to every query (StreamingLLM's attention sinks).
        chunk: each query sees only the keys of its own `chunk`-aligned chunk (Llama 4's chunked local attention).
        dilation: with a window, each query sees every dilation-th key, W of them over (W-1)·dilation + 1 positions
        (a dilated sliding window); the cache holds the whole span.
        score, budget: scored retention (cache/eviction.py): a sequence keeps the first `sinks` and newest `window`
        tokens and the `budget` others with the best score, "h2o" (accumulated attention) or "tova" (the newest
        query's); a prefill attends over its whole prompt first. Needs the engine's cache (an uncached forward keeps
        everything).
        kv_source: index of an earlier layer whose keys and values this layer reads instead of computing its own.
        causal: False lets every query see the whole sequence (a masked diffusion LM): every key kept, no kv_source.
        qk_norm: RMSNorm (eps norm_eps) on queries and keys after projection, before RoPE: None, "head" (Qwen3's,
        over each head) or "all" (OLMoE's, over all heads' concatenated width); a kv_source layer norms only q."""
        super().__init__()
        n_kv_heads, head_dim = head_sizes(d_model, n_heads, n_kv_heads, head_dim)
        self.retention = Retention(sinks=sinks, window=window, chunk=chunk, dilation=dilation, score=score,
                                   budget=budget)  # checks them together
        if kv_source is not None and not 0 <= kv_source < layer_idx:
            raise ValueError(f"layer {layer_idx} can share keys and values only with an earlier layer, got kv_source={kv_source}")
        if kv_source is not None and not self.retention.keeps_all:
            raise ValueError(f"a layer that reads another's cache (kv_source={kv_source}) keeps what its source keeps: "
                             f"give it no window, sinks or chunk (got {self.retention.describe()})")
        if not causal and (not self.retention.keeps_all or kv_source is not None):
            raise ValueError(f"non-causal attention keeps every key and computes its own: window, sinks, chunk and "
                             f"kv_source must be unset, got {self.retention.describe()}, kv_source={kv_source}")
        self.layer_idx, self.kv_source, self.causal = layer_idx, kv_source, causal
        self.window, self.sinks, self.chunk, self.dilation = window, sinks, chunk, dilation
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = Linear(d_model, n_heads * head_dim, bias=bias)
        if kv_source is None:
            self.k_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
            self.v_proj = Linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(n_heads * head_dim, d_model, bias=bias)
        self.rope_base, self.rope = rope_base, RotaryEmbedding(head_dim, rope_base)
        self.qk_norm = qk_norm
        q_width, k_width = qk_norm_widths(qk_norm, n_heads, n_kv_heads, head_dim)
        if qk_norm is not None:
            self.q_norm = RMSNorm(q_width, norm_eps)
            if kv_source is None:
                self.k_norm = RMSNorm(k_width, norm_eps)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None,
                     bias: bool, kv_source: int | None, qk_norm: str | None, **_) -> int:
        """Bytes of the parameters and buffers __init__ makes, from its arguments alone (the rest size nothing)."""
        n_kv_heads, head_dim = head_sizes(d_model, n_heads, n_kv_heads, head_dim)
        projections = [(d_model, n_heads * head_dim), (n_heads * head_dim, d_model)]  # q, o
        q_width, k_width = qk_norm_widths(qk_norm, n_heads, n_kv_heads, head_dim)
        norms = q_width
        if kv_source is None:
            projections += [(d_model, n_kv_heads * head_dim)] * 2  # k, v
            norms += k_width
        elements = norms + sum(rows * cols + (cols if bias else 0) for rows, cols in projections)
        return elements * dtype.itemsize + RotaryEmbedding.buffer_bytes(head_dim)

    def cache_spec(self) -> CacheSpec:
        if self.kv_source is not None:
            return CacheSpec(kind="shared", kv_heads=self.n_kv_heads, head_dim=self.head_dim, source=self.kv_source,
                             query_heads=self.n_heads)
        return CacheSpec(kind="kv", kv_heads=self.n_kv_heads, head_dim=self.head_dim, value_dim=self.head_dim,
                         retention=self.retention, query_heads=self.n_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache=None, batch: CacheBatch | None = None):
        """x: [B, T, d_model]. Without a cache: causal attention over x. With one: write this step's K/V, then attend.

        A layer that shares another's keys only reads: its cache is the producer's (the engine's, or the
        uncached forward's hand-off), which the producer has already written this step.
        Non-causal: a query sees every key before its row's batch.lengths (all keys when batch is None).
        """
        b, t, _ = x.shape
        if positions is None:
            positions = torch.arange(t, device=x.device).expand(b, t)
        q = self.normed_heads(self.q_proj(x), "q_norm", self.n_heads)
        if self.kv_source is not None:
            (q,) = self.rope.rotate(positions, q)
            out = cache.attend(q, batch, self.scale)
        else:
            k = self.normed_heads(self.k_proj(x), "k_norm", self.n_kv_heads)
            v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self.rope.rotate(positions, q, k)
            if cache is not None and self.retention.scored:  # what stays depends on this step's attention
                out = cache.attend_scored(q, k, v, batch, self.scale)
                return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
            if cache is not None:
                cache.write(k, v, batch)
            if batch is None or batch.is_prefill:
                padding = None if self.causal or batch is None else batch.lengths
                out = fresh_attention(q, k, v, positions, self.retention, self.scale, self.causal, padding)
            else:
                out = cache.attend(q, batch, self.scale, causal=self.causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def decode_residual(self, norm: nn.Module, x: torch.Tensor, positions: torch.Tensor, cache, batch: CacheBatch
                        ) -> torch.Tensor | None:
        """x + self(norm(x), ...) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere,
        where the block runs the two modules."""
        half = self.decode_half(norm, x, cache, batch)
        return None if half is None else cpu_blocks.run_half(half, x, positions, batch)

    def decode_half(self, norm: nn.Module, x: torch.Tensor, cache, batch: CacheBatch) -> "cpu_blocks.Half | None":
        """This layer's half of an eager CPU one-token decode step over a float contiguous cache, after an RMSNorm,
        with plain bias-free projections on the C GEMV (or int8 ones) and no q/k norm, scoring, dilation or
        bidirectional attention; None elsewhere."""
        if (batch is None or batch.step != "decode" or batch.checkpoints or batch.padded or batch.tree is not None
                or type(cache) is not ContiguousKV or cache.quantized or type(norm) is not RMSNorm
                or self.qk_norm is not None or self.retention.scored or self.dilation > 1 or not self.causal
                or type(self) is not Attention or "forward" in vars(self)):  # the fused half is this class's forward
            return None
        shares = self.kv_source is not None
        operands = cpu_blocks.half_operands(self, norm, ("q_proj", "o_proj") if shares else PROJECTIONS, int8=True)
        if operands is None:
            return None
        (weights, scales), norm_weight, k, v = operands, norm._parameters["weight"], cache.k, cache.v
        if (not cpu_blocks.gemv_half_fits(x, weights, norm_weight, k, v, scales=scales)
                or not cpu_decode.attention_fits(self.n_heads, self.n_kv_heads, self.head_dim, self.head_dim, k)
                or v.stride(-1) != 1):
            return None
        (wq, wo, wk, wv), (sq, so, sk, sv) = (weights, scales) if not shares else ((*weights, None, None),
                                                                                   (*scales, None, None))
        return cpu_blocks.Half("attention", (norm_weight, wq, wk, wv, wo, self._modules["rope"]._buffers["inv_freq"],
                                             sq, sk, sv, so), (k, v), (norm.eps, self.scale), cache=cache)

    def normed_heads(self, y: torch.Tensor, norm: str, n: int) -> torch.Tensor:
        """A projection [B, T, n * head_dim] -> [B, n, T, head_dim], through the q/k norm `norm` when there is one."""
        b, t, _ = y.shape
        if self.qk_norm == "all":
            y = getattr(self, norm)(y)
        y = y.view(b, t, n, self.head_dim)
        if self.qk_norm == "head":
            y = getattr(self, norm)(y)
        return y.transpose(1, 2)

    def reference(self, x: torch.Tensor, kv_from=None) -> torch.Tensor:
        """The float64 oracle (attention/reference.py); kv_from = (source mixer, its input) for a layer that shares."""
        return attention_reference(self, x, kv_from)
