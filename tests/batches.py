"""What a test hands a mixer directly: the CacheBatch the engine would build for rows in given batch slots, and a
sequence fed through a cache chunk by chunk."""
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


def run_cached(mixer, cache, x, chunks, slots=None):
    """Feed x [B, T, d] in chunks (the first a prefill), returning the outputs for every position."""
    outs, start = [], 0
    for n in chunks:
        positions = torch.arange(start, start + n).expand(x.shape[0], n)
        outs.append(mixer(x[:, start : start + n], positions, cache, slot_batch(positions, start == 0, slots)))
        start += n
    return torch.cat(outs, dim=1)
