"""Rotary position embedding, rotate-half layout (HF Llama's convention)."""
import torch
from torch import nn

from kernels import cpu_fused


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions, computed per call (cheap, fuses under compile, no table sized to a context)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Derived, not learned: kept out of the state dict.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @staticmethod
    def buffer_bytes(head_dim: int) -> int:
        """Bytes of inv_freq (fp32, one frequency per pair of channels) for a head of head_dim channels."""
        return len(range(0, head_dim, 2)) * 4

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T], shaped [B, 1, T, head_dim] to broadcast over heads."""
        # fp32 position x frequency products, as HF computes them, so logits match to the last bit
        angles = positions.unsqueeze(-1).float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each x [B, heads, T, head_dim] rotated at positions [B, T]: one fused call per x in an eager CPU decode
        step (kernels/cpu_fused.py), else cos and sin once for all of them."""
        b, t = positions.shape
        if all(cpu_fused.fused_path(x, b * t) for x in xs):
            return tuple(cpu_fused.rotary(x, positions, self.inv_freq) for x in xs)
        cos, sin = self(positions, xs[0].dtype)
        return tuple(apply_rope(x, cos, sin) for x in xs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
