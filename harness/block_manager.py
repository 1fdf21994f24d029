"""Paged-cache bookkeeping for one cache group: a free list of blocks and each sequence's block table (vLLM's
block manager). Under a sliding window a sequence holds only the blocks its window touches: the rest go back."""
from collections import deque


def peak_blocks(max_length: int, block_size: int, window: int | None) -> int:
    """Most blocks a sequence of up to `max_length` tokens holds at once: W keys span at most (W-1)//bs + 2."""
    whole = -(-max_length // block_size)
    return whole if window is None else min(whole, (window - 1) // block_size + 2)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        self.block_size, self.num_blocks, self.window = block_size, num_blocks, window
        self.free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # request id -> pool block per logical block, -1 once freed
        self.promised = 0  # blocks admitted sequences may still need on top of what they hold

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, max_length: int) -> int:
        return peak_blocks(max_length, self.block_size, self.window)

    def can_admit(self, max_length: int) -> bool:
        """Admit only what can run to completion: no request is ever stranded for lack of blocks."""
        return self.peak_blocks(max_length) <= len(self.free) - self.promised

    def admit(self, seq) -> None:
        self.tables[seq.request_id] = []
        self.promised += self.peak_blocks(seq.max_length)

    def held(self, seq) -> int:
        return sum(block >= 0 for block in self.tables[seq.request_id])

    def first_kept(self, length: int) -> int:
        """First position a sequence of `length` tokens still needs: its newest query sees keys from there on."""
        return 0 if self.window is None else max(0, length - self.window)

    def grow(self, seq, length: int) -> None:
        """Make the table cover `length` tokens; under a window, first return the blocks wholly before it."""
        table = self.tables[seq.request_id]
        first_block = self.first_kept(length) // self.block_size
        for i in range(min(first_block, len(table))):
            if table[i] >= 0:
                self.free.append(table[i])
                table[i] = -1
                self.promised += 1  # still within the sequence's peak: it will take a block again
        while len(table) < self.blocks_for(length):
            if len(table) < first_block:
                table.append(-1)  # a long prompt's blocks that fall out of the window before they are written
            else:
                table.append(self.free.popleft())
                self.promised -= 1

    def slot(self, seq, position: int, length: int) -> int:
        """Flat pool slot for `position` in a sequence of `length` tokens; -1 when the window drops it unwritten."""
        if position < self.first_kept(length):
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
