"""The GELU MLP (GPT-2's): down(GELU(up x)), the exact GELU (Hendrycks & Gimpel 2016)."""
import torch
import torch.nn.functional as F
from torch import nn

from kernels import Linear


class GeluMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, hidden: int) -> int:
        return 2 * d_model * hidden * dtype.itemsize

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64: down(h Phi(h)) with h = x W_up^T and Phi the normal CDF (not the tanh approximation)."""
        h = x.double() @ self.up_proj.weight.double().T
        return (0.5 * h * (1 + torch.erf(h / 2**0.5))) @ self.down_proj.weight.double().T
