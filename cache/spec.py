"""The cache contract between mixers and the engine: what a layer stores, and one step's batch layout."""
import math
from dataclasses import dataclass

import torch

from cache.retention import FULL, Retention

CACHE_KINDS = ("kv", "latent", "shared", "state")
# What one cached forward is: every sequence starting at position 0 ("prefill"), one new token per sequence on top of
# its cache ("decode"), or several new tokens on top of it ("chunk": a diffusion block, a chunked prefill's later
# chunks, a speculative verification of proposed tokens).
STEP_KINDS = ("prefill", "decode", "chunk")
# How per-token caches store their rows: "auto" in the model's dtype; "int8" and "fp8" (e4m3) one byte an element plus
# a scale (in the model's dtype) per token and KV head for keys and for values (cache/quantized_rows.py). Recurrent
# state keeps its declared dtype: it is rewritten every token, so rounding would compound, and it does not grow with
# the context.
KV_FORMATS = ("auto", "int8", "fp8")


@dataclass(frozen=True)
class CacheSpec:
    """What one layer keeps per sequence; the engine allocates from this and `cache_bytes` sums it.

    kind "kv": keys [kv_heads, head_dim] and values [kv_heads, value_dim] per token.
    kind "latent": one row of head_dim per token whose first value_dim columns double as the value (MLA).
    kind "shared": no memory of its own; the layer reads layer `source`'s cache (cross-layer attention).
    kind "state": a fixed-size recurrent state per sequence, one tensor per (name, shape) in state_shapes
    (Mamba's conv and SSM states, linear attention's S and z), whatever the sequence's length.
    retention: which positions the cache keeps and each query sees (all; the newest W; sinks + W; a chunk).
    query_heads: query heads that read this cache each token (attention FLOPs per key scale with it; 0 for states).
    """

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    value_dim: int = 0
    retention: Retention = FULL
    source: int | None = None
    query_heads: int = 0
    state_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    state_dtype: torch.dtype | None = None  # None: the model's dtype; float32 for states that accumulate sums

    def __post_init__(self):
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {self.kind!r}; allowed: {', '.join(CACHE_KINDS)}")
        if not isinstance(self.retention, Retention):
            raise ValueError(f"retention must be a cache.Retention, got {self.retention!r}")
        if (self.kind == "shared") != (self.source is not None):
            raise ValueError("a 'shared' cache names its source layer, and only it does")
        if (self.kind == "state") != bool(self.state_shapes):
            raise ValueError("a 'state' cache lists its state tensors' shapes, and only it does")

    @property
    def owns_memory(self) -> bool:
        return self.kind != "shared"

    @property
    def elements_per_token(self) -> int:
        """Elements one cached token costs: keys plus values ("latent": the one row; "shared": nothing)."""
        if self.kind in ("shared", "state"):
            return 0
        if self.kind == "latent":
            return self.kv_heads * self.head_dim
        return self.kv_heads * (self.head_dim + self.value_dim)

    @property
    def state_elements(self) -> int:
        """Elements of the fixed per-sequence state (0 for per-token caches)."""
        return sum(math.prod(shape) for _, shape in self.state_shapes)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the fixed per-sequence state for a model in `dtype`."""
        return self.state_elements * (self.state_dtype or dtype).itemsize

    @property
    def latent_split(self) -> int | None:
        """Where a one-byte latent row's second scale begins: a "latent" row is the latent (value_dim columns) and
        the rotary part of the key, each with its own scale (cache/quantized_rows.py); None: one scale per row."""
        return self.value_dim if self.kind == "latent" and self.head_dim > self.value_dim else None

    @property
    def scales_per_token(self) -> int:
        """Scales one cached token stores in a one-byte cache: one per key and per value row of each KV head, or the
        latent row's one or two."""
        if self.kind in ("shared", "state"):
            return 0
        if self.kind == "latent":
            return self.kv_heads * (1 if self.latent_split is None else 2)
        return self.kv_heads * 2

    def token_bytes(self, dtype: torch.dtype, kv_format: str = "auto") -> int:
        """Bytes one cached token costs in this layer: its elements in `dtype`, or one-byte elements (int8, fp8) and
        their scales in `dtype`."""
        if kv_format != "auto":
            return self.elements_per_token + self.scales_per_token * dtype.itemsize
        return self.elements_per_token * dtype.itemsize

    def bytes(self, seq_len: int, dtype: torch.dtype, kv_format: str = "auto") -> int:
        """Cache bytes one sequence of `seq_len` tokens holds in this layer, for a model in `dtype`."""
        tokens = self.token_bytes(dtype, kv_format) * self.tokens_held(seq_len)
        return tokens + (self.state_bytes(dtype) if seq_len > 0 else 0)

    def read_bytes(self, seq_len: int, dtype: torch.dtype, kv_format: str = "auto") -> int:
        """Cache bytes the newest query of a `seq_len`-token sequence reads in this layer: the keys it sees (fewer
        than those held with a dilated window) and the state."""
        tokens = self.token_bytes(dtype, kv_format) * self.retention.keys_seen(seq_len)
        return tokens + (self.state_bytes(dtype) if seq_len > 0 else 0)

    def tokens_held(self, seq_len: int) -> int:
        """Tokens of a `seq_len`-token sequence the cache keeps (its retention's answer)."""
        return self.retention.tokens_held(seq_len)

    def elements(self, seq_len: int) -> int:
        """Cache elements one sequence of `seq_len` tokens holds in this layer (a state is there from the first token)."""
        return self.elements_per_token * self.tokens_held(seq_len) + (self.state_elements if seq_len > 0 else 0)


def specs_read(specs: list[CacheSpec]) -> list[CacheSpec]:
    """The cache each layer reads: its own, or for a "shared" layer its source's (read again by every sharer)."""
    return [specs[spec.source] if spec.kind == "shared" else spec for spec in specs]


@dataclass
class TreeBatch:
    """A speculative step's new tokens as token trees, one per row (SpecInfer's tree attention): a row's T tokens are
    written to its physical rows positions[:, 0] .. + T - 1, parents before children, while each node's logical
    position, the one its path gives it (the row's start + its depth), is what RoPE and the retention see; a node
    attends over the cached tokens and its own ancestors, itself included, not over other branches."""

    logical: torch.Tensor  # [B, T] each node's position on its own path
    ancestors: torch.Tensor  # [B, T, T] bool: (i, j) where node j is node i or an ancestor of it

    def visible(self, starts: torch.Tensor, length: int, retention: Retention) -> torch.Tensor:
        """[B, T, length] bool: key row l visible from node t; starts [B]: each row's first physical row this step.
        A cached row keeps its position; a tree row takes its node's logical position and must be an ancestor."""
        b, t = self.logical.shape
        rows = torch.arange(length, device=self.logical.device).unsqueeze(0)
        starts = starts.long().unsqueeze(1)
        in_tree = (rows >= starts) & (rows < starts + t)
        node = (rows - starts).clamp(0, t - 1)  # [B, length]: the node a tree row holds
        far = torch.iinfo(torch.long).max // 2  # past the tree: no query sees it
        keys = torch.where(rows < starts, rows, torch.where(in_tree, self.logical.long().gather(1, node), far))
        seen = retention.visible(keys.unsqueeze(1), self.logical.long().unsqueeze(-1))
        ancestor = self.ancestors.gather(2, node.unsqueeze(1).expand(b, t, length))
        return seen & (ancestor | ~in_tree.unsqueeze(1))


@dataclass
class CacheBatch:
    """Where this step's tokens live in the caches; built by the engine once per step, shared by all layers.

    The paged fields are per cache group (layers whose blocks live and die together: one group per retention
    policy), so a layout reads `block_tables[its group]`.
    """

    positions: torch.Tensor  # [B, T] absolute position of each new token
    lengths: torch.Tensor  # [B] tokens in each sequence after this step (the newest query's position + 1)
    max_length: int  # max(lengths) as a Python int, so layouts can slice without a device sync
    step: str  # one of STEP_KINDS
    slots: torch.Tensor | None = None  # [B] contiguous layout: cache row of each sequence
    slot_range: slice | None = None  # the same rows when they are consecutive: layouts read a view instead of gathering
    block_tables: tuple[torch.Tensor, ...] = ()  # per group [B, max_blocks] int32, -1 = no block (freed or unused)
    slot_mappings: tuple[torch.Tensor, ...] = ()  # per group [B*T] int64 flat pool slot per new token, -1 = not kept
    # speculative decoding: the engine may roll each sequence back to any length from its first new token on, so a
    # state mixer hands its view the state after every new token (StateView.write_steps) and a ring buffer keeps
    # the rows it overwrites; the engine then keeps the accepted prefix (CachePool.rollback)
    checkpoints: bool = False
    # several sequences' prefill work in one forward (batched prefill): a row whose tokens end before T is padded on
    # the right; positions at or past its length are padding, which no layer writes to its cache or state
    padded: bool = False
    # no slot mapping is -1 (a graph-captured decode step, whose padding rows write spare blocks): a write needs no
    # selection of the kept tokens, which would read the mapping on the host
    every_token_kept: bool = False
    # a step replayed from a graph (harness/engine/decode_graphs.py): no layer may read a device value on the host
    # or size a tensor by one (an MoE layer gathers its routed experts' weights instead of grouping its tokens by expert)
    captured: bool = False
    # a speculative tree verification: the new tokens are token trees (a "chunk" step of attention layers)
    tree: TreeBatch | None = None
    # the engine's decode plans (zoo/decode_plan.py's DecodePlans), kept beside its caches: an eager CPU decode step
    # may run all its blocks in one call through them; None: every block decides its own halves
    decode_plans: object = None

    def __post_init__(self):
        if self.step not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.step!r}; allowed: {', '.join(STEP_KINDS)}")
        if self.step == "decode" and self.positions.shape[-1] != 1:
            raise ValueError(f"a decode step carries one new token per sequence, got {self.positions.shape[-1]}")

    def real_tokens(self) -> torch.Tensor:
        """[B, T] bool: the new tokens that are not padding."""
        return self.positions < self.lengths[:, None]

    def last_tokens(self) -> torch.Tensor:
        """[B] index along T of each row's last real new token."""
        return self.lengths.long() - self.positions[:, 0].long() - 1

    @property
    def is_prefill(self) -> bool:
        """Every sequence starts at position 0: attend over the new keys alone, start states from zeros."""
        return self.step == "prefill"

    @property
    def is_decode(self) -> bool:
        """One new token per sequence on top of its cache: the recurrent step, the one-query kernels."""
        return self.step == "decode"
