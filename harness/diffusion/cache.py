"""The forward a diffusion sampler step runs: the whole sequence, or Fast-dLLM's approximate K/V caches (refresh
with one full forward, then run only the positions that change against the cached keys and values of the rest)."""
import torch

import zoo
from cache import CacheBatch
from harness.engine.cache_pool import CachePool

CACHES = (None, "prefix", "dual")


class BlockForward:
    """Logits at the current block's positions, by the route the cache setting picks.

    None: every step runs the full sequence. "prefix": a block's first step runs the full sequence and caches every
    position's K/V; its other steps run the block and the suffix after it (which rewrite their own K/V) against the
    cached prefix. "dual": the other steps run the block alone; prefix and masked suffix K/V come from the cache.
    refresh_every=n also refreshes at every n-th step of a block (1: every step, so it equals no cache exactly).
    """

    def __init__(self, model, cache: str | None, refresh_every: int | None, lengths: list[int]):
        param = next(model.parameters())
        rows, width = len(lengths), max(lengths)
        self.model, self.cache, self.refresh_every = model, cache, refresh_every
        # rows are right-padded to the longest: keys at or past a row's length are hidden from its queries
        self.full = CacheBatch(
            positions=torch.arange(width, device=param.device).expand(rows, width),
            lengths=torch.tensor(lengths, device=param.device), max_length=width, step="prefill",
            slots=torch.arange(rows, device=param.device), slot_range=slice(0, rows),
        )
        self.pool = None
        if cache is not None:  # contiguous rows of the full padded width (block_size is a paged-only setting)
            self.pool = CachePool(model.cache_specs(), "contiguous", rows, width, 1, [], param.dtype, param.device)
        self.cache_bytes = sum(zoo.cache_bytes(model, n) for n in lengths) if cache is not None else 0
        self.cache_bytes_allocated = 0 if self.pool is None else self.pool.nbytes

    def __call__(self, x: torch.Tensor, answer: torch.Tensor, first: int, last: int, step: int) -> torch.Tensor:
        """x: [B, width] tokens; answer: [B, gen_length] each row's answer positions, the block is answer[:, first:last];
        step: the step within the block. Returns logits [B, last - first, vocab]."""
        block = answer[:, first:last]
        if self.pool is None or step == 0 or (self.refresh_every is not None and step % self.refresh_every == 0):
            caches = None if self.pool is None else self.pool.layers
            logits = self.model(x, self.full.positions, caches, self.full)
            return logits.gather(1, block.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        queries = block if self.cache == "dual" else answer[:, first:]
        batch = CacheBatch(positions=queries, lengths=self.full.lengths, max_length=self.full.max_length,
                           step="chunk", slots=self.full.slots, slot_range=self.full.slot_range)
        return self.model(x.gather(1, queries), queries, self.pool.layers, batch)[:, : last - first]
