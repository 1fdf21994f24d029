"""KV-cache layouts the engine allocates per attention layer: contiguous rows, or a paged block pool."""
import torch

from attention.cache_spec import CacheBatch
from kernels import paged_decode_attention, write_paged_kv


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float):
    """q: [B, H, T, D] at `positions` [B, T]; k, v: [B, KVH, L, D] holding positions 0..L-1.

    Written out rather than SDPA: for a few query tokens SDPA's per-call cost dominates, and these plain ops
    fuse under torch.compile. Each KV head's query group is one matmul, so K/V are read once per group.
    """
    b, h, t, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = h // kv_heads
    scores = torch.matmul(q.reshape(b, kv_heads, group * t, d), k.transpose(-1, -2)).float() * scale
    visible = torch.arange(length, device=k.device).view(1, 1, 1, length) <= positions.view(b, 1, t, 1)
    scores = scores.view(b, kv_heads, group, t, length).masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype).view(b, kv_heads, group * t, length)
    return torch.matmul(probs, v).view(b, h, t, d)


class KVTensors:
    """A key and a value tensor of one shape; their bytes are the layer's measured cache."""

    def __init__(self, shape: tuple[int, ...], dtype, device):
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class ContiguousKV(KVTensors):
    """One row per batch slot, [slots, kv_heads, max_len, head_dim], written in place (gpt-fast's static cache)."""

    def __init__(self, max_batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__((max_batch, kv_heads, max_len, head_dim), dtype, device)

    def write(self, k: torch.Tensor, v: torch.Tensor, batch: CacheBatch) -> None:
        """k, v: [B, KVH, T, D] for the tokens at batch.positions."""
        rows = batch.slots[:, None]
        self.k[rows, :, batch.positions] = k.transpose(1, 2)
        self.v[rows, :, batch.positions] = v.transpose(1, 2)

    def attend(self, q: torch.Tensor, batch: CacheBatch, scale: float) -> torch.Tensor:
        rows = batch.slots if batch.slot_range is None else batch.slot_range
        k = self.k[rows, :, : batch.max_length]
        v = self.v[rows, :, : batch.max_length]
        return masked_attention(q, k, v, batch.positions, scale)


class PagedKV(KVTensors):
    """A pool of fixed-size blocks, [num_blocks, block_size, kv_heads, head_dim]; sequences own blocks via a block table (vLLM)."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__((num_blocks, block_size, kv_heads, head_dim), dtype, device)
        self.block_size = block_size

    def write(self, k: torch.Tensor, v: torch.Tensor, batch: CacheBatch) -> None:
        b, kvh, t, d = k.shape
        write_paged_kv(
            k.transpose(1, 2).reshape(b * t, kvh, d), v.transpose(1, 2).reshape(b * t, kvh, d), self.k, self.v, batch.slot_mapping
        )

    def attend(self, q: torch.Tensor, batch: CacheBatch, scale: float) -> torch.Tensor:
        if q.shape[2] == 1:
            out = paged_decode_attention(q[:, :, 0], self.k, self.v, batch.block_table, batch.lengths, scale)
            return out.unsqueeze(2)
        # Several new tokens on top of cached ones (chunked prefill): gather the blocks, then mask.
        return masked_attention(q, *self.gather(batch), batch.positions, scale)

    def gather(self, batch: CacheBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's keys and values as [B, KVH, max_length, D], read through its block table."""
        n_blocks = -(-batch.max_length // self.block_size)
        table = batch.block_table[:, :n_blocks].long().clamp_min(0)
        b = table.shape[0]
        k = self.k[table].reshape(b, n_blocks * self.block_size, *self.k.shape[2:])[:, : batch.max_length]
        v = self.v[table].reshape(b, n_blocks * self.block_size, *self.v.shape[2:])[:, : batch.max_length]
        return k.transpose(1, 2), v.transpose(1, 2)
