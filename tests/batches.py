"""The CacheBatch a test hands a mixer directly, as the engine would build it for rows in given batch slots."""
import torch

from cache import CacheBatch


def slot_batch(positions: torch.Tensor, prefill: bool, slots=None, lengths=None) -> CacheBatch:
    """positions [B, T] of the new tokens; lengths default to each row ending at its last position (give them for
    right-padded rows); slots default 0..B-1. The step kind follows: a prefill, one new token (decode), or several
    on top of the cache (chunk)."""
    b, t = positions.shape
    lengths = positions[:, -1] + 1 if lengths is None else torch.as_tensor(lengths)
    slots = torch.arange(b) if slots is None else torch.as_tensor(slots)
    first = int(slots[0])
    consecutive = slots.tolist() == list(range(first, first + b))
    return CacheBatch(positions=positions, lengths=lengths.int(), max_length=int(lengths.max()),
                      step="prefill" if prefill else "decode" if t == 1 else "chunk",
                      slots=slots, slot_range=slice(first, first + b) if consecutive else None)
