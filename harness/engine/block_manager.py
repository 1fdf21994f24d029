"""Paged-cache bookkeeping for one cache group: a free list of blocks, a reference count per block and each sequence's
block table (vLLM's block manager). A sequence holds only the blocks its group's retention policy still needs: blocks
lying wholly among the positions it drops (before a sliding window, between the sinks and the window, in an earlier
chunk) go back.

Two admission policies. "reserve" admits a request only if its worst case (prompt + max_new_tokens) fits beside
every admitted request's, so none is ever stranded (sharing saves it compute, never room). "optimistic" (vLLM's) admits on the blocks its prompt needs now,
keeping a watermark free for the running requests to grow into; when a decode step cannot get a block, the
scheduler preempts a running request and recomputes it later.

A scored group (retention kept by attention scores, cache/eviction.py) packs a sequence's held tokens into its first
rows, so its table covers rows, not positions: min(length, capacity) after a step, the step's new rows on top during
it. Its blocks depend on the sequence's own scores, so none is offered to the prefix cache, and a step may write any
of them (an eviction moves the new token into the row that leaves): each shared one is copied first.

Blocks are shared by reference. With prefix caching, a request's first full blocks may be ones another request
filled with the same tokens (harness/engine/prefix_cache.py), and released full blocks stay cached until evicted. A fork
(beam search) shares every block of its parent; a step that writes into a block someone else also holds copies it
first (copy-on-write): the manager lists the (source, destination) pairs for the runner to copy before the forward.
"""
from collections import deque

from cache import FULL, Retention
from harness.engine.prefix_cache import PrefixCache, extend_digests

ADMISSIONS = ("reserve", "optimistic")
# Host bytes a block costs its manager from the start: a free-list entry (a deque slot and a distinct int object) and
# a reference count (a list slot); tracemalloc measures 48.2 B a block on CPython 3.11
HOST_BYTES_PER_BLOCK = 48
MAX_BLOCKS = 2**31 - 2  # block ids, a spare block's included, are int32 in the block tables the kernels read


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, retention: Retention = FULL, admission: str = "reserve",
                 watermark: float = 0.01, step_tokens: int = 1, prefix_caching: bool = False):
        """step_tokens: most new tokens one step feeds a sequence on top of its cache (a chunked prefill's chunk),
        whose first query may still see keys the step's last one drops."""
        self.block_size, self.num_blocks, self.retention = block_size, num_blocks, retention
        self.step_tokens = step_tokens
        self.optimistic = admission == "optimistic"
        self.watermark = max(1, int(watermark * num_blocks)) if self.optimistic else 0  # vLLM keeps 1% free
        self.free = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self.refs = [0] * num_blocks  # table entries naming each block
        self.cache = PrefixCache() if prefix_caching else None
        self.tables: dict[int, list[int]] = {}  # request id -> pool block per logical block, -1 once freed
        self.named: dict[int, int] = {}  # request id -> its leading full blocks already named in the prefix cache
        self.unwritten: dict[int, range] = {}  # request id -> positions its prefill dropped unwritten (a window's)
        self.reserved = 0  # reserve: the admitted sequences' peaks, which together fit the pool
        self.copies: list[tuple[int, int]] = []  # copy-on-write (source, destination) pairs for the next forward

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def step_rows(self, seq, length: int) -> int:
        """A scored group's rows a step that ends at `length` tokens needs: what a prefill keeps, or the rows held
        before the step and its new tokens."""
        capacity = self.retention.capacity
        if not seq.num_cached:
            return min(length, capacity)
        return min(seq.num_cached, capacity) + length - seq.num_cached

    def first_length(self, start: int) -> int | None:
        """The first_length of grow for a step feeding a sequence that holds `start` tokens: the length at its first
        new token, whose query reads the cache. A prefill from nothing (None) writes only what its last query sees;
        with prefix caching it writes and names every block (as vLLM caches a sliding window's blocks), so a later
        prompt sharing a longer prefix finds the blocks its own window needs; those behind the window go back after
        the step, still cached."""
        return start + 1 if start or self.cache is not None else None

    def peak_blocks(self, max_length: int) -> int:
        return self.retention.peak_blocks(max_length, self.block_size, self.step_tokens)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds: the free list and the cached blocks that may be evicted."""
        return len(self.free) + (len(self.cache.evictable) if self.cache else 0)

    # ---- references -------------------------------------------------------------------------------------

    def take(self) -> int:
        """A block for new contents: a free one, else the least recently released cached one."""
        block = self.free.popleft() if self.free else self.cache.evict()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cache.unpark(block)
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One holder lets go; the last one returns the block, which stays findable if it is cached."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.cache is not None and self.cache.holds(block):
                self.cache.park(block)
            else:
                self.free.append(block)

    # ---- prefix caching ---------------------------------------------------------------------------------

    def cached_prefix(self, seq, blocks: int) -> list[int] | None:
        """The pool blocks holding the sequence's first `blocks` full blocks (-1 where the retention policy drops
        them before the next token), or None unless every one it still needs is cached."""
        digests = extend_digests(seq.digests, seq.prefill_ids, self.block_size)
        dead = self.retention.dead_blocks(blocks * self.block_size + 1, self.block_size)
        found = [-1 if i in dead else self.cache.lookup(digests[i]) for i in range(blocks)]
        return None if None in found else found

    def name_full_blocks(self, seq) -> None:
        """After a forward: offer every newly filled block of the sequence to the prefix cache."""
        if self.cache is None or self.retention.scored:
            return
        table = self.tables[seq.request_id]
        full = seq.num_cached // self.block_size
        digests = extend_digests(seq.digests, seq.all_ids[: full * self.block_size], self.block_size)
        skipped = self.unwritten.get(seq.request_id, range(0))
        for i in range(self.named.get(seq.request_id, 0), full):
            # a block holding a position the prefill skipped lacks a key a shorter prefix's query would see
            if table[i] >= 0 and not range(max(i * self.block_size, skipped.start),
                                            min((i + 1) * self.block_size, skipped.stop)):
                self.cache.register(digests[i], table[i])
        self.named[seq.request_id] = full

    # ---- admission and growth ---------------------------------------------------------------------------

    def can_admit(self, seq, length: int, alone: bool = False, hit: int = 0) -> bool:
        """reserve: only what can run to completion (its peak beside every admitted request's promise).
        optimistic: what its first `length` tokens need now (its first `hit` found in the prefix cache), leaving the
        watermark free unless it would run alone (a pool sized for the largest request would otherwise never admit
        it)."""
        if self.optimistic:
            found = self.cached_prefix(seq, hit // self.block_size) if hit else []
            revived = sum(self.refs[block] == 0 for block in found if block >= 0)  # cached, but counted as free
            if self.retention.scored:
                return self.blocks_for(min(length, self.retention.capacity)) <= self.num_free - (
                    0 if alone else self.watermark)
            dead = self.retention.dead_blocks(self.first_length(hit) or length, self.block_size)
            fresh = sum(i not in dead for i in range(len(found), self.blocks_for(length)))
            return revived + fresh <= self.num_free - (0 if alone else self.watermark)
        # not num_free - what the others still need: a block shared now may later be held by one alone
        return self.peak_blocks(seq.max_length) <= self.num_blocks - self.reserved

    def admit(self, seq, length: int, hit: int = 0) -> None:
        """Give the sequence a table starting with the `hit` tokens' cached blocks (seq.num_cached == hit);
        optimistic: with the blocks its first `length` tokens need."""
        table = self.cached_prefix(seq, hit // self.block_size) if hit else []
        for block in table:
            if block >= 0:
                self.share(block)
        self.tables[seq.request_id] = table
        self.named[seq.request_id] = len(table)
        if self.optimistic:
            self.grow(seq, length, self.first_length(hit))  # taken now, so the next admission sees them gone
        else:
            self.reserved += self.peak_blocks(seq.max_length)

    def fork(self, parent, child) -> None:
        """The child shares every block of the parent (beam search); a write into a shared block copies it first.
        reserve: the child's peak joins the reservation (a copy never makes a sequence hold more than its peak)."""
        if not self.optimistic:
            peak = self.peak_blocks(child.max_length)
            if peak > self.num_blocks - self.reserved:
                raise ValueError(f"cannot fork: the child may need {peak} blocks and the pool has "
                                 f"{self.num_blocks - self.reserved} unreserved")
            self.reserved += peak
        table = list(self.tables[parent.request_id])
        for block in table:
            if block >= 0:
                self.share(block)
        self.tables[child.request_id] = table
        self.named[child.request_id] = self.named.get(parent.request_id, 0)
        if parent.request_id in self.unwritten:
            self.unwritten[child.request_id] = self.unwritten[parent.request_id]

    def new_blocks(self, seq, length: int, first_length: int | None = None) -> int:
        """Blocks grow(seq, length, first_length) would take from the free blocks, less those it would return."""
        table = self.tables.get(seq.request_id, [])
        if self.retention.scored:
            need = self.blocks_for(self.step_rows(seq, length))
            copied = sum(1 for block in table[:need] if self.refs[block] > 1)
            returned = sum(1 for block in table[need:] if self.refs[block] == 1)
            return max(0, need - len(table)) + copied - returned
        dead = self.retention.dead_blocks(first_length or length, self.block_size)
        taken = sum(1 for i in range(len(table), self.blocks_for(length)) if i not in dead)
        copied = sum(1 for i in self.written(seq, table, length) if i not in dead and self.refs[table[i]] > 1)
        returned = sum(1 for i in dead if i < len(table) and table[i] >= 0 and self.refs[table[i]] == 1)
        return taken + copied - returned

    def step_blocks(self, seq, new_tokens: int) -> int:
        """new_blocks for feeding `new_tokens` more tokens on top of the sequence's cache (none: 0)."""
        if not new_tokens:
            return 0
        start = seq.num_cached
        return self.new_blocks(seq, start + new_tokens, self.first_length(start))

    def written(self, seq, table: list[int], length: int) -> range:
        """Logical blocks of the table that a step writing positions num_cached .. length - 1 writes into."""
        return range(seq.num_cached // self.block_size, min(len(table), self.blocks_for(length)))

    def truncate(self, seq, length: int) -> None:
        """Speculative decoding kept the sequence's first `length` tokens: the blocks wholly past them go back."""
        table = self.tables[seq.request_id]
        keep = self.blocks_for(length)
        for block in table[keep:]:
            if block >= 0:
                self.drop(block)
        del table[keep:]

    def held(self, seq) -> int:
        return sum(block >= 0 for block in self.tables[seq.request_id])

    def grow(self, seq, length: int, first_length: int | None = None) -> None:
        """Make the table cover `length` tokens; first return the blocks the retention policy no longer needs, and
        give the sequence its own copy of every shared block this step writes into.
        first_length: the sequence's length at this step's first new token, when that query reads its keys from
        the cache (a chunk on top of it): the blocks it still sees stay. Default `length`."""
        table = self.tables[seq.request_id]
        if self.retention.scored:
            self.grow_rows(seq, table, self.blocks_for(self.step_rows(seq, length)))
            return
        dead = self.retention.dead_blocks(first_length or length, self.block_size)
        if not seq.num_cached:  # a prefill writes only what its last query sees
            self.unwritten[seq.request_id] = range(*self.retention.dropped(first_length or length))
        for i in dead:
            if i < len(table) and table[i] >= 0:
                self.drop(table[i])
                table[i] = -1
        for i in self.written(seq, table, length):
            if table[i] >= 0 and self.refs[table[i]] > 1:
                source, table[i] = table[i], self.take()
                self.copies.append((source, table[i]))
                self.drop(source)
        while len(table) < self.blocks_for(length):
            if len(table) in dead:
                table.append(-1)  # a long prompt's blocks that are dropped before they are written
            else:
                table.append(self.take())

    def grow_rows(self, seq, table: list[int], need: int) -> None:
        """A scored group's table to exactly `need` blocks: a spare row's emptied block goes back, and every shared
        block is copied first, since the step may write any row."""
        for block in table[need:]:
            self.drop(block)
        del table[need:]
        for i, block in enumerate(table):
            if self.refs[block] > 1:
                table[i] = self.take()
                self.copies.append((block, table[i]))
                self.drop(block)
        while len(table) < need:
            table.append(self.take())

    def slot(self, seq, position: int, length: int) -> int:
        """Flat pool slot for `position` once the sequence is `length` tokens long (the first_length of grow);
        -1 when the policy drops it unwritten (always in a scored group, whose layers place rows themselves)."""
        if self.retention.scored:
            return -1
        lo, hi = self.retention.dropped(length)
        if lo <= position < hi:
            return -1
        return self.tables[seq.request_id][position // self.block_size] * self.block_size + position % self.block_size

    def release(self, seq) -> None:
        table = self.tables.pop(seq.request_id)
        self.named.pop(seq.request_id, None)
        self.unwritten.pop(seq.request_id, None)
        if not self.optimistic:
            self.reserved -= self.peak_blocks(seq.max_length)
        for block in table:
            if block >= 0:
                self.drop(block)

    @property
    def used(self) -> int:
        return self.num_blocks - self.num_free
