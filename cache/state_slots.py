"""Recurrent state the engine allocates per layer: one row per batch slot for each named state tensor."""
import torch

from cache.spec import CacheBatch, CacheSpec


class StateSlots:
    """[max_batch, *shape] per state tensor; a sequence owns the row of its slot for as long as it runs.

    Mixers read their sequences' rows at the start of a step and write the updated rows back at its end;
    a prefill starts from zeros (the slot may hold a finished request's state).
    """

    def __init__(self, spec: CacheSpec, max_batch: int, dtype, device):
        dtype = spec.state_dtype or dtype
        self.tensors = {name: torch.zeros(max_batch, *shape, dtype=dtype, device=device) for name, shape in spec.state_shapes}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, batch: CacheBatch) -> dict[str, torch.Tensor]:
        """This step's sequences' states, [B, *shape] each (a copy: write back what changes)."""
        if batch.is_prefill:
            return {name: t.new_zeros(len(batch.lengths), *t.shape[1:]) for name, t in self.tensors.items()}
        rows = batch.slots if batch.slot_range is None else batch.slot_range
        return {name: t[rows].clone() for name, t in self.tensors.items()}

    def write(self, states: dict[str, torch.Tensor], batch: CacheBatch) -> None:
        for name, value in states.items():
            self.tensors[name].index_copy_(0, batch.slots, value.to(self.tensors[name].dtype))
