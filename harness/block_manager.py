"""Paged-cache bookkeeping: a free list of blocks, handed to sequences as they grow (vLLM's block manager)."""
from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = deque(range(num_blocks))
        self.promised = 0  # blocks admitted sequences may still need before they finish

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_admit(self, max_tokens: int) -> bool:
        """Admit only what can run to completion: no request is ever stranded for lack of blocks."""
        return self.blocks_for(max_tokens) <= len(self.free) - self.promised

    def admit(self, seq) -> None:
        self.promised += self.blocks_for(seq.max_length)

    def grow(self, seq, tokens: int) -> None:
        """Give `seq` enough blocks to hold `tokens` tokens."""
        while len(seq.blocks) < self.blocks_for(tokens):
            seq.blocks.append(self.free.popleft())
            self.promised -= 1

    def release(self, seq) -> None:
        self.promised -= self.blocks_for(seq.max_length) - len(seq.blocks)
        self.free.extend(seq.blocks)
        seq.blocks = []

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
