"""The engine's cache memory: one layout per layer, allocated from the layers' cache declarations.

Paged layers are grouped by retention policy: a group's layers share block ids (one block table per sequence per
group), so a sliding-window group can return blocks while a global group in the same model keeps them.
"""
from dataclasses import dataclass

import torch

from cache import CacheSpec, ContiguousKV, PagedKV, Retention, StateSlots, specs_read
from cache.scored_kv import PagedScoredKV, ScoredKV

LAYOUTS = ("contiguous", "paged")
# Most tokens a paged block holds: vLLM's largest block (its choices run from 1 to 256). A larger block only wastes
# more of every sequence's last block and coarsens prefix sharing (block_size=2**20 is 512 MiB a block of tiny gqa).
MAX_BLOCK_SIZE = 256


@dataclass
class CacheGroup:
    retention: Retention
    layers: list[int]  # memory-owning layers whose blocks live and die together

    def token_bytes(self, specs: list[CacheSpec], dtype: torch.dtype, kv_format: str = "auto") -> int:
        """Cache bytes one token costs across the group's layers."""
        return sum(specs[i].token_bytes(dtype, kv_format) for i in self.layers)


def cache_groups(specs: list[CacheSpec]) -> list[CacheGroup]:
    """Layers with a per-token cache, grouped by retention policy, in order of first appearance (state layers have
    no blocks)."""
    groups: dict[Retention, CacheGroup] = {}
    for i, spec in enumerate(specs):
        if spec.elements_per_token > 0:
            groups.setdefault(spec.retention, CacheGroup(spec.retention, [])).layers.append(i)
    return list(groups.values())


class CachePool:
    def __init__(self, specs: list[CacheSpec], layout: str, max_batch: int, max_seq_len: int,
                 block_size: int, num_blocks: list[int], dtype: torch.dtype, device, kv_format: str = "auto",
                 spares: bool = False):
        """num_blocks: pool size of each cache group (paged layout). kv_format: how per-token caches store rows
        (cache.KV_FORMATS). spares: one more slot row (index max_batch) and one more block per paged group (index
        num_blocks[g]) that no sequence owns, where the padding rows of a graph-captured decode step write
        (harness/engine/decode_graphs.py); not counted in nbytes."""
        self.specs, self.layout, self.block_size = specs, layout, block_size
        self.dtype, self.kv_format = dtype, kv_format
        self.max_batch, self.num_blocks = max_batch, list(num_blocks)
        self.spare_slot = max_batch if spares else None
        self.spare_blocks = list(num_blocks) if spares else None  # per group: the index of its spare block
        extra = int(spares)
        self.groups = cache_groups(specs)
        self.layers = [None] * len(specs)
        for g, group in enumerate(self.groups):
            for i in group.layers:
                scored = specs[i].retention.scored
                self.layers[i] = ((ScoredKV if scored else ContiguousKV)(specs[i], max_batch + extra, max_seq_len,
                                                                          dtype, device, kv_format)
                                  if layout == "contiguous"
                                  else (PagedScoredKV if scored else PagedKV)(specs[i], num_blocks[g] + extra,
                                                                             block_size, g, dtype, device, kv_format))
        for i, spec in enumerate(specs):
            if spec.kind == "state":  # one row per batch slot, in either layout
                self.layers[i] = StateSlots(spec, max_batch + extra, dtype, device)
            elif not spec.owns_memory:
                self.layers[i] = self.layers[spec.source]  # cross-layer sharing: the producer's cache object
        self.state_slot_bytes = sum(spec.state_bytes(dtype) for spec in specs)
        # read_bytes' terms: the token bytes of the caches read under each retention policy (most models have one or
        # two), and the fixed states' bytes
        read = specs_read(specs)
        self.read_token_bytes: dict[Retention, int] = {}
        for spec in read:
            self.read_token_bytes[spec.retention] = (self.read_token_bytes.get(spec.retention, 0)
                                                     + spec.token_bytes(dtype, kv_format))
        self.read_state_bytes = sum(spec.state_bytes(dtype) for spec in read)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the caches (the measured figure); a shared cache counts once; the spare slot
        is the decode graphs' (spare_bytes)."""
        return self.allocated_bytes - self.spare_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum({id(layer): layer.nbytes for layer in self.layers}.values())

    @property
    def spare_bytes(self) -> int:
        """Bytes of the spare slot row (contiguous rows, recurrent state) and spare blocks; 0 without them."""
        if self.spare_slot is None:
            return 0
        layers = {id(layer): layer for layer in self.layers}.values()
        return sum(layer.nbytes // (self.num_blocks[layer.group] + 1) if isinstance(layer, PagedKV)
                   else layer.nbytes // (self.max_batch + 1) for layer in layers)

    def read_bytes(self, tokens: int) -> int:
        """Analytic cache bytes a decode step reads for one sequence of `tokens` tokens; a shared cache is read by
        every layer that shares it (each layer's CacheSpec.bytes, summed by retention policy: asked for every
        sequence of every decode step, the layers' sum took ~10 Python calls a layer)."""
        held = sum(token_bytes * retention.tokens_held(tokens)
                   for retention, token_bytes in self.read_token_bytes.items())
        return held + (self.read_state_bytes if tokens > 0 else 0)

    def copy_blocks(self, group: int, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's keys and values, in every layer of the group."""
        source, destination = (torch.tensor(blocks, device=self.layers[self.groups[group].layers[0]].k.device)
                               for blocks in zip(*pairs))
        for i in self.groups[group].layers:
            layer = self.layers[i]
            layer.k[destination] = layer.k[source]
            if layer.v is not None:
                layer.v[destination] = layer.v[source]
            if isinstance(layer, PagedScoredKV):  # a scored row's position and score travel with it
                layer.positions[destination] = layer.positions[source]
                layer.scores[destination] = layer.scores[source]

    def move_rows(self, group: int, sources: tuple, destinations: tuple) -> None:
        """Every layer of the group copies its rows at index `sources` to `destinations` (cache.KVTensors.move_rows):
        a contiguous layout's (slots, :, rows), a paged one's (blocks, offsets)."""
        for i in self.groups[group].layers:
            self.layers[i].move_rows(sources, destinations)

    def rollback(self, lengths: dict[int, int]) -> None:
        """Speculative decoding kept each listed slot's first `length` tokens (slot -> length): every layer that
        remembers what the checkpointed steps since forget_steps changed (state rows, ring-buffer rows) goes back;
        paged blocks past the length are the block managers' to return."""
        for layer in self.checkpointing_layers():
            layer.rollback(lengths)

    def forget_steps(self) -> None:
        """The start of a speculative round: earlier checkpointed steps will not be rolled back to."""
        for layer in self.checkpointing_layers():
            layer.forget_steps()

    def checkpointing_layers(self) -> list:
        return list({id(layer): layer for layer in self.layers if isinstance(layer, (ContiguousKV, StateSlots))}.values())

    def copy_state(self, source: int, destination: int) -> None:
        """A forked sequence's recurrent state: every state layer's row of slot `source` into slot `destination`."""
        for layer in self.layers:
            if isinstance(layer, StateSlots):
                for tensor in layer.tensors.values():
                    tensor[destination] = tensor[source]

    def block_bytes(self, group: int) -> int:
        return self.block_size * self.groups[group].token_bytes(self.specs, self.dtype, self.kv_format)


def size_cache(specs, dtype, kv_cache: str, max_batch: int, max_seq_len: int, block_size: int,
               num_blocks: int | None, budget: int | None, step_tokens: int = 1,
               kv_format: str = "auto") -> tuple[int, list[int]]:
    """(max_batch, blocks per cache group) the cache can serve; a budget that cannot hold one full-length request
    is an error. A paged budget is split between groups in proportion to what one request needs of each.
    step_tokens: most tokens a step feeds one sequence on top of its cache (Retention.peak_blocks)."""
    if kv_cache == "contiguous":
        per_row = sum(row_bytes(spec, max_seq_len, dtype, kv_format) for spec in specs)
        if budget is not None:
            if budget < per_row:
                raise ValueError(f"cache budget {budget} B is too small for one request: one contiguous row of "
                                 f"max_seq_len={max_seq_len} needs {per_row} B")
            max_batch = min(max_batch, budget // per_row)
        return max_batch, []
    groups = cache_groups(specs)
    needs = [g.retention.peak_blocks(max_seq_len, block_size, step_tokens) for g in groups]
    if num_blocks is not None:
        return max_batch, [num_blocks] * len(groups)
    if budget is None:
        return max_batch, [max_batch * need for need in needs]
    block_bytes = [block_size * g.token_bytes(specs, dtype, kv_format) for g in groups]
    per_request = sum(need * b for need, b in zip(needs, block_bytes))
    state_bytes = sum(spec.state_bytes(dtype) for spec in specs)
    if state_bytes:
        # every batch slot holds a state row: as many slots as fit beside one request's blocks
        slots = (budget - per_request) // state_bytes
        if slots < 1:
            raise ValueError(f"cache budget {budget} B is too small for one request: its state needs {state_bytes} B "
                             f"and its {block_size}-token blocks {per_request} B")
        max_batch = min(max_batch, slots)
        budget -= max_batch * state_bytes
    if not groups:
        return max_batch, []
    blocks = [budget * need // per_request for need in needs]
    if any(n < need for n, need in zip(blocks, needs)):
        raise ValueError(f"cache budget {budget} B is too small for one request: one of max_seq_len={max_seq_len} "
                         f"needs {per_request} B of {block_size}-token blocks")
    return max_batch, blocks


def pool_bytes(specs, dtype, kv_cache: str, max_batch: int, max_seq_len: int, block_size: int, num_blocks: list[int],
               kv_format: str = "auto") -> int:
    """Bytes a CachePool of these sizes allocates (slot rows and state, or blocks and state), from the declarations
    alone: what must fit in memory before torch is asked for it."""
    if kv_cache == "contiguous":
        return max_batch * sum(row_bytes(spec, max_seq_len, dtype, kv_format) for spec in specs)
    state = max_batch * sum(spec.state_bytes(dtype) for spec in specs)
    groups = cache_groups(specs)
    return sum(n * block_size * g.token_bytes(specs, dtype, kv_format) for n, g in zip(num_blocks, groups)) + state


def row_bytes(spec: CacheSpec, max_seq_len: int, dtype: torch.dtype, kv_format: str = "auto") -> int:
    """Bytes one contiguous batch slot of the layer allocates: every row of its buffer or ring (a chunked layer's ring
    is a whole chunk long, though a sequence just past a chunk boundary has one key live) and its state."""
    return spec.token_bytes(dtype, kv_format) * spec.retention.rows(max_seq_len) + spec.state_bytes(dtype)
