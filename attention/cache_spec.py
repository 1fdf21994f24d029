"""The cache contract between mixers and the engine: what a layer stores, and one step's batch layout."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """What one layer keeps per sequence; the engine allocates from this and `cache_bytes` sums it."""

    kind: str  # "kv": per-token keys and values
    kv_heads: int
    head_dim: int

    @property
    def elements_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim

    def elements(self, seq_len: int) -> int:
        """Cache elements one sequence of `seq_len` tokens holds in this layer."""
        return self.elements_per_token * seq_len


@dataclass
class CacheBatch:
    """Where this step's tokens live in the caches; built by the engine once per step, shared by all layers."""

    positions: torch.Tensor  # [B, T] absolute position of each new token
    lengths: torch.Tensor  # [B] tokens cached per sequence after this step (keys to attend over)
    max_length: int  # max(lengths) as a Python int, so layouts can slice without a device sync
    is_prefill: bool  # every sequence starts at position 0: attend over the new keys alone
    slots: torch.Tensor | None = None  # [B] contiguous layout: cache row of each sequence
    slot_range: slice | None = None  # the same rows when they are consecutive: layouts read a view instead of gathering
    block_table: torch.Tensor | None = None  # [B, max_blocks] int32, paged layout
    slot_mapping: torch.Tensor | None = None  # [B*T] int64 flat pool slot per new token, paged layout
