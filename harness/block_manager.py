"""Paged-cache bookkeeping for one cache group: a free list of blocks and each sequence's block table (vLLM's
block manager). A sequence holds only the blocks its group's retention policy still needs: blocks lying wholly among
the positions it drops (before a sliding window, between the sinks and the window, in an earlier chunk) go back."""
from collections import deque

from cache import FULL, Retention


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, retention: Retention = FULL):
        self.block_size, self.num_blocks, self.retention = block_size, num_blocks, retention
        self.free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # request id -> pool block per logical block, -1 once freed
        self.promised = 0  # blocks admitted sequences may still need on top of what they hold

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, max_length: int) -> int:
        return self.retention.peak_blocks(max_length, self.block_size)

    def can_admit(self, max_length: int) -> bool:
        """Admit only what can run to completion: no request is ever stranded for lack of blocks."""
        return self.peak_blocks(max_length) <= len(self.free) - self.promised

    def admit(self, seq) -> None:
        self.tables[seq.request_id] = []
        self.promised += self.peak_blocks(seq.max_length)

    def held(self, seq) -> int:
        return sum(block >= 0 for block in self.tables[seq.request_id])

    def grow(self, seq, length: int) -> None:
        """Make the table cover `length` tokens; first return the blocks the retention policy no longer needs."""
        table = self.tables[seq.request_id]
        dead = self.retention.dead_blocks(length, self.block_size)
        for i in dead:
            if i < len(table) and table[i] >= 0:
                self.free.append(table[i])
                table[i] = -1
                self.promised += 1  # still within the sequence's peak: it will take a block again
        while len(table) < self.blocks_for(length):
            if len(table) in dead:
                table.append(-1)  # a long prompt's blocks that are dropped before they are written
            else:
                table.append(self.free.popleft())
                self.promised -= 1

    def slot(self, seq, position: int, length: int) -> int:
        """Flat pool slot for `position` in a sequence of `length` tokens; -1 when the policy drops it unwritten."""
        lo, hi = self.retention.dropped(length)
        if lo <= position < hi:
            return -1
        return self.tables[seq.request_id][position // self.block_size] * self.block_size + position % self.block_size

    def release(self, seq) -> None:
        table = self.tables.pop(seq.request_id)
        held = [block for block in table if block >= 0]
        self.promised -= self.peak_blocks(seq.max_length) - len(held)
        self.free.extend(held)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
