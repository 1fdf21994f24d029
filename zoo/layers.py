"""The norms of a block (the feed-forward kinds are in zoo/ffn/)."""
import torch
from torch import nn

from attention.norm import RMSNorm


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else nn.LayerNorm(dim, eps=eps)


def norm_bytes(kind: str, dim: int, dtype: torch.dtype) -> int:
    """Bytes of make_norm's parameters: a gain, and for LayerNorm a bias too."""
    return (1 if kind == "rmsnorm" else 2) * dim * dtype.itemsize
