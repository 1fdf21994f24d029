"""The engine's cache memory: one layout per layer, allocated from the layers' cache declarations.

Paged layers are grouped by window: a group's layers share block ids (one block table per sequence per group),
so a sliding-window group can return blocks while a global group in the same model keeps them.
"""
from dataclasses import dataclass

import torch

from attention import CacheSpec, ContiguousKV, PagedKV, StateSlots, specs_read

LAYOUTS = ("contiguous", "paged")


@dataclass
class CacheGroup:
    window: int | None
    layers: list[int]  # memory-owning layers whose blocks live and die together
    token_elements: int  # cache elements one token costs across those layers


def cache_groups(specs: list[CacheSpec]) -> list[CacheGroup]:
    """Layers with a per-token cache, grouped by window, in order of first appearance (state layers have no blocks)."""
    groups: dict[int | None, CacheGroup] = {}
    for i, spec in enumerate(specs):
        if spec.elements_per_token > 0:
            group = groups.setdefault(spec.window, CacheGroup(spec.window, [], 0))
            group.layers.append(i)
            group.token_elements += spec.elements_per_token
    return list(groups.values())


class CachePool:
    def __init__(self, specs: list[CacheSpec], layout: str, max_batch: int, max_seq_len: int,
                 block_size: int, num_blocks: list[int], dtype: torch.dtype, device):
        """num_blocks: pool size of each cache group (paged layout)."""
        self.specs, self.layout, self.block_size = specs, layout, block_size
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.groups = cache_groups(specs)
        self.layers = [None] * len(specs)
        for g, group in enumerate(self.groups):
            for i in group.layers:
                self.layers[i] = (ContiguousKV(specs[i], max_batch, max_seq_len, dtype, device) if layout == "contiguous"
                                  else PagedKV(specs[i], num_blocks[g], block_size, g, dtype, device))
        for i, spec in enumerate(specs):
            if spec.kind == "state":  # one row per batch slot, in either layout
                self.layers[i] = StateSlots(spec, max_batch, dtype, device)
            elif not spec.owns_memory:
                self.layers[i] = self.layers[spec.source]  # cross-layer sharing: the producer's cache object
        self.state_slot_bytes = sum(spec.state_bytes(dtype) for spec in specs)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the caches (the measured figure); a shared cache counts once."""
        return sum({id(layer): layer.nbytes for layer in self.layers}.values())

    def read_bytes(self, tokens: int) -> int:
        """Analytic cache bytes a decode step reads for one sequence of `tokens` tokens; a shared cache is read by
        every layer that shares it."""
        return sum(spec.bytes(tokens, self.dtype) for spec in specs_read(self.specs))

    def block_bytes(self, group: int) -> int:
        return self.element_size * self.block_size * self.groups[group].token_elements
