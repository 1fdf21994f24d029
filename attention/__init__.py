"""Attention mixers and the KV-cache layouts they read and write."""
from attention.attention import Attention
from attention.cache_spec import CacheBatch, CacheSpec
from attention.kv_layouts import ContiguousKV, PagedKV

__all__ = ["Attention", "CacheBatch", "CacheSpec", "ContiguousKV", "PagedKV"]
