"""First-come-first-served admission into a fixed number of batch slots (continuous batching), and, under optimistic
admission, preemption: when the running requests cannot all get the blocks their next token needs, the most recently
admitted one gives its blocks and slot back and waits at the front of the queue to be recomputed (vLLM's policy). The
oldest running request is never the one preempted while others run, so it always makes progress."""
import math
from collections import deque

from harness.engine.block_manager import BlockManager
from harness.engine.sequence import Sequence, Status

# Host bytes a batch slot costs the scheduler from the start: its free-list entry (a deque slot and a distinct int
# object); tracemalloc measures 40.2 B a slot on CPython 3.11
HOST_BYTES_PER_SLOT = 40
# Most batch slots an engine runs, whatever memory would hold: each is a free-list entry and the decode graphs keep a
# bucket per 16 of them (vLLM runs 256 to 1024 sequences by default)
MAX_BATCH = 2**16


class Scheduler:
    def __init__(self, max_batch: int, block_managers: list[BlockManager], prefix_caching: bool = False,
                 decode_tokens: int = 1):
        """decode_tokens: tokens a running request feeds per decode step (k + 1 under speculative decoding: its
        newest token and k proposals)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = deque(range(max_batch))
        self.block_managers = block_managers  # empty for the contiguous layout
        self.prefix_caching = prefix_caching
        self.decode_tokens = decode_tokens
        self.preemptions = 0
        self.prompt_tokens = 0  # prefill tokens of every admission (a readmitted request counts again)
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, budget: int | None) -> list[tuple[Sequence, int]]:
        """This step's prefill work as (sequence, new tokens): the running requests part-way through their prompts
        first, then waiting ones admitted oldest first while they fit (stopping at the first that does not: no
        starvation). budget None: whole prompts. A token budget (chunked prefill, as in vLLM and Sarathi-Serve):
        the running decodes take their tokens (one each; k + 1 speculating) and prefill chunks the rest, so a long
        prompt is split over steps."""
        left = math.inf if budget is None else budget - self.decode_tokens * sum(s.prefilled for s in self.running)
        chunks = []
        for seq in self.running:
            if not seq.prefilled and left > 0:
                chunks.append((seq, min(len(seq.prefill_ids) - seq.num_cached, left)))
                left -= chunks[-1][1]
        while self.waiting and self.free_slots and left > 0:
            seq = self.waiting[0]
            hit = self.prefix_hit(seq)
            n = min(len(seq.prefill_ids) - hit, left)
            if not all(manager.can_admit(seq, hit + n, not self.running, hit) for manager in self.block_managers):
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            seq.status = Status.RUNNING
            seq.num_cached = seq.cached_tokens = hit
            for manager in self.block_managers:
                manager.admit(seq, hit + n, hit)
            self.prompt_tokens += len(seq.prefill_ids)
            self.cached_prompt_tokens += hit
            self.running.append(seq)
            chunks.append((seq, n))
            left -= n
        return chunks

    def prefix_hit(self, seq: Sequence) -> int:
        """Leading prefill tokens whose blocks every cache group finds in its prefix cache: whole blocks, and never
        the last token, whose logits the prefill must produce."""
        if not self.prefix_caching:
            return 0
        block_size = self.block_managers[0].block_size
        for blocks in range((len(seq.prefill_ids) - 1) // block_size, 0, -1):
            if all(manager.cached_prefix(seq, blocks) is not None for manager in self.block_managers):
                return blocks * block_size
        return 0

    def make_room(self, chunks: list[tuple[Sequence, int]] = ()) -> list[tuple[Sequence, int]]:
        """Preempt the newest running requests until every other one can get the blocks this step feeds it: its
        decode tokens for each that decodes, its chunk for each listed prefill. Returns the chunks still running. Reserve
        managers reserved that room at admission, so only optimistic ones are asked (no per-step work under the
        default)."""
        optimistic = [manager for manager in self.block_managers if manager.optimistic]
        while self.running and optimistic and not all(self.fits(manager, chunks) for manager in optimistic):
            self.preempt(self.running[-1])
        return [(seq, n) for seq, n in chunks if seq.status is Status.RUNNING]

    def fits(self, manager: BlockManager, chunks: list[tuple[Sequence, int]]) -> bool:
        new_tokens = {seq.request_id: n for seq, n in chunks if seq.status is Status.RUNNING}
        need = sum(max(0, manager.step_blocks(s, self.decode_tokens if s.prefilled else new_tokens.get(s.request_id, 0)))
                   for s in self.running)
        return need <= manager.num_free

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
