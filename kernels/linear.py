"""nn.Linear with faster CPU forms for decode-sized batches, chosen by measurement.

Which path a CPU batch of `rows` rows takes (no gradient to record), measured over the `base` gqa model's 85 linear
layers with 2 threads, in GB/s of weights streamed, the C GEMV and torch's F.linear called bare and side by side in
one run, on two machines: a 2-core Xeon with AVX-512 and AVX512-BF16, and a 2-core AMD EPYC with the same ISA (32 MiB
L3, memory read at 30-33 GB/s), where torch's fp32 F.linear reads at a third of the rate the C GEMV does:

| dtype | rows | path |
|---|---|---|
| fp32 | 1..16 | archzoo's C GEMV |
| fp32 | 17..64 | W @ x^T (1.3-2x faster than x @ W^T on an AVX2 machine: 85 GEMMs at 16 rows, 58 vs 84 ms) |
| bf16 | 1..8 | archzoo's C GEMV |
| bf16 | 9.. | torch's F.linear |

C GEMV / F.linear, Xeon: fp32 27.1 / 28.6 at 1 row, 26.5 / 27.1 at 2, 24.8 / 15.7 at 4, 20.9 / 11.5 at 8; bf16
26.4 / 14.6 at 1, 20.9 / 13.7 at 4, 15.0 / 13.4 at 8, 7.5 / 11.9 at 16 (an older kernel). EPYC: fp32 23.3-27.2 /
10.4 at 1, 28.4 / 6.0 at 2, 20.5-22.0 / 6.0 at 4, 8.0 / 4.1 at 16; bf16 20.6-23.8 / 7.6-9.0 at 1, 16.3-17.3 / 7.5 at
8, 10.2 / 6.3 at 16.

At 1-2 fp32 rows the Xeon's F.linear led by 2-6%, within that machine's run-to-run drift, while the EPYC's trailed by
2.6-4.7x: the C GEMV serves both. bf16 above 8 rows stays with F.linear until the Xeon is measured again.

(bf16 W @ x^T streamed 17.6-18.8 GB/s at 2-16 rows, but rounds its sums too early: it missed F.linear on the same
inputs by up to 1.7% where the others stay within one bf16 rounding.)

The C GEMV (kernels/cpu/dense_gemv.c through cpu_decode.dense_gemv, a custom op that torch.compile keeps in the graph,
whose CPU kernel is C++ glue where that builds: kernels/cpu/ops.cpp)
streams each weight byte once for every row; W @ x^T lets the BLAS read the weight as row-major A in one pass. A
prefill's many rows, fp16, and a batch whose gradient is recorded take nn.Linear's own path. Same parameters and
state_dict as nn.Linear, so weights load unchanged.
"""
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_decode
from .dispatch import use_cpu_kernel

MAX_ROWS = 64  # W @ x^T up to here
GEMV_ROWS = {torch.float32: range(1, 17), torch.bfloat16: range(1, 9)}  # where the C GEMV measured fastest


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def dense_gemv_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The C GEMV: fp32 or bf16 on the CPU at the row counts it measured fastest for, a contiguous weight, and no
    gradient to record (the op has no backward)."""
    if rows_of(x) not in GEMV_ROWS.get(x.dtype, ()):  # the cheapest test first: it is paid on every call
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return False
    return cpu_decode.dense_gemv_fits(x, weight, bias) and use_cpu_kernel(x, weight, bias)


def transposed_path(x: torch.Tensor, rows: int) -> bool:
    """W @ x^T: fp32 batches of 17..MAX_ROWS rows on the CPU (above the C GEMV's)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and GEMV_ROWS[torch.float32].stop <= rows <= MAX_ROWS


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias  # a module's parameter lookup costs ~1 µs each time
        if dense_gemv_path(x, weight, bias):
            return cpu_decode.op_or_function(cpu_decode.dense_gemv, cpu_decode.dense_gemv_eager)(x, weight, bias)
        rows = rows_of(x)
        if not transposed_path(x, rows):
            return F.linear(x, weight, bias)
        y = torch.mm(weight, x.reshape(rows, -1).t()).t()
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)
