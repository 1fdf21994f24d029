"""Weight-only quantized matrix multiplies, y = x W^T with W stored in 8 or 4 bits, each fast path beside the plain
dequantize-then-multiply reference it must equal.

int8, per output channel (symmetric): W[n, k] ~ scale[n] * q[n, k], q in [-127, 127].
int4, per group of `group_size` input columns (asymmetric min/max): W[n, k] ~ (q[n, k] - 8) * scale[n, g] + zero[n, g],
q in [0, 15], g = k // group_size. That is tinygemm's convention (torch's `_weight_int4pack_mm`): zero = min + 8 *
scale, so a group's minimum is q = 0 and its maximum q = 15.

Storage: q8 [N, K] int8; q4 two columns a byte, [N, K / 2] uint8 (column 2j in the low nibble, 2j + 1 in the high).
On the CPU the fast paths are torch's packed weight-only kernels (`_weight_int8pack_mm`, and `_weight_int4pack_mm_for
_cpu` on a layout `int4_cpu_layout` prepares once); elsewhere the references run.
"""
import torch
import torch.nn.functional as F

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


def cpu_fast_path(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def int8_matmul(x: torch.Tensor, q8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if not cpu_fast_path(x):
        return int8_matmul_ref(x, q8, scales)
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), q8, scales.to(x.dtype))
    return y.reshape(*x.shape[:-1], q8.shape[0])


def int4_matmul(x: torch.Tensor, q4: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                cpu_layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """cpu_layout: int4_cpu_layout(q4, scales, zeros), prepared once (the CPU fast path needs it)."""
    if cpu_layout is None or not cpu_fast_path(x):
        return int4_matmul_ref(x, q4, scales, zeros, group_size)
    packed, scales_zeros = cpu_layout
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).contiguous(), packed, group_size,
                                         scales_zeros.to(x.dtype))
    return y.reshape(*x.shape[:-1], q4.shape[0])
