"""Attention mixers: softmax attention (MHA/GQA/MQA, sliding window, cross-layer), MLA, linear attention."""
from attention.attention import Attention
from attention.linear_attention import LinearAttention
from attention.mla import MLAttention

__all__ = ["Attention", "LinearAttention", "MLAttention"]
