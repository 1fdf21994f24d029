"""First-come-first-served admission into a fixed number of batch slots (continuous batching), and, under optimistic
admission, preemption: when the running requests cannot all get the blocks their next token needs, the most recently
admitted one gives its blocks and slot back and waits at the front of the queue to be recomputed (vLLM's policy). The
oldest running request is never the one preempted while others run, so it always makes progress."""
from collections import deque

from harness.block_manager import BlockManager
from harness.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_batch: int, block_managers: list[BlockManager]):
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = deque(range(max_batch))
        self.block_managers = block_managers  # empty for the contiguous layout
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into free slots, oldest first; stop at the first that does not fit (no starvation)."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if not all(manager.can_admit(seq, len(seq.all_ids), alone=not self.running)
                       for manager in self.block_managers):
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = Status.RUNNING
            for manager in self.block_managers:
                manager.admit(seq)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def make_room(self) -> None:
        """Preempt the newest running requests until every other one can grow its cache by the token it decodes
        next. Reserve managers promised that room at admission, so only optimistic ones are asked (no per-step
        work under the default)."""
        optimistic = [manager for manager in self.block_managers if manager.optimistic]
        while self.running and not all(
                sum(max(0, manager.new_blocks(s, s.num_cached + 1)) for s in self.running) <= len(manager.free)
                for manager in optimistic):
            self.preempt(self.running[-1])

    def preempt(self, seq: Sequence) -> Sequence:
        """Free the request's blocks and slot and queue it first; its tokens so far stay, to be recomputed."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        for manager in self.block_managers:
            manager.release(seq)
        seq.status, seq.slot, seq.num_cached = Status.WAITING, -1, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        return seq

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
