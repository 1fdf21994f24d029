"""KV-cache layouts the engine allocates per attention layer: contiguous rows (a rolling buffer under a
sliding window), or a paged block pool; plus the hand-off an uncached forward uses between shared layers."""
import torch
import torch.nn.functional as F

from cache.spec import CacheBatch, CacheSpec
from kernels import contiguous_decode_attention, mla_decode_attention, paged_decode_attention, write_paged_kv


def visible_keys(key_positions: torch.Tensor, query_positions: torch.Tensor, window: int | None,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, L] mask: a query sees keys at or before it, within the window (W keys including itself); -1 = empty.

    lengths [B] (a non-causal layer, which has no window): every query sees all keys before its row's length.
    """
    keys, queries = key_positions.unsqueeze(-2), query_positions.unsqueeze(-1)
    if lengths is not None:
        queries = (lengths.long() - 1)[:, None, None].expand_as(queries)  # as if each query were its row's newest
    visible = (keys <= queries) & (keys >= 0)
    if window is not None:
        visible &= keys > queries - window
    return visible


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """q: [B, H, T, D]; k: [B, KVH, L, D]; v: [B, KVH, L, Dv]; visible: [B, T, L]. Returns [B, H, T, Dv].

    SDPA with a boolean mask: its fused CPU kernel reads a 16-bit cache as it is, where matmuls over the
    transposed cache copy it first (bf16 decode 4x faster at batch 14 x 4096 keys; no slower in fp32).
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1), scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int | None,
                    scale: float, causal: bool = True, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the keys of this call alone (no cache, or a prefill from 0): causal, optionally windowed;
    or non-causal, where lengths [B] (optional) hides each row's right padding, the keys at or past its length."""
    gqa = k.shape[1] != q.shape[1]
    value_dim, width = v.shape[-1], max(v.shape[-1], q.shape[-1])
    if value_dim != q.shape[-1]:
        # SDPA's fused CPU kernel needs equal head dims (MLA's differ), else a ~6x slower path; zeros change nothing
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    t = q.shape[2]
    if not causal:
        padding = None
        if lengths is not None:
            padding = (torch.arange(k.shape[2], device=k.device) < lengths[:, None])[:, None, None]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding, scale=scale, enable_gqa=gqa)
    elif window is None or window >= t:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # queries in chunks of `window`, each against the keys its window can reach: O(T·W) work, not O(T²)
        chunks = []
        for start in range(0, t, window):
            end, first_key = min(start + window, t), max(0, start - window + 1)
            mask = visible_keys(positions[:, first_key:end], positions[:, start:end], window).unsqueeze(1)
            chunks.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, first_key:end], v[:, :, first_key:end],
                                                         attn_mask=mask, scale=scale, enable_gqa=gqa))
        out = torch.cat(chunks, dim=2)
    return out[..., :value_dim]


class KVTensors:
    """Keys (for a "latent" cache, the one row per token) and values; their bytes are the layer's measured cache."""

    def __init__(self, spec: CacheSpec, zeros):
        """zeros(dim): a zeroed tensor of this layout whose rows are `dim` wide."""
        self.window = spec.window
        self.k = zeros(spec.head_dim)
        self.v = zeros(spec.value_dim) if spec.kind == "kv" else None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.v is None else self.v.nbytes)

    def attend_over(self, q, k, v, visible, scale: float, value_dim: int | None) -> torch.Tensor:
        """A latent cache's value is the first value_dim columns of its key row: attend with the whole row as
        the value (no copy, equal head dims for SDPA's fused kernel) and keep those columns of the output."""
        if v is None:
            return masked_attention(q, k, k, visible, scale)[..., :value_dim]
        return masked_attention(q, k, v, visible, scale)


class ContiguousKV(KVTensors):
    """One row per batch slot, [slots, kv_heads, rows, dim], written in place (gpt-fast's static cache).

    rows = max_len, or the window: then a rolling buffer where position p lives in row p mod window.
    """

    def __init__(self, spec: CacheSpec, max_batch: int, max_len: int, dtype, device):
        self.rows = spec.tokens_held(max_len)
        self.rolling = self.rows < max_len
        super().__init__(spec, lambda dim: torch.zeros(max_batch, spec.kv_heads, self.rows, dim, dtype=dtype, device=device))

    def write(self, k: torch.Tensor, v: torch.Tensor | None, batch: CacheBatch) -> None:
        """k, v: [B, KVH, T, D] for the tokens at batch.positions; a rolling buffer keeps the last `rows` of them."""
        positions = batch.positions[:, -self.rows:]
        k = k[:, :, -self.rows:]
        index = (batch.slots[:, None], slice(None), positions % self.rows if self.rolling else positions)
        self.k[index] = k.transpose(1, 2)
        if self.v is not None:
            self.v[index] = v[:, :, -self.rows:].transpose(1, 2)

    def attend(self, q: torch.Tensor, batch: CacheBatch, scale: float, value_dim: int | None = None,
               causal: bool = True) -> torch.Tensor:
        """causal=False: each query sees every cached key of its row before batch.lengths, not only earlier ones."""
        if q.shape[2] == 1:
            # one query per sequence sees every live row (a window never binds here: a rolling buffer holds just the
            # window, unordered, which softmax does not mind; an unrolled one is at least max_len wide)
            lengths = batch.lengths.clamp(max=self.rows) if self.rolling else batch.lengths
            out = contiguous_decode_attention(q[:, :, 0], self.k, self.v, batch.slots, lengths, scale,
                                              value_dim or self.v.shape[-1], rows_read=min(batch.max_length, self.rows),
                                              slot_range=batch.slot_range)
            return out.unsqueeze(2)
        if self.rolling:
            raise ValueError("a rolling-window cache attends one new token per sequence after its prefill")
        rows = batch.slots if batch.slot_range is None else batch.slot_range
        k = self.k[rows, :, : batch.max_length]
        v = None if self.v is None else self.v[rows, :, : batch.max_length]
        key_positions = torch.arange(batch.max_length, device=q.device).unsqueeze(0)
        visible = visible_keys(key_positions, batch.positions, self.window, None if causal else batch.lengths)
        return self.attend_over(q, k, v, visible, scale, value_dim)


class PagedKV(KVTensors):
    """A pool of fixed-size blocks, indexed [num_blocks, block_size, kv_heads, dim]; sequences own blocks via the
    block table of this layer's cache group (vLLM). Under a window, blocks that leave it go back to the pool.

    Stored head-major, [num_blocks, kv_heads, block_size, dim] (vLLM's CPU layout), seen through a transposed view:
    one KV head's rows in a block are then side by side, so decode reads whole runs of them instead of 128-byte
    rows strided by the other heads (bf16 paged attention 2x faster on CPU at 16 x 4096 keys).
    """

    def __init__(self, spec: CacheSpec, num_blocks: int, block_size: int, group: int, dtype, device):
        super().__init__(spec, lambda dim: torch.zeros(num_blocks, spec.kv_heads, block_size, dim, dtype=dtype,
                                                       device=device).transpose(1, 2))
        self.block_size, self.group = block_size, group

    def write(self, k: torch.Tensor, v: torch.Tensor | None, batch: CacheBatch) -> None:
        b, kvh, t, _ = k.shape
        flat_k = k.transpose(1, 2).reshape(b * t, kvh, -1)
        flat_v = None if v is None else v.transpose(1, 2).reshape(b * t, kvh, -1)
        write_paged_kv(flat_k, flat_v, self.k, self.v, batch.slot_mappings[self.group])

    def attend(self, q: torch.Tensor, batch: CacheBatch, scale: float, value_dim: int | None = None,
               causal: bool = True) -> torch.Tensor:
        """causal=False: each query sees every cached key of its row before batch.lengths, not only earlier ones
        (the one-query kernels already read every key before lengths: the same keys in both modes)."""
        table = batch.block_tables[self.group]
        if q.shape[2] == 1 and self.v is None:
            return mla_decode_attention(q[:, :, 0], self.k[:, :, 0], table, batch.lengths, scale, value_dim).unsqueeze(2)
        if q.shape[2] == 1:
            out = paged_decode_attention(q[:, :, 0], self.k, self.v, table, batch.lengths, scale, window=self.window)
            return out.unsqueeze(2)
        # Several new tokens on top of cached ones: gather the blocks, then mask.
        k, v = self.gather(table, batch.max_length)
        key_positions = torch.arange(batch.max_length, device=q.device).unsqueeze(0)
        visible = visible_keys(key_positions, batch.positions, self.window, None if causal else batch.lengths)
        return self.attend_over(q, k, v, visible, scale, value_dim)

    def gather(self, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each sequence's first `length` keys and values as [B, KVH, length, D], read through its block table.

        Freed or unused entries (-1) read block 0: those positions are masked out by the caller.
        """
        n_blocks = -(-length // self.block_size)
        table = table[:, :n_blocks].long().clamp_min(0)

        def read(pool):
            flat = pool[table].reshape(table.shape[0], n_blocks * self.block_size, *pool.shape[2:])
            return flat[:, :length].transpose(1, 2)

        return read(self.k), None if self.v is None else read(self.v)


class CallKV:
    """The keys and values one uncached forward computed in a producer layer, handed to the layers sharing them."""

    def __init__(self):
        self.k = self.v = None

    def write(self, k: torch.Tensor, v: torch.Tensor, batch) -> None:
        self.k, self.v = k, v

    def attend(self, q: torch.Tensor, batch, scale: float, value_dim: int | None = None) -> torch.Tensor:
        positions = torch.arange(q.shape[2], device=q.device).unsqueeze(0)
        return fresh_attention(q, self.k, self.v, positions, None, scale)
