"""A model reading text through the engine's cache: a short prefix as one prefill, then one token a step, so each
later prediction is made from what the cache kept (a window, sinks, eviction by score) and not from the whole past,
as a long generation's tokens are. An uncached forward sees every earlier token; these are the figures a cache
policy's cost in quality is read from: bits per byte, and the answers of labelled positions (MQAR, a pass key)."""
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from cache import CacheBatch
from harness.engine.cache_pool import CachePool


@torch.inference_mode()
def cached_logits(model, tokens: torch.Tensor, prefix: int,
                  last: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """tokens [B, T]: (t, logits [B, vocab] predicting token t + 1) for t = prefix - 1 .. last (default T - 2: every
    t with a next token to score; T - 1 reads the last token's prediction too), the first from the prefill of
    tokens[:, :prefix], each later one from a decode step fed token t, in the contiguous layout."""
    count, length = tokens.shape
    if not 1 <= prefix < length:
        raise ValueError(f"prefix must be in [1, {length - 1}] for sequences of {length} tokens, got {prefix}")
    last = length - 2 if last is None else last
    if not prefix - 1 <= last < length:
        raise ValueError(f"last must be in [{prefix - 1}, {length - 1}] for a prefix of {prefix} and sequences of "
                         f"{length} tokens, got {last}")
    param = next(model.parameters())
    pool = CachePool(model.cache_specs(), "contiguous", count, length, 16, [], param.dtype, param.device)
    slots = torch.arange(count, device=param.device)
    tokens = tokens.to(param.device)

    def batch(positions: torch.Tensor, step: str) -> CacheBatch:
        end = int(positions[0, -1]) + 1
        return CacheBatch(positions, torch.full((count,), end, dtype=torch.int32, device=param.device), end, step,
                          slots=slots, slot_range=slice(0, count))

    positions = torch.arange(prefix, device=param.device).expand(count, prefix)
    prefill = batch(positions, "prefill")
    yield prefix - 1, model(tokens[:, :prefix], positions, pool.layers, prefill, last_only=True)[:, 0]
    for t in range(prefix, last + 1):
        positions = torch.full((count, 1), t, device=param.device)
        yield t, model(tokens[:, t:t + 1], positions, pool.layers, batch(positions, "decode"))[:, 0]


def cached_bits_per_byte(model, windows: torch.Tensor, prefix: int = 8) -> float:
    """windows [B, T] token ids (bytes): the mean bits of each token after the first `prefix` + 1, each predicted
    through the cache."""
    count, length = windows.shape
    if not 1 <= prefix < length - 1:
        raise ValueError(f"prefix must be in [1, {length - 2}] for windows of {length} tokens, got {prefix}")
    nats = sum(F.cross_entropy(logits.float(), windows[:, t + 1].to(logits.device), reduction="sum").item()
               for t, logits in cached_logits(model, windows, prefix) if t >= prefix)
    return nats / (count * (length - 1 - prefix)) / math.log(2)


def cached_answers(model, tokens: torch.Tensor, labels: torch.Tensor, prefix: int) -> torch.Tensor:
    """Whether the argmax through the cache answers each labelled position (labels[b, t] >= 0: the token the
    logits at t must give), in row-major order: bool [answers]. Labelled positions must lie at or past prefix - 1."""
    if (labels[:, :max(0, prefix - 1)] >= 0).any():
        raise ValueError(f"a labelled position lies inside the prefill (prefix={prefix}): its logits are not read")
    hits = torch.zeros(labels.shape, dtype=torch.bool)
    for t, logits in cached_logits(model, tokens, prefix, last=tokens.shape[1] - 1):  # a label may sit at the end
        hits[:, t] = logits.argmax(dim=-1).cpu() == labels[:, t]
    return hits[labels >= 0]
