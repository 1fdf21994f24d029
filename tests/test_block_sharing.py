"""Random programs of admit (with prefix-cache hits) / grow / speculate (write proposals, keep a prefix) / fork /
preempt / finish on one block manager whose pool is small enough to evict, with every block's contents simulated: after every call, free + held = pool, each block's
reference count is the number of table entries naming it, the prefix cache's maps agree, and every sequence reads its
own tokens through its table (so sharing, eviction and copy-on-write never hand one sequence another's keys)."""
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from cache import FULL, Retention
from harness.engine.block_manager import BlockManager

BLOCK_SIZE = 4
NUM_BLOCKS = 12
BASES = [[1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 0, 0, 0, 0], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]]  # shared prefixes
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "archzoo-hypothesis")
PROGRAMS = settings(max_examples=150, stateful_step_count=30, deadline=None, database=None, derandomize=True)


@dataclass
class FakeSequence:
    """What the block manager reads of a sequence: its id, tokens and how many of them are in the cache."""

    request_id: int
    tokens: list[int]
    num_cached: int = 0
    digests: list[bytes] = field(default_factory=list)

    @property
    def prefill_ids(self) -> list[int]:
        return self.tokens

    @property
    def all_ids(self) -> list[int]:
        return self.tokens


class SharingProgram(RuleBasedStateMachine):
    def __init__(self, retention: Retention):
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE, retention, admission="optimistic", prefix_caching=True)
        self.contents = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]  # the token whose key each slot holds
        self.running: list[FakeSequence] = []
        self.next_id = 0
        self.named: set[bytes] = set()  # every digest the cache has held

    def new_sequence(self, tokens: list[int]) -> FakeSequence:
        self.next_id += 1
        return FakeSequence(self.next_id, tokens)

    def write(self, seq: FakeSequence, length: int, name: bool = True) -> None:
        """The runner's part of a step: grow, copy what copy-on-write asks, write the new tokens, name full blocks
        (a speculative verification names them only once it has kept its accepted prefix)."""
        first = seq.num_cached + 1 if seq.num_cached else None
        self.manager.grow(seq, length, first)
        for source, destination in self.manager.copies:
            self.contents[destination] = list(self.contents[source])
        self.manager.copies = []
        for position in range(seq.num_cached, length):
            slot = self.manager.slot(seq, position, first or length)
            if slot >= 0:
                self.contents[slot // BLOCK_SIZE][slot % BLOCK_SIZE] = seq.tokens[position]
        seq.num_cached = length
        if name:
            self.manager.name_full_blocks(seq)
            self.named |= set(self.manager.cache.blocks)

    @property
    def evictions(self) -> int:
        return len(self.named - set(self.manager.cache.blocks))

    def preempt_newest(self) -> None:
        self.manager.release(self.running.pop())

    # ---- the program's calls ------------------------------------------------------------------------------

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, base, cut, tail):
        seq = self.new_sequence(BASES[base][:cut] + tail)
        hit = next((k * BLOCK_SIZE for k in range((len(seq.tokens) - 1) // BLOCK_SIZE, 0, -1)
                    if self.manager.cached_prefix(seq, k) is not None), 0)
        if not self.manager.can_admit(seq, len(seq.tokens), alone=not self.running, hit=hit):
            return
        seq.num_cached = hit
        self.manager.admit(seq, len(seq.tokens), hit)
        self.running.append(seq)
        self.write(seq, len(seq.tokens))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def grow(self, pick, new):
        seq = self.running[pick % len(self.running)]
        seq.tokens += new
        while seq in self.running and self.manager.step_blocks(seq, len(new)) > self.manager.num_free:
            self.preempt_newest()  # the scheduler's policy: the newest gives its blocks back
        if seq in self.running:
            self.write(seq, len(seq.tokens))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7), proposed=st.lists(st.integers(0, 3), min_size=1, max_size=5),
          accepted=st.integers(0, 5))
    def speculate(self, pick, proposed, accepted):
        """A speculative verification: the newest token and the proposals are written, then only the accepted prefix
        (and the newest) is kept: the blocks past it go back, and full blocks are named after that."""
        seq = self.running[pick % len(self.running)]
        start = seq.num_cached
        seq.tokens += proposed
        while seq in self.running and self.manager.step_blocks(seq, len(proposed)) > self.manager.num_free:
            self.preempt_newest()
        if seq not in self.running:
            return
        self.write(seq, len(seq.tokens), name=False)
        keep = start + 1 + min(accepted, len(proposed) - 1)
        self.manager.truncate(seq, keep)
        del seq.tokens[keep:]
        seq.num_cached = keep
        self.manager.name_full_blocks(seq)
        self.named |= set(self.manager.cache.blocks)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7))
    def fork(self, pick):
        parent = self.running[pick % len(self.running)]
        child = self.new_sequence(list(parent.tokens))
        child.num_cached, child.digests = parent.num_cached, list(parent.digests)
        self.manager.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7))
    def finish(self, pick):
        self.manager.release(self.running.pop(pick % len(self.running)))

    # ---- the books balance after every call ---------------------------------------------------------------

    @invariant()
    def free_plus_held_is_the_pool(self):
        manager = self.manager
        held = {block for table in manager.tables.values() for block in table if block >= 0}
        assert manager.num_free + len(held) == NUM_BLOCKS
        assert held.isdisjoint(manager.free) and held.isdisjoint(manager.cache.evictable)
        assert sorted([*held, *manager.free, *manager.cache.evictable]) == list(range(NUM_BLOCKS))

    @invariant()
    def a_blocks_refcount_is_its_holders(self):
        entries = [block for table in self.manager.tables.values() for block in table if block >= 0]
        assert self.manager.refs == [entries.count(block) for block in range(NUM_BLOCKS)]
        assert set(self.manager.tables) == {seq.request_id for seq in self.running}

    @invariant()
    def the_prefix_cache_maps_agree(self):
        cache = self.manager.cache
        assert {block: digest for digest, block in cache.blocks.items()} == cache.digests
        assert set(cache.evictable) <= set(cache.digests)
        assert all(self.manager.refs[block] == 0 for block in cache.evictable)
        assert not set(self.manager.free) & set(cache.digests)  # a cached block is held or evictable

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        lo, hi = 0, 0
        for seq in self.running:
            table = self.manager.tables[seq.request_id]
            if not self.manager.retention.keeps_all:
                lo, hi = self.manager.retention.dropped(seq.num_cached)
            for position in range(seq.num_cached):
                block = table[position // BLOCK_SIZE]
                if block >= 0 and not lo <= position < hi:
                    assert self.contents[block][position % BLOCK_SIZE] == seq.tokens[position], (seq, position)

    def teardown(self):
        while self.running:
            self.finish(0)
        assert self.manager.num_free == NUM_BLOCKS and not any(self.manager.refs)


@pytest.mark.parametrize("retention", [FULL, Retention(window=6)], ids=["full", "window"])
def test_random_programs_share_blocks_safely(retention):
    run_state_machine_as_test(lambda: SharingProgram(retention), settings=PROGRAMS)


def test_sharing_copy_on_write_and_eviction_all_happen():
    """The programs above exercise what they claim: a hit, a copy-on-write and an eviction in one short script."""
    program = SharingProgram(FULL)
    program.admit(0, 8, [3])  # 9 tokens: two full blocks named
    program.admit(0, 8, [1])  # the same 8 tokens: both blocks shared
    assert program.running[1].num_cached == 9 and program.manager.refs[program.manager.tables[2][0]] == 2
    program.fork(0)
    program.grow(2, [0])  # the child writes into the third block, which it shares with its parent: copied
    assert program.manager.tables[1][2] != program.manager.tables[3][2]
    program.every_sequence_reads_its_own_tokens()
    for _ in range(3):
        program.finish(0)
    for tail in range(4):  # more distinct full blocks than the pool holds: the oldest cached ones go
        for base in range(len(BASES)):
            program.admit(base, 12, [tail] * 5)
            program.finish(0)
    assert program.evictions > 0
