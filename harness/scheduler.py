"""First-come-first-served admission into a fixed number of batch slots (continuous batching)."""
from collections import deque

from harness.block_manager import BlockManager
from harness.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_batch: int, block_managers: list[BlockManager]):
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = deque(range(max_batch))
        self.block_managers = block_managers  # empty for the contiguous layout

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free slots, oldest first; stop at the first that does not fit (no starvation)."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if not all(manager.can_admit(seq.max_length) for manager in self.block_managers):
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = Status.RUNNING
            for manager in self.block_managers:
                manager.admit(seq)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free the request's slot and blocks at once, so the next waiting request is admitted next step."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        for manager in self.block_managers:
            manager.release(seq)

    def abort(self, seq: Sequence, reason: str) -> None:
        """End a request wherever it is: a waiting one leaves the queue, a running one frees its slot and blocks."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, reason
        elif seq.status is Status.RUNNING:
            self.finish(seq, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
