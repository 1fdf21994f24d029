"""Recurrent state the engine allocates per layer: one row per batch slot for each named state tensor."""
import torch

from cache.spec import CacheBatch, CacheSpec
from kernels import cpu_memory


class StateSlots:
    """[max_batch, *shape] per state tensor; a sequence owns the row of its slot for as long as it runs.

    Mixers read their sequences' rows at the start of a step and write the updated rows back at its end;
    a prefill starts from zeros (the slot may hold a finished request's state). Steps with batch.checkpoints also
    keep the state after each of their tokens until forget_steps, so rollback can return a slot to any of them
    (speculative decoding keeps the accepted prefix of a verified or drafted run of tokens).
    """

    def __init__(self, spec: CacheSpec, max_batch: int, dtype, device):
        dtype = spec.state_dtype or dtype
        self.tensors = {name: cpu_memory.zeros(max_batch, *shape, dtype=dtype, device=device)  # 2 MiB pages on a CPU
                        for name, shape in spec.state_shapes}
        # checkpointed steps, oldest first: (slots [B], first new position [B], {name: state after each token [B, T, ...]})
        self.steps: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []

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
        """The states after the step's last token, [B, *shape] each (with checkpoints: a one-token step's only one)."""
        self.store(states, batch)
        if batch.checkpoints:
            self.steps.append((batch.slots, batch.lengths - 1, {n: v.unsqueeze(1).clone() for n, v in states.items()}))

    def write_steps(self, states: dict[str, torch.Tensor], batch: CacheBatch) -> None:
        """The states after each of the step's T tokens, [B, T, *shape] each (a step with checkpoints)."""
        self.store({name: value[:, -1] for name, value in states.items()}, batch)
        self.steps.append((batch.slots, batch.positions[:, 0], states))

    def store(self, states: dict[str, torch.Tensor], batch: CacheBatch) -> None:
        for name, value in states.items():
            self.tensors[name].index_copy_(0, batch.slots, value.to(self.tensors[name].dtype))

    def rollback(self, lengths: dict[int, int]) -> None:
        """Return each slot's state to the one after its first `length` tokens (slot -> length), taken from the
        newest checkpointed step that holds that token."""
        for slot, length in lengths.items():
            for slots, firsts, states in reversed(self.steps):
                rows = (slots == slot).nonzero()
                if not len(rows):
                    continue
                row = int(rows[0, 0])
                step = length - 1 - int(firsts[row])
                if 0 <= step < next(iter(states.values())).shape[1]:
                    for name, value in states.items():
                        self.tensors[name][slot] = value[row, step].to(self.tensors[name].dtype)
                    break
            else:
                if any(bool((slots == slot).any()) for slots, _, _ in self.steps):
                    raise RuntimeError(f"slot {slot}: no checkpointed state after token {length} to roll back to")

    def forget_steps(self) -> None:
        self.steps.clear()
