"""The engine's cache memory: one layout per layer, allocated from the layers' cache declarations."""
import torch

from attention import CacheSpec, ContiguousKV, PagedKV

LAYOUTS = ("contiguous", "paged")


class CachePool:
    def __init__(self, specs: list[CacheSpec], layout: str, max_batch: int, max_seq_len: int,
                 block_size: int, num_blocks: int, dtype: torch.dtype, device):
        self.specs = specs
        self.layout = layout
        self.block_size = block_size
        self.element_size = torch.empty((), dtype=dtype).element_size()
        for i, spec in enumerate(specs):
            if spec.kind != "kv":
                raise ValueError(f"layer {i} declares a {spec.kind!r} cache; this engine allocates: kv")
        if layout == "contiguous":
            self.layers = [ContiguousKV(max_batch, s.kv_heads, max_seq_len, s.head_dim, dtype, device) for s in specs]
        else:
            self.layers = [PagedKV(num_blocks, block_size, s.kv_heads, s.head_dim, dtype, device) for s in specs]

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for the caches (the measured figure)."""
        return sum(layer.nbytes for layer in self.layers)

    def sequence_bytes(self, tokens: int) -> int:
        """Analytic bytes one sequence of `tokens` tokens occupies across all layers."""
        return self.element_size * sum(spec.elements(tokens) for spec in self.specs)

    @staticmethod
    def slot_bytes(specs: list[CacheSpec], tokens: int, dtype: torch.dtype) -> int:
        """Bytes `tokens` allocated token slots cost across all layers: a block, or a contiguous row."""
        return torch.empty((), dtype=dtype).element_size() * tokens * sum(s.elements_per_token for s in specs)
