"""The non-mixer parts of a block: norms and MLPs."""
import torch
import torch.nn.functional as F
from torch import nn

from attention.norm import RMSNorm
from kernels import Linear


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else nn.LayerNorm(dim, eps=eps)


def norm_bytes(kind: str, dim: int, dtype: torch.dtype) -> int:
    """Bytes of make_norm's parameters: a gain, and for LayerNorm a bias too."""
    return (1 if kind == "rmsnorm" else 2) * dim * dtype.itemsize


def mlp_bytes(kind: str, d_model: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of make_mlp's parameters: SwiGLU's three projections, GELU's two, none's nothing."""
    projections = {"swiglu": 3, "gelu": 2, "none": 0}[kind]
    return projections * d_model * hidden * dtype.itemsize


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=False)
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


def make_mlp(kind: str, d_model: int, hidden: int) -> nn.Module | None:
    if kind == "none":
        return None
    return SwiGLU(d_model, hidden) if kind == "swiglu" else GeluMLP(d_model, hidden)
