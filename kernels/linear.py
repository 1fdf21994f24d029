"""nn.Linear with a faster CPU form for decode-sized batches: y^T = W x^T.

For 2..64 rows of fp32 on the CPU, torch's BLAS runs W @ x^T 1.3-2x faster than x @ W^T (measured on the
project's 2-core AVX2 machine: 85 base-size GEMMs at 16 rows, 58 ms vs 84 ms; equal at 1 row). It reads the weight
as row-major A in one pass. bf16/fp16 gain nothing there (their CPU GEMMs are conversion-bound), and a prefill's
many rows are faster as they are. Same parameters and state_dict as nn.Linear, so weights load unchanged.
"""
import torch
from torch import nn

MAX_ROWS = 64


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or x.dtype != torch.float32 or not 1 < rows <= MAX_ROWS:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
