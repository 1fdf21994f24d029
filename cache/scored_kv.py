"""The caches of scored retention (cache/eviction.py): keys and values with each row's position and score, held rows
packed at the front of a sequence's rows. A sequence of n tokens holds its rows 0 .. min(n, capacity) - 1, so a
decode step reads its first rows, unordered, with the kernels a ring buffer or a paged table already uses.

A prefill attends over its whole prompt, scores every prompt key, and writes only those it keeps. A decode step
writes its token into the next row (one past capacity once full), attends, updates the scores from its query's
weights and, when the sequence holds one too many, moves the new token into the row of the one that leaves.

ScoredKV gives each batch slot capacity + 1 rows; PagedScoredKV finds a sequence's rows through its block table,
row r in logical block r // block_size, so the block manager holds only the blocks those rows fill."""
import torch

from cache.eviction import attention_weights, keep_mask, snap_votes, softmax_weights, updated_scores
from cache.layouts import KVTensors, fresh_attention
from cache.spec import CacheBatch, CacheSpec
from kernels import contiguous_decode_attention, paged_decode_attention

QUERY_BLOCK = 256  # prompt queries whose attention weights one pass holds: [B, H, 256, T] floats, not [B, H, T, T]


def refuse_kv_format(spec: CacheSpec, kv_format: str) -> None:
    if kv_format != "auto":
        raise ValueError(f"scored retention ({spec.retention.describe()}) keeps rows in the model's dtype: "
                         f"kv_dtype {kv_format!r} is not supported with it; use kv_dtype='auto'")


class ScoredKV(KVTensors):
    """Contiguous: [slots, kv_heads, capacity + 1, dim], a row's position and score in [slots, capacity + 1]."""

    def __init__(self, spec: CacheSpec, max_batch: int, max_len: int, dtype, device, kv_format: str = "auto"):
        refuse_kv_format(spec, kv_format)
        self.rows = spec.retention.rows(max_len)
        super().__init__(spec, lambda dim: (max_batch, spec.kv_heads, self.rows, dim), dtype, device, kv_format)
        self.positions = torch.full((max_batch, self.rows), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(max_batch, self.rows, dtype=torch.float32, device=device)

    # ---- where a sequence's rows live (the layouts differ only here) -----------------------------------------

    def cells(self, batch: CacheBatch, seqs: torch.Tensor, rows: torch.Tensor) -> tuple[tuple, tuple]:
        """(index of those rows' keys / values [N, kv_heads, dim], index of their positions / scores [N]) for
        row rows[i] of the batch's sequence seqs[i]."""
        slots = batch.slots[seqs]
        return (slots, slice(None), rows), (slots, rows)

    def first_rows(self, batch: CacheBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's rows 0 .. width - 1: positions and scores [B, width]."""
        slots = batch.slots if batch.slot_range is None else batch.slot_range  # consecutive: views, no copies
        return self.positions[slots, :width], self.scores[slots, :width]

    def query_logits(self, q: torch.Tensor, batch: CacheBatch, width: int, scale: float) -> torch.Tensor:
        """q [B, H, D] against each sequence's rows 0 .. width - 1: scaled logits [B, H, 1, width]."""
        slots = batch.slots if batch.slot_range is None else batch.slot_range
        keys = self.k[slots, :, :width]  # [B, KVH, width, D]
        grouped = q.reshape(len(q), keys.shape[1], -1, q.shape[-1])
        return torch.matmul(grouped, keys.transpose(-1, -2)).view(len(q), q.shape[1], 1, width) * scale

    def store_scores(self, batch: CacheBatch, scores: torch.Tensor) -> None:
        slots = batch.slots if batch.slot_range is None else batch.slot_range
        self.scores[slots, :scores.shape[1]] = scores

    def decode_attention(self, q: torch.Tensor, batch: CacheBatch, rows: torch.Tensor, scale: float) -> torch.Tensor:
        return contiguous_decode_attention(q, self.k, self.v, batch.slots, rows, scale, self.v.shape[-1],
                                           rows_read=min(batch.max_length, self.rows), slot_range=batch.slot_range)

    def width(self, batch: CacheBatch) -> int:
        return min(batch.max_length, self.rows)

    # ---- the steps ------------------------------------------------------------------------------------------

    def write(self, k: torch.Tensor, v: torch.Tensor, batch: CacheBatch) -> None:
        raise ValueError(f"a scored cache ({self.retention.describe()}) writes as it attends: call attend_scored")

    def attend_scored(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: CacheBatch,
                      scale: float) -> torch.Tensor:
        """q [B, H, T, D], this step's k and v [B, KVH, T, D]: attention output [B, H, T, D], with the cache left
        holding what the retention keeps."""
        if batch.is_prefill:
            return self.prefill(q, k, v, batch, scale)
        if batch.is_decode:
            return self.decode(q, k, v, batch, scale)
        raise ValueError(f"a scored cache ({self.retention.describe()}) takes a whole prompt, then one token a "
                         f"step: not a {batch.step!r} step (chunked prefill, speculative verification)")

    def prefill(self, q, k, v, batch: CacheBatch, scale: float) -> torch.Tensor:
        out = fresh_attention(q, k, v, batch.positions, self.retention, scale)
        positions = torch.where(batch.real_tokens(), batch.positions.long(), -1)
        scores = self.prompt_scores(q, k, positions, batch, scale)
        keep = keep_mask(self.retention, scores, positions, batch.lengths)
        seqs, steps = keep.nonzero(as_tuple=True)
        rows = (keep.cumsum(dim=1) - 1)[seqs, steps]  # kept keys packed from row 0, in position order
        kv, meta = self.cells(batch, seqs, rows)
        self.k[kv], self.v[kv] = k[seqs, :, steps], v[seqs, :, steps]
        self.positions[meta], self.scores[meta] = positions[seqs, steps], scores[seqs, steps]
        return out

    def prompt_scores(self, q, k, positions: torch.Tensor, batch: CacheBatch, scale: float) -> torch.Tensor:
        """[B, T] each prompt key's score after the prompt's queries (H2O: all of them; TOVA: the last one; SnapKV:
        the votes of the last `window`)."""
        real = positions >= 0
        if self.retention.score == "snapkv":
            first = max(0, int(batch.lengths.min()) - self.retention.recent)  # no row's window starts earlier
            queries = positions[:, first:]
            in_window = (queries >= 0) & (queries >= batch.lengths.long()[:, None] - self.retention.recent)
            visible = (positions[:, None, :] <= queries[:, :, None]) & real[:, None, :] & in_window[:, :, None]
            return snap_votes(attention_weights(q[:, :, first:], k, visible, scale), in_window)
        if self.retention.score == "tova":
            last = batch.last_tokens()
            seqs = torch.arange(q.shape[0], device=q.device)
            query, newest = q[seqs, :, last][:, :, None], positions[seqs, last][:, None]  # [B, H, 1, D], [B, 1]
            visible = (positions[:, None, :] <= newest[:, :, None]) & real[:, None, :]
            weights = attention_weights(query, k, visible, scale)
            return updated_scores(self.retention, torch.zeros_like(positions, dtype=torch.float32), weights)
        scores = torch.zeros(positions.shape, dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[2], QUERY_BLOCK):
            queries = positions[:, start:start + QUERY_BLOCK]
            visible = ((positions[:, None, :] <= queries[:, :, None]) & real[:, None, :]
                       & (queries[:, :, None] >= 0))  # padding queries weigh nothing
            weights = attention_weights(q[:, :, start:start + QUERY_BLOCK], k, visible, scale)
            scores = updated_scores(self.retention, scores, weights)
        return scores

    def decode(self, q, k, v, batch: CacheBatch, scale: float) -> torch.Tensor:
        seqs = torch.arange(q.shape[0], device=q.device)
        newest = self.retention.rows_held(batch.lengths - 1).long()  # rows 0 .. newest - 1 are held; it takes the next
        kv, meta = self.cells(batch, seqs, newest)
        self.k[kv], self.v[kv] = k[:, :, 0], v[:, :, 0]
        self.positions[meta], self.scores[meta] = batch.positions[:, 0].long(), 0.0
        out = self.decode_attention(q[:, :, 0], batch, newest + 1, scale)
        width = self.width(batch)
        positions, scores = self.first_rows(batch, width)
        live = torch.arange(width, device=q.device)[None, :] <= newest[:, None]  # rows past a sequence's are stale
        if self.retention.score != "snapkv":  # SnapKV's scores are the prompt's votes: decode reads no weights
            weights = softmax_weights(self.query_logits(q[:, :, 0], batch, width, scale), live[:, None, :])
            scores = torch.where(live, updated_scores(self.retention, scores, weights), 0.0)
            self.store_scores(batch, scores)
        else:
            scores = torch.where(live, scores, 0.0)
        self.evict(batch, newest, torch.where(live, positions, -1), scores)
        return out.unsqueeze(2)

    def evict(self, batch: CacheBatch, newest: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Where a sequence holds one row more than its capacity: the new token (row `newest`) takes the row of the
        token that leaves (if that is the new token itself, it is simply gone: its row is past the held ones)."""
        leaving = (positions >= 0) & ~keep_mask(self.retention, scores, positions, batch.lengths)
        seqs = leaving.any(dim=1).nonzero()[:, 0]
        if not len(seqs):
            return
        (src_kv, src_meta), (dst_kv, dst_meta) = (self.cells(batch, seqs, rows)
                                                  for rows in (newest[seqs], leaving[seqs].float().argmax(dim=1)))
        for tensor in (self.k, self.v):
            tensor[dst_kv] = tensor[src_kv]
        for tensor in (self.positions, self.scores):
            tensor[dst_meta] = tensor[src_meta]

    def kept_positions(self, slot: int, held: int) -> list[int]:
        """The positions a slot's sequence holds in its first `held` rows, ascending (tests, bookkeeping)."""
        return sorted(self.positions[slot, :held].tolist())


class PagedScoredKV(ScoredKV):
    """Paged: a pool [num_blocks, block_size, kv_heads, dim] (stored head-major, as PagedKV), a row's position and
    score in [num_blocks, block_size]; a sequence's row r is offset r % block_size of block table[r // block_size]."""

    def __init__(self, spec: CacheSpec, num_blocks: int, block_size: int, group: int, dtype, device,
                 kv_format: str = "auto"):
        refuse_kv_format(spec, kv_format)
        KVTensors.__init__(self, spec, lambda dim: (num_blocks, spec.kv_heads, block_size, dim), dtype, device,
                           kv_format)
        self.k, self.v = self.k.transpose(1, 2), self.v.transpose(1, 2)  # head-major storage, block-major view
        self.block_size, self.group = block_size, group
        self.positions = torch.full((num_blocks, block_size), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=device)

    def cells(self, batch: CacheBatch, seqs: torch.Tensor, rows: torch.Tensor) -> tuple[tuple, tuple]:
        blocks = batch.block_tables[self.group][seqs, rows // self.block_size].long()
        index = (blocks, rows % self.block_size)
        return index, index

    def table_rows(self, batch: CacheBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each sequence's rows 0 .. width - 1, [B, width] each (a missing block reads block 0:
        those rows lie past the sequence's held ones, which the caller masks)."""
        rows = torch.arange(width, device=batch.lengths.device)
        table = batch.block_tables[self.group][:, rows // self.block_size].long().clamp_min(0)
        return table, (rows % self.block_size).expand_as(table)

    def first_rows(self, batch: CacheBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = self.table_rows(batch, width)
        return self.positions[blocks, offsets], self.scores[blocks, offsets]

    def query_logits(self, q: torch.Tensor, batch: CacheBatch, width: int, scale: float) -> torch.Tensor:
        """Block by block: the sequences' first blocks gathered whole from the head-major pool, each multiplied by
        its query group where it lies (no copy into one [B, KVH, width, D] tensor)."""
        n = -(-width // self.block_size)
        table = batch.block_tables[self.group][:, :n].long().clamp_min(0)
        pool = self.k.transpose(1, 2)  # the head-major storage [num_blocks, KVH, bs, D]
        stored = torch.index_select(pool, 0, table.reshape(-1)).view(*table.shape, *pool.shape[1:])  # [B, n, ...]
        grouped = q.reshape(len(q), 1, stored.shape[2], -1, q.shape[-1])  # [B, 1, KVH, G, D]
        logits = torch.matmul(grouped, stored.transpose(-1, -2))  # [B, n, KVH, G, bs]
        logits = logits.permute(0, 2, 3, 1, 4).reshape(len(q), q.shape[1], 1, n * self.block_size)
        return logits[..., :width] * scale

    def store_scores(self, batch: CacheBatch, scores: torch.Tensor) -> None:
        blocks, offsets = self.table_rows(batch, scores.shape[1])
        columns = torch.arange(scores.shape[1], device=scores.device) // self.block_size
        live = batch.block_tables[self.group][:, columns] >= 0
        self.scores[blocks[live], offsets[live]] = scores[live]

    def decode_attention(self, q: torch.Tensor, batch: CacheBatch, rows: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, self.k, self.v, batch.block_tables[self.group], rows.to(torch.int32),
                                      scale)

    def width(self, batch: CacheBatch) -> int:
        return min(batch.max_length, self.retention.capacity + 1)

    def kept_positions(self, table: list[int], held: int) -> list[int]:
        """The positions a sequence whose block table is `table` holds in its first `held` rows, ascending."""
        return sorted(self.positions[table[r // self.block_size], r % self.block_size].item() for r in range(held))
