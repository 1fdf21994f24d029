"""Attention mixers and the KV-cache layouts they read and write."""
from attention.attention import Attention
from attention.cache_spec import CacheBatch, CacheSpec, specs_read
from attention.kv_layouts import CallKV, ContiguousKV, PagedKV
from attention.linear_attention import LinearAttention
from attention.mla import MLAttention
from attention.state_slots import StateSlots

__all__ = ["Attention", "CacheBatch", "CacheSpec", "CallKV", "ContiguousKV", "LinearAttention", "MLAttention", "PagedKV", "StateSlots", "specs_read"]
