"""Decode-attention, linear-attention and Mamba state kernels: each Triton (CUDA) or compiled C (CPU) kernel beside
the PyTorch reference it must equal."""

from .contiguous_attention import contiguous_decode_attention, contiguous_decode_attention_ref
from . import cpu_blocks, cpu_fused  # their ops' schemas, before kernels/cpu/ops.cpp registers their CPU kernels
from .cpu_decode import cpu_kernels_available, greedy_rows
from .linear import Linear
from .dispatch import FORCE_TRITON_ENV, triton_available, use_cpu_kernel, use_triton
from .linear_attention import (
    linear_attention_chunked,
    linear_attention_chunked_ref,
    linear_attention_chunked_triton,
    linear_attention_parallel_ref,
    linear_attention_step,
    linear_attention_step_ref,
    linear_attention_step_triton,
)
from .mla_attention import mla_decode_attention, mla_decode_attention_ref, mla_decode_attention_triton
from .paged_attention import paged_decode_attention, paged_decode_attention_ref, paged_decode_attention_triton
from .paged_write import write_paged_kv, write_paged_kv_ref, write_paged_kv_triton
from .selective_state_update import (
    selective_state_update,
    selective_state_update_ref,
    selective_state_update_triton,
)

__all__ = [
    "FORCE_TRITON_ENV",
    "Linear",
    "contiguous_decode_attention",
    "contiguous_decode_attention_ref",
    "cpu_kernels_available",
    "greedy_rows",
    "linear_attention_chunked",
    "linear_attention_chunked_ref",
    "linear_attention_chunked_triton",
    "linear_attention_parallel_ref",
    "linear_attention_step",
    "linear_attention_step_ref",
    "linear_attention_step_triton",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "selective_state_update",
    "selective_state_update_ref",
    "selective_state_update_triton",
    "triton_available",
    "use_cpu_kernel",
    "use_triton",
    "write_paged_kv",
    "write_paged_kv_ref",
    "write_paged_kv_triton",
]
