"""Paged-cache bookkeeping for one cache group: a free list of blocks and each sequence's block table (vLLM's
block manager). A sequence holds only the blocks its group's retention policy still needs: blocks lying wholly among
the positions it drops (before a sliding window, between the sinks and the window, in an earlier chunk) go back.

Two admission policies. "reserve" admits a request only if its worst case (prompt + max_new_tokens) fits beside
every admitted request's, so none is ever stranded. "optimistic" (vLLM's) admits on the blocks its prompt needs now,
keeping a watermark free for the running requests to grow into; when a decode step cannot get a block, the
scheduler preempts a running request and recomputes it later."""
from collections import deque

from cache import FULL, Retention

ADMISSIONS = ("reserve", "optimistic")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, retention: Retention = FULL, admission: str = "reserve",
                 watermark: float = 0.01, step_tokens: int = 1):
        """step_tokens: most new tokens one step feeds a sequence on top of its cache (a chunked prefill's chunk),
        whose first query may still see keys the step's last one drops."""
        self.block_size, self.num_blocks, self.retention = block_size, num_blocks, retention
        self.step_tokens = step_tokens
        self.optimistic = admission == "optimistic"
        self.watermark = max(1, int(watermark * num_blocks)) if self.optimistic else 0  # vLLM keeps 1% free
        self.free = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # request id -> pool block per logical block, -1 once freed
        self.promised = 0  # reserve: blocks admitted sequences may still need on top of what they hold

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, max_length: int) -> int:
        return self.retention.peak_blocks(max_length, self.block_size, self.step_tokens)

    def can_admit(self, seq, length: int, alone: bool = False) -> bool:
        """reserve: only what can run to completion (its peak beside every admitted request's promise).
        optimistic: what its first `length` tokens need now, leaving the watermark free unless it would run alone
        (a pool sized for the largest request would otherwise never admit it)."""
        if self.optimistic:
            return self.new_blocks(seq, length) <= len(self.free) - (0 if alone else self.watermark)
        return self.peak_blocks(seq.max_length) <= len(self.free) - self.promised

    def admit(self, seq, length: int) -> None:
        """Give the sequence a table; optimistic: with the blocks its first `length` tokens need."""
        self.tables[seq.request_id] = []
        if self.optimistic:
            self.grow(seq, length)  # taken now, so the next admission in this step sees them gone
        else:
            self.promised += self.peak_blocks(seq.max_length)

    def new_blocks(self, seq, length: int, first_length: int | None = None) -> int:
        """Blocks grow(seq, length, first_length) would take from the free list, less those it would return."""
        table = self.tables.get(seq.request_id, [])
        dead = self.retention.dead_blocks(first_length or length, self.block_size)
        taken = sum(1 for i in range(len(table), self.blocks_for(length)) if i not in dead)
        returned = sum(1 for i in dead if i < len(table) and table[i] >= 0)
        return taken - returned

    def step_blocks(self, seq, new_tokens: int) -> int:
        """new_blocks for feeding `new_tokens` more tokens on top of the sequence's cache (none: 0)."""
        if not new_tokens:
            return 0
        start = seq.num_cached
        return self.new_blocks(seq, start + new_tokens, start + 1 if start else None)

    def held(self, seq) -> int:
        return sum(block >= 0 for block in self.tables[seq.request_id])

    def grow(self, seq, length: int, first_length: int | None = None) -> None:
        """Make the table cover `length` tokens; first return the blocks the retention policy no longer needs.
        first_length: the sequence's length at this step's first new token, when that query reads its keys from
        the cache (a chunk on top of it): the blocks it still sees stay. Default `length`."""
        table = self.tables[seq.request_id]
        dead = self.retention.dead_blocks(first_length or length, self.block_size)
        for i in dead:
            if i < len(table) and table[i] >= 0:
                self.free.append(table[i])
                table[i] = -1
                self.promised += not self.optimistic  # reserve: still within its peak, it will take a block again
        while len(table) < self.blocks_for(length):
            if len(table) in dead:
                table.append(-1)  # a long prompt's blocks that are dropped before they are written
            else:
                table.append(self.free.popleft())
                self.promised -= not self.optimistic

    def slot(self, seq, position: int, length: int) -> int:
        """Flat pool slot for `position` once the sequence is `length` tokens long (the first_length of grow);
        -1 when the policy drops it unwritten."""
        lo, hi = self.retention.dropped(length)
        if lo <= position < hi:
            return -1
        return self.tables[seq.request_id][position // self.block_size] * self.block_size + position % self.block_size

    def release(self, seq) -> None:
        table = self.tables.pop(seq.request_id)
        held = [block for block in table if block >= 0]
        if not self.optimistic:
            self.promised -= self.peak_blocks(seq.max_length) - len(held)
        self.free.extend(held)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
