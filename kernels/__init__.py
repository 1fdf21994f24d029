"""Paged-KV kernels: each Triton kernel sits beside the PyTorch reference it must equal."""

from .dispatch import FORCE_TRITON_ENV, triton_available, use_triton
from .mla_attention import mla_decode_attention, mla_decode_attention_ref, mla_decode_attention_triton
from .paged_attention import paged_decode_attention, paged_decode_attention_ref, paged_decode_attention_triton
from .paged_write import write_paged_kv, write_paged_kv_ref, write_paged_kv_triton

__all__ = [
    "FORCE_TRITON_ENV",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "triton_available",
    "use_triton",
    "write_paged_kv",
    "write_paged_kv_ref",
    "write_paged_kv_triton",
]
