"""The cache contract: what a layer declares it stores and keeps, the views of engine memory a mixer reads and
writes, and one step's batch layout. The ground floor under the mixers (attention/, ssm/) and the engine."""
from cache.layouts import HandoffKV, ContiguousKV, PagedKV
from cache.retention import FULL, Retention
from cache.scored_kv import ScoredKV
from cache.quantized_rows import QuantizedRows
from cache.spec import KV_FORMATS, CacheBatch, CacheSpec, TreeBatch, specs_read
from cache.state_slots import StateSlots

__all__ = ["FULL", "KV_FORMATS", "CacheBatch", "CacheSpec", "HandoffKV", "ContiguousKV", "QuantizedRows", "PagedKV",
           "Retention", "ScoredKV", "StateSlots", "TreeBatch", "specs_read"]
