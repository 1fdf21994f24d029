"""nn.Linear with faster CPU forms for decode-sized batches.

Up to DENSE_GEMV_MAX_ROWS rows of fp32 or bf16 on the CPU, with no gradient to record, run archzoo's C GEMV
(kernels/cpu/dense_gemv.c through cpu_decode.dense_gemv, a custom op that torch.compile keeps in the graph): it streams
each weight byte once from memory for every row, where torch's GEMMs are built for larger products.
Other fp32 batches of 2..64 rows take y^T = W x^T: torch's BLAS runs W @ x^T 1.3-2x faster than x @ W^T there
(measured on the project's 2-core AVX2 machine: 85 base-size GEMMs at 16 rows, 58 ms vs 84 ms; equal at 1 row), as it
reads the weight as row-major A in one pass. A prefill's many rows are faster as they are.
Same parameters and state_dict as nn.Linear, so weights load unchanged.
"""
import torch
from torch import nn

from . import cpu_decode
from .dispatch import use_cpu_kernel

MAX_ROWS = 64
DENSE_GEMV_MAX_ROWS = 16  # decode batches; to be tuned against the W x^T path by benchmark


def dense_gemv_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The C GEMV: fp32 or bf16 on the CPU, decode-sized, a contiguous weight, and no gradient to record (the op has
    no backward)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    params = (weight,) if bias is None else (weight, bias)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))
    return (1 <= rows <= DENSE_GEMV_MAX_ROWS and not recording and cpu_decode.dense_gemv_fits(x, weight, bias)
            and use_cpu_kernel(x, *params))


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dense_gemv_path(x, self.weight, self.bias):
            return cpu_decode.dense_gemv(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or x.dtype != torch.float32 or not 1 < rows <= MAX_ROWS:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
