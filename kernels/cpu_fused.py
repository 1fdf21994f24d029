"""The eager CPU decode step's small per-layer ops, one call each: RMSNorm, rotary position embedding and the SwiGLU
feed-forward (its three GEMVs, SiLU and product).

An eager decode step on a 2-core CPU spends as long in small torch ops and the Python between them as in its GEMVs: a
`small` gqa step measured 9.1 ms, of which the GEMVs and attention kernels took ~5. RMSNorm is 7 torch ops (~25-33
µs a call), rotary 12 for q and k (~70 µs a layer), and SwiGLU's glue ~80 µs a layer beyond its GEMVs. Here each is
one custom op whose CPU kernel is C++ (kernels/cpu/ops.cpp) over plain C loops (kernels/cpu/norm_rope.c) or the
dense GEMV, a few µs a call; where the C++ glue does not build, the Python glue below serves.

They serve decode-sized inputs (up to MAX_ROWS token rows), fp32 or bf16 with parameters in the same dtype, when no
gradient is recorded and no graph is being compiled: inductor fuses torch's own ops in a compiled step, and a prefill's
many rows keep torch's threaded kernels. Each keeps torch's rounding steps (the results differ from the torch ops only
in the sum order of a norm's mean and the last bit of a cosine; SwiGLU is bit-identical, being the same kernels).
"""
import torch
import torch.nn.functional as F

from . import cpu_decode
from .dispatch import triton_forced
from .linear import GEMV_ROWS, rows_of

MAX_ROWS = 16  # a decode step's token rows (kernels/linear.py's C GEMV range)


def fused_path(x: torch.Tensor, rows: int, *params: torch.Tensor) -> bool:
    """Whether the fused ops serve x (with `rows` token rows) and params: see the module doc. One loop over the
    tensors, as it runs for every half of every layer of an eager step (the generic checks cost ~5 µs a call)."""
    dtype = x.dtype
    if torch.compiler.is_compiling() or not 1 <= rows <= MAX_ROWS or dtype not in cpu_decode.DENSE_DTYPES \
            or not x.is_cpu:
        return False
    for p in params:
        if p.dtype != dtype or not p.is_cpu:
            return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False
    return cpu_decode.cpu_kernels_available() and not triton_forced()


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., D] times weight [D] (attention/norm.py's), on kernels/cpu/norm_rope.c."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    if weight.dtype != x.dtype or weight.numel() != x.shape[-1]:
        raise ValueError(f"rms_norm: weight {weight.dtype} of {weight.numel()} must match x's dtype {x.dtype} and "
                         f"width {x.shape[-1]}")
    out = torch.empty(rows.shape, dtype=x.dtype)
    status = cpu_decode._library().rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                                            cpu_decode.DTYPE_CODES[x.dtype], weight.data_ptr(), eps, out.data_ptr())
    if status:
        raise ValueError(f"rms_norm: dtype {x.dtype} is beyond the CPU kernel (fp32, bf16)")
    return out.view(x.shape)


rms_norm_op = torch.library.custom_op("archzoo::rms_norm", mutates_args=())(rms_norm_eager)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def rotary_eager(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated at positions [B, T] (attention/rope.py's apply_rope with RotaryEmbedding's cos and sin),
    on kernels/cpu/norm_rope.c; a contiguous result."""
    if (x.dim() != 4 or positions.shape != (x.shape[0], x.shape[2]) or inv_freq.numel() * 2 != x.shape[3]):
        raise ValueError(f"rotary: x {tuple(x.shape)} must be [B, H, T, D] with positions [B, T] and D / 2 "
                         f"frequencies, got positions {tuple(positions.shape)} and {inv_freq.numel()} frequencies")
    if x.stride(3) != 1:
        x = x.contiguous()
    positions, inv_freq = positions.long(), inv_freq.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    status = cpu_decode._library().rotary(x.data_ptr(), *x.shape, *x.stride()[:3], positions.data_ptr(),
                                          *positions.stride(), inv_freq.data_ptr(), cpu_decode.DTYPE_CODES[x.dtype],
                                          out.data_ptr())
    if status:
        raise ValueError(f"rotary: dtype {x.dtype} (fp32, bf16) or head_dim {x.shape[3]} (even, <= 1024) is beyond "
                         "the CPU kernel")
    return out


rotary_op = torch.library.custom_op("archzoo::rotary", mutates_args=())(rotary_eager)


@rotary_op.register_fake
def _(x, positions, inv_freq):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def swiglu_gemv_eager(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) on the dense GEMV (zoo/ffn/swiglu.py's SwiGLU, bias-free)."""
    hidden = F.silu(cpu_decode.dense_gemv_eager(x, gate, None)) * cpu_decode.dense_gemv_eager(x, up, None)
    return cpu_decode.dense_gemv_eager(hidden, down, None)


swiglu_gemv_op = torch.library.custom_op("archzoo::swiglu_gemv", mutates_args=())(swiglu_gemv_eager)


@swiglu_gemv_op.register_fake
def _(x, gate, up, down):
    return x.new_empty(*x.shape[:-1], down.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_decode.op_or_function(rms_norm_op, rms_norm_eager)(x, weight, eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    return cpu_decode.op_or_function(rotary_op, rotary_eager)(x, positions, inv_freq)


def swiglu_gemv(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return cpu_decode.op_or_function(swiglu_gemv_op, swiglu_gemv_eager)(x, gate, up, down)


def swiglu_fits(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether swiglu_gemv takes these: each weight on the dense GEMV (kernels/linear.py's rule for x's rows)."""
    rows = rows_of(x)
    return (rows in GEMV_ROWS.get(x.dtype, ()) and fused_path(x, rows, gate, up, down)
            and all(cpu_decode.dense_gemv_fits(x, w, None) for w in (gate, up, down))
            and gate.shape == up.shape and down.shape[1] == gate.shape[0])
