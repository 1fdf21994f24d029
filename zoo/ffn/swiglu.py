"""SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): down(SiLU(gate x) * up x), Llama's FFN."""
import torch
import torch.nn.functional as F
from torch import nn

from attention.norm import RMSNorm
from kernels import Linear, cpu_blocks, cpu_fused


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # the order the fused half takes them


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(d_model, hidden, bias=False)
        self.up_proj = Linear(d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, d_model, bias=False)

    @staticmethod
    def module_bytes(dtype: torch.dtype, d_model: int, hidden: int) -> int:
        return 3 * d_model * hidden * dtype.itemsize

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        weights = cpu_blocks.half_weights(self, None, PROJECTIONS)  # plain layers only (not quantized, not hooked)
        if weights is not None and cpu_fused.swiglu_fits(x, *weights):  # an eager CPU decode step: one call, not five
            return cpu_fused.swiglu_gemv(x, *weights)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def decode_residual(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """x + self(norm(x)) in one call (kernels/cpu_blocks.py) where decode_half decides one; None elsewhere, where
        the block runs the two modules."""
        half = self.decode_half(norm, x)
        return None if half is None else cpu_blocks.run_half(half, x, None, None)

    def decode_half(self, norm: nn.Module, x: torch.Tensor) -> "cpu_blocks.Half | None":
        """This feed-forward's half where norm is an RMSNorm and this call would take the fused SwiGLU (an eager CPU
        decode step), its projections float or int8; None elsewhere."""
        if type(norm) is not RMSNorm or type(self) is not SwiGLU or "forward" in vars(self):
            return None
        operands = cpu_blocks.half_operands(self, norm, PROJECTIONS, int8=True)  # float or int8 projections
        if operands is None:
            return None
        (weights, scales), norm_weight = operands, norm._parameters["weight"]
        if not cpu_blocks.gemv_half_fits(x, weights, norm_weight, scales=scales) \
                or weights[0].shape != weights[1].shape or weights[2].shape[1] != weights[0].shape[0]:
            return None
        return cpu_blocks.Half("ffn", (norm_weight, *weights, *scales), floats=(norm.eps,))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64: down(g / (1 + e^-g) * u) with g = x W_gate^T, u = x W_up^T."""
        x = x.double()
        gate, up = x @ self.gate_proj.weight.double().T, x @ self.up_proj.weight.double().T
        return (gate / (1 + torch.exp(-gate)) * up) @ self.down_proj.weight.double().T
