"""Decode attention over a contiguous KV cache: one new query token per sequence.

Layout: q [B, H, Dk]; k [slots, KVH, rows, Dk], v [slots, KVH, rows, Dv] or None (an MLA latent cache: the value
is the first value_dim columns of each key row); slots [B] (the cache row of each sequence); seq_lens [B] (keys
each sequence sees: rows 0 .. seq_lens-1 of its slot). Query head h reads KV head h // (H // KVH). A ring
buffer (a cache that keeps a bounded set of positions) is passed with seq_lens = its live rows, which are its first
rows: softmax does not care in which row a key sits.
A strided span (a dilated window) passes starts [B] and stride r instead: seq_lens are then the sequences' lengths,
the query at seq_lens - 1 sees positions starts, starts + r, ..., seq_lens - 1, and position p lives in row
p % rows (a ring when rows < seq_lens; row p itself otherwise).
Output [B, H, value_dim] in q's dtype.

The reference is the oracle; the CPU path is the compiled kernel (kernels/cpu_decode.py), which reads only each
sequence's live rows, in place; elsewhere (CUDA) SDPA over the rows up to `rows_read` with a length mask.
"""
import torch
import torch.nn.functional as F

from . import cpu_decode
from .dispatch import use_cpu_kernel
from .row_scales import spread_scales


def visible_rows(seq_lens, length: int, rows: int, starts=None, stride: int = 1) -> torch.Tensor:
    """[B, length] bool: which of the first `length` rows each sequence's query sees (its first seq_lens rows; with
    starts, the rows holding positions starts, starts + stride, ..., seq_lens - 1, position p in row p % rows)."""
    row = torch.arange(length, device=seq_lens.device)
    if starts is None:
        return row < seq_lens[:, None]
    newest = seq_lens.long()[:, None] - 1
    back = (newest - row) % rows  # how far behind the newest query the position in each row is
    return (back <= newest - starts.long()[:, None]) & (back % stride == 0)


def contiguous_decode_attention_ref(q, k, v, slots, seq_lens, scale: float, value_dim: int, starts=None,
                                    stride: int = 1) -> torch.Tensor:
    batch, heads, _ = q.shape
    kv_heads = k.shape[1]
    length = min(k.shape[2], int(seq_lens.max()))
    keys = k[slots, :, :length].float()  # [B, KVH, L, Dk]
    values = keys[..., :value_dim] if v is None else v[slots, :, :length].float()
    valid = visible_rows(seq_lens, length, k.shape[2], starts, stride)  # [B, L]
    queries = q.float().view(batch, kv_heads, heads // kv_heads, -1)
    scores = torch.einsum("bkgd,bkld->bkgl", queries, keys) * scale
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    # zero the masked values: rows past a sequence's length may hold anything (a finished request's keys, NaN)
    out = torch.einsum("bkgl,bkld->bkgd", probs, values.masked_fill(~valid[:, None, :, None], 0.0))
    return out.reshape(batch, heads, value_dim).to(q.dtype)


def contiguous_decode_attention(q, k, v, slots, seq_lens, scale: float, value_dim: int,
                                rows_read: int | None = None, slot_range: slice | None = None, k_scales=None,
                                v_scales=None, starts=None, stride: int = 1) -> torch.Tensor:
    """rows_read: rows the SDPA path reads (default: all; a compiled step passes a fixed number so its shapes do
    not change with the lengths). slot_range: the same rows as `slots` when they are consecutive (SDPA reads a view).
    k_scales, v_scales: a one-byte (int8 / fp8) cache's row scales [slots, kv_heads, rows, 1] (None: a float cache;
    v_scales None with v None: a latent cache, whose values are its keys; its k_scales may be [..., 2], for the
    value_dim latent columns and the rest, cache/quantized_rows.py). starts, stride: a strided span (module doc)."""
    if use_cpu_kernel(q, k) and cpu_decode.fits(q, k, k.shape[1], value_dim, k_scales):
        return cpu_decode.contiguous_decode_attention_cpu(q, k, v, slots, seq_lens, scale, value_dim, k_scales,
                                                          v_scales, starts, stride)
    rows = slots if slot_range is None else slot_range
    length = k.shape[2] if rows_read is None else rows_read
    keys = k[rows, :, :length]
    values = keys if v is None else v[rows, :, :length]
    if k_scales is not None:  # one-byte rows, read back in the query's dtype
        keys = keys.to(q.dtype) * spread_scales(k_scales[rows, :, :length], value_dim, keys.shape[-1])
        values = keys if v is None else values.to(q.dtype) * v_scales[rows, :, :length]
    visible = visible_rows(seq_lens, length, k.shape[2], starts, stride)[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible, scale=scale,
                                         enable_gqa=keys.shape[1] != q.shape[1])
    return out[:, :, 0, :value_dim]
