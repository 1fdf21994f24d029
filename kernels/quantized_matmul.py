"""Weight-only quantized matrix multiplies, y = x W^T with W stored in 8 or 4 bits, each fast path beside the plain
dequantize-then-multiply reference it must equal.

int8, per output channel (symmetric): W[n, k] ~ scale[n] * q[n, k], q in [-127, 127].
int4, per group of `group_size` input columns (asymmetric min/max): W[n, k] ~ (q[n, k] - 8) * scale[n, g] + zero[n, g],
q in [0, 15], g = k // group_size. That is tinygemm's convention (torch's `_weight_int4pack_mm`): zero = min + 8 *
scale, so a group's minimum is q = 0 and its maximum q = 15.

Storage: q8 [N, K] int8; q4 two columns a byte, [N, K / 2] uint8 (column 2j in the low nibble, 2j + 1 in the high).
On the CPU, decode-sized inputs (up to GEMV_MAX_ROWS rows) run archzoo's C GEMVs: int8 in any float dtype on the
dense GEMV's tiles (kernels/cpu/dense_gemv.c's int8_gemv; it streamed the `base` gqa model's int8 weights at 1.5-1.9x
the rate of torch's `_weight_int8pack_mm` with bf16 activations, 1-16 rows, 2-core Xeon), int4 in fp32 and fp16
(kernels/cpu/quantized_gemv.c). bf16 int4 takes torch's `_weight_int4pack_mm_for_cpu` on a layout `int4_cpu_layout`
prepares once, and larger bf16 int8 inputs `_weight_int8pack_mm`: torch's packed kernels are fast for bf16 only.
Other inputs dequantize-then-multiply, where the multiply is compute-bound. On CUDA, decode-sized inputs (up to
GEMV_MAX_ROWS rows) run a Triton kernel that dequantizes each weight tile in registers as it streams it (a weight is
read once, in its stored bits); larger inputs, where the multiply is compute-bound, dequantize the weight and run the
dense matmul.
"""
from __future__ import annotations  # keeps the `tl.constexpr` annotations inert until triton is imported

import functools

import torch
import torch.nn.functional as F

from . import cpu_decode
from .dispatch import jit_kernels, use_cpu_kernel, use_triton
from .tiles import cdiv, padded

tl = None  # triton.language, bound by dispatch.jit_kernels on the first Triton call
GEMV_MAX_ROWS = 16  # one tl.dot tile of rows: decode batches

INT4_INNER_K_TILES = 2  # the CPU int4 layout's tiling of K (torch accepts 2, 4 or 8; 2 allows K a multiple of 32)


def unpack_int4(q4: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 -> [N, K] int32 in [0, 15]."""
    return torch.stack([q4 & 0xF, q4 >> 4], dim=-1).flatten(-2).to(torch.int32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in [0, 15] (K even) -> [N, K / 2] uint8."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def int8_matmul_ref(x: torch.Tensor, q8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, q8.to(x.dtype) * scales.to(x.dtype)[:, None])


def int4_dequantize(q4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] an int4 layer stands for: (q - 8) * scale + zero per group; scales, zeros [N, K / group]."""
    q = unpack_int4(q4).to(dtype).unflatten(-1, (-1, group_size))
    return ((q - 8) * scales.to(dtype)[..., None] + zeros.to(dtype)[..., None]).flatten(-2)


def int4_matmul_ref(x: torch.Tensor, q4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    return F.linear(x, int4_dequantize(q4, scales, zeros, group_size, x.dtype))


def int4_cpu_layout(q4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's packed weight and its [K / group, N, 2] scales-and-zeros, made once per layer."""
    packed = torch._convert_weight_to_int4pack_for_cpu(unpack_int4(q4), INT4_INNER_K_TILES)
    return packed, torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()


def int4_cpu_layout_used(q4: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether int4_matmul reads an int4_cpu_layout of this weight: only for bf16 activations on the CPU
    (cpu_packed_path), which a layer gets whose scales are bf16 there (they are in the model's dtype), and only where
    torch's kernel takes its output width (a multiple of 16)."""
    return q4.device.type == "cpu" and scales.dtype == torch.bfloat16 and q4.shape[0] % 16 == 0


def cpu_packed_path(x: torch.Tensor) -> bool:
    """torch's packed kernels: bf16 activations on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def cpu_gemv_path(x: torch.Tensor, group_size: int) -> bool:
    """archzoo's C GEMV on the CPU, decode-sized: int8 in every float dtype, int4 in those but bf16."""
    return ((group_size == 0 or x.dtype != torch.bfloat16) and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS
            and use_cpu_kernel(x) and cpu_decode.quantized_gemv_fits(x, group_size))


def cpu_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int) -> torch.Tensor:
    """The C GEMV: its op (C++ glue beneath, or a compiled graph's), else the plain function."""
    gemv = cpu_decode.op_or_function(cpu_decode.quantized_gemv, cpu_decode.quantized_gemv_eager)
    return gemv(x, weight, scales, zeros, group_size)


def _gemv_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, out_ptr, rows, n, k,
    stride_x_row, stride_w_n, stride_s_n, stride_s_group, stride_out_row,
    INT4: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[rows, n] = x[rows, k] @ W^T for BLOCK_N output channels: each [BLOCK_N, BLOCK_K] weight tile loaded in its
    stored bits and dequantized in registers. int8: W = q * scale[n], applied to the sums at the end. int4: two
    columns a byte (low nibble first), W = (q - 8) * scale[n, g] + zero[n, g] with BLOCK_K = GROUP."""
    channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    channel_ok = channels < n
    row_index = tl.arange(0, ROWS_PAD)
    row_ok = row_index < rows
    compute_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([ROWS_PAD, BLOCK_N], tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row_index[:, None] * stride_x_row + cols[None, :], mask=row_ok[:, None], other=0.0)
        if INT4:
            pairs = start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + channels[:, None] * stride_w_n + pairs[None, :], mask=channel_ok[:, None],
                             other=0)
            q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
            group = start // GROUP
            scale = tl.load(scales_ptr + channels * stride_s_n + group * stride_s_group, mask=channel_ok, other=0.0)
            zero = tl.load(zeros_ptr + channels * stride_s_n + group * stride_s_group, mask=channel_ok, other=0.0)
            w = (q - 8.0) * scale.to(tl.float32)[:, None] + zero.to(tl.float32)[:, None]
        else:
            w = tl.load(w_ptr + channels[:, None] * stride_w_n + cols[None, :], mask=channel_ok[:, None],
                        other=0).to(tl.float32)
        acc += tl.dot(x.to(compute_dtype), tl.trans(w.to(compute_dtype)), input_precision="ieee")
    if not INT4:
        acc = acc * tl.load(scales_ptr + channels * stride_s_n, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + row_index[:, None] * stride_out_row + channels[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & channel_ok[None, :])


@functools.cache
def _jitted_kernel():
    return jit_kernels(globals(), _gemv_kernel)[0]


def quantized_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                          group_size: int = 0) -> torch.Tensor:
    """x [..., K] (at most GEMV_MAX_ROWS rows) times an int8 [N, K] (zeros None) or int4 [N, K / 2] weight."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"the dequantizing GEMV takes at most {GEMV_MAX_ROWS} rows, got {rows.shape[0]}")
    n, k = weight.shape[0], rows.shape[1]
    int4 = zeros is not None
    # tiles that stay in registers (no spills in ptxas for sm_80 / sm_90): exact fp32 tl.dot needs the smaller ones
    wide = x.element_size() <= 2
    block_n = 32 if wide else 16
    block_k = group_size if int4 else (64 if wide else 32)
    if k % block_k:
        raise ValueError(f"input width {k} is not a multiple of the kernel's {block_k}-column tiles")
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    scale_strides = scales.stride() if int4 else (scales.stride(0), 0)
    _jitted_kernel()[(cdiv(n, block_n),)](
        rows, weight, scales, zeros if int4 else scales, out, rows.shape[0], n, k,
        rows.stride(0), weight.stride(0), *scale_strides, out.stride(0),
        INT4=int4, GROUP=max(group_size, 1), BLOCK_K=block_k, ROWS_PAD=padded(rows.shape[0]), BLOCK_N=block_n,
        num_warps=8 if int4 else 4,
    )
    return out.reshape(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, q8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if use_triton(x, q8, scales) and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS:
        return quantized_gemv_triton(x, q8, scales, None)
    if cpu_gemv_path(x, 0):
        return cpu_gemv(x, q8, scales, None, 0)
    if not cpu_packed_path(x):
        return int8_matmul_ref(x, q8, scales)
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), q8, scales.to(x.dtype))
    return y.reshape(*x.shape[:-1], q8.shape[0])


def int4_matmul(x: torch.Tensor, q4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                cpu_layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """cpu_layout: int4_cpu_layout(q4, scales, zeros), prepared once (the CPU fast path needs it)."""
    if use_triton(x, q4, scales, zeros) and x.numel() // x.shape[-1] <= GEMV_MAX_ROWS:
        return quantized_gemv_triton(x, q4, scales, zeros, group_size)
    if cpu_gemv_path(x, group_size):
        return cpu_gemv(x, q4, scales, zeros, group_size)
    if cpu_layout is None or not cpu_packed_path(x):
        return int4_matmul_ref(x, q4, scales, zeros, group_size)
    packed, scales_zeros = cpu_layout
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).contiguous(), packed, group_size,
                                         scales_zeros.to(x.dtype))
    return y.reshape(*x.shape[:-1], q4.shape[0])
