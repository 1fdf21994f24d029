"""A contiguous cache for scored retention (cache/eviction.py): per batch slot, `capacity + 1` rows of keys and
values with each row's position and score. Held rows are packed at the front: a sequence of n tokens holds rows
0 .. min(n, capacity) - 1, so a decode step reads its first rows, unordered, with the same kernel as a ring buffer.

A prefill attends over its whole prompt, scores every prompt key, and writes only those it keeps. A decode step
writes its token into the next row (the spare one once full), attends, updates the scores from its query's
weights and, when the sequence holds one too many, moves the new token into the row of the one that leaves."""
import torch

from cache.eviction import attention_weights, keep_mask, updated_scores
from cache.layouts import KVTensors, fresh_attention
from cache.spec import CacheBatch, CacheSpec
from kernels import contiguous_decode_attention

QUERY_BLOCK = 256  # prompt queries whose attention weights one pass holds: [B, H, 256, T] floats, not [B, H, T, T]


class ScoredKV(KVTensors):
    def __init__(self, spec: CacheSpec, max_batch: int, max_len: int, dtype, device, kv_format: str = "auto"):
        if kv_format != "auto":
            raise ValueError(f"scored retention ({spec.retention.describe()}) keeps rows in the model's dtype: "
                             f"kv_dtype {kv_format!r} is not supported with it; use kv_dtype='auto'")
        self.rows = spec.retention.rows(max_len)
        super().__init__(spec, lambda dim: (max_batch, spec.kv_heads, self.rows, dim), dtype, device, kv_format)
        self.positions = torch.full((max_batch, self.rows), -1, dtype=torch.long, device=device)  # -1: empty row
        self.scores = torch.zeros(max_batch, self.rows, dtype=torch.float32, device=device)

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
        real = batch.real_tokens()
        positions = torch.where(real, batch.positions.long(), -1)
        scores = self.prompt_scores(q, k, positions, batch, scale)
        keep = keep_mask(self.retention, scores, positions, batch.lengths)
        slots = batch.slots
        self.positions[slots] = -1
        self.scores[slots] = 0.0
        seqs, steps = keep.nonzero(as_tuple=True)
        rows = (keep.cumsum(dim=1) - 1)[seqs, steps]  # kept keys packed from row 0, in position order
        self.k[slots[seqs], :, rows] = k[seqs, :, steps]
        self.v[slots[seqs], :, rows] = v[seqs, :, steps]
        self.positions[slots[seqs], rows] = positions[seqs, steps]
        self.scores[slots[seqs], rows] = scores[seqs, steps]
        return out

    def prompt_scores(self, q, k, positions: torch.Tensor, batch: CacheBatch, scale: float) -> torch.Tensor:
        """[B, T] each prompt key's score after the prompt's queries (H2O: all of them; TOVA: the last one)."""
        real = positions >= 0
        if self.retention.score == "tova":
            last = batch.last_tokens()
            rows = torch.arange(q.shape[0], device=q.device)
            query, newest = q[rows, :, last][:, :, None], positions[rows, last][:, None]  # [B, H, 1, D], [B, 1]
            visible = (positions[:, None, :] <= newest[:, :, None]) & real[:, None, :]
            weights = attention_weights(query, k, visible, scale)
            return updated_scores(self.retention, torch.zeros_like(positions, dtype=torch.float32), weights,
                                  torch.zeros_like(last))
        scores = torch.zeros(positions.shape, dtype=torch.float32, device=q.device)
        for start in range(0, q.shape[2], QUERY_BLOCK):
            queries = positions[:, start:start + QUERY_BLOCK]
            visible = ((positions[:, None, :] <= queries[:, :, None]) & real[:, None, :]
                       & (queries[:, :, None] >= 0))  # padding queries weigh nothing
            weights = attention_weights(q[:, :, start:start + QUERY_BLOCK], k, visible, scale)
            scores = updated_scores(self.retention, scores, weights, torch.zeros(len(q), device=q.device))
        return scores

    def decode(self, q, k, v, batch: CacheBatch, scale: float) -> torch.Tensor:
        slots, lengths = batch.slots, batch.lengths
        held = self.retention.rows_held(lengths - 1).long()  # rows 0 .. held - 1 are full; the new token takes the next
        self.k[slots, :, held] = k[:, :, 0]
        self.v[slots, :, held] = v[:, :, 0]
        self.positions[slots, held] = batch.positions[:, 0].long()
        self.scores[slots, held] = 0.0
        out = contiguous_decode_attention(q[:, :, 0], self.k, self.v, slots, held + 1, scale, self.v.shape[-1],
                                          rows_read=min(batch.max_length, self.rows), slot_range=batch.slot_range)
        width = min(batch.max_length, self.rows)
        rows = torch.arange(width, device=q.device)
        visible = (rows[None, :] <= held[:, None])[:, None, :]  # [B, 1, width]
        weights = attention_weights(q, self.k[slots, :, :width], visible, scale)
        scores = updated_scores(self.retention, self.scores[slots, :width], weights, torch.zeros_like(held))
        self.scores[slots, :width] = torch.where(visible[:, 0], scores, 0.0)
        self.evict(slots, held, lengths, width)
        return out.unsqueeze(2)

    def evict(self, slots: torch.Tensor, newest: torch.Tensor, lengths: torch.Tensor, width: int) -> None:
        """Where a sequence holds one row more than its capacity: the new token (row `newest`) takes the row of the
        token that leaves, and the spare row empties."""
        positions = self.positions[slots, :width]
        leaving = (positions >= 0) & ~keep_mask(self.retention, self.scores[slots, :width], positions, lengths)
        seqs = leaving.any(dim=1).nonzero()[:, 0]
        if not len(seqs):
            return
        slot, src, dst = slots[seqs], newest[seqs], leaving[seqs].float().argmax(dim=1)
        for tensor in (self.k, self.v):
            tensor[slot, :, dst] = tensor[slot, :, src]
        for tensor in (self.positions, self.scores):
            tensor[slot, dst] = tensor[slot, src]
        self.positions[slot, src] = -1  # when the new token itself leaves (dst == src), it is simply gone
        self.scores[slot, src] = 0.0

    def kept_positions(self, slot: int) -> list[int]:
        """The positions a slot's sequence holds, ascending (tests and `zoo compare`'s bookkeeping)."""
        return sorted(p for p in self.positions[slot].tolist() if p >= 0)
