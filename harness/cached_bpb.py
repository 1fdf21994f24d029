"""Bits per byte of a model reading text through the engine's cache: a short prefix as one prefill, then one token
a step, so each later prediction is made from what the cache kept (a window, sinks, eviction by score) and not
from the whole past, as a long generation's tokens are. An uncached forward sees every earlier token; this is the
figure a cache policy's cost in quality is read from."""
import math

import torch
import torch.nn.functional as F

from cache import CacheBatch
from harness.engine.cache_pool import CachePool


@torch.inference_mode()
def cached_bits_per_byte(model, windows: torch.Tensor, prefix: int = 8) -> float:
    """windows [B, T] token ids (bytes): the mean bits of each token after the first `prefix` + 1, predicted with
    the model's per-layer caches in the contiguous layout, fed the true tokens one a step."""
    count, length = windows.shape
    if not 1 <= prefix < length - 1:
        raise ValueError(f"prefix must be in [1, {length - 2}] for windows of {length} tokens, got {prefix}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    pool = CachePool(model.cache_specs(), "contiguous", count, length, 16, [], dtype, device)
    slots = torch.arange(count, device=device)
    windows = windows.to(device)

    def batch(positions: torch.Tensor, step: str) -> CacheBatch:
        end = int(positions[0, -1]) + 1
        return CacheBatch(positions, torch.full((count,), end, dtype=torch.int32, device=device), end, step,
                          slots=slots, slot_range=slice(0, count))

    positions = torch.arange(prefix, device=device).expand(count, prefix)
    model(windows[:, :prefix], positions, pool.layers, batch(positions, "prefill"), last_only=True)
    nats = 0.0
    for t in range(prefix, length - 1):  # feed token t, predict token t + 1
        positions = torch.full((count, 1), t, device=device)
        logits = model(windows[:, t:t + 1], positions, pool.layers, batch(positions, "decode"))[:, 0]
        nats += F.cross_entropy(logits.float(), windows[:, t + 1], reduction="sum").item()
    return nats / (count * (length - 1 - prefix)) / math.log(2)
