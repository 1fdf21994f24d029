"""Turns scheduled sequences into model calls: builds each step's CacheBatch and runs prefill or batched decode."""
import torch

from cache import CacheBatch
from harness.block_manager import BlockManager
from harness.cache_pool import CachePool
from harness.sequence import Sequence


class ModelRunner:
    def __init__(self, model, pool: CachePool, block_managers: list[BlockManager], device, max_seq_len: int,
                 compile_decode: bool = False):
        self.model = model
        self.pool = pool
        self.block_managers = block_managers
        self.device = device
        self.max_seq_len = max_seq_len
        self.compile_decode = compile_decode
        # A compiled step needs fixed shapes: attend over the whole cache (masked) instead of the longest sequence.
        # No weight freezing: oneDNN's pre-packed linears measured no faster than the eager GEMMs on CPU (gqa base,
        # batch 1 and 16, fp32 and bf16), and a frozen step would keep the weights it was compiled with.
        self.decode_forward = torch.compile(model, dynamic=False) if compile_decode else model

    @torch.inference_mode()
    def prefill(self, seq: Sequence, new_tokens: int) -> torch.Tensor:
        """Feed the next `new_tokens` of the sequence's prefill_ids (the prompt; for a preempted request also its
        tokens so far): from position 0 a prefill, later a chunk on top of its cache. Returns the last position's
        logits [vocab]."""
        start = seq.num_cached
        end = start + new_tokens
        tokens = torch.tensor([seq.prefill_ids[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0)
        batch = self.cache_batch([seq], positions, [end], step="prefill" if not start else "chunk" if new_tokens > 1
                                 else "decode")
        logits = self.model(tokens, positions, self.pool.layers, batch, last_only=True)
        seq.num_cached = end
        self.name_full_blocks([seq])
        return logits[0, -1]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; returns logits [B, vocab]."""
        tokens = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        positions = torch.tensor([[s.num_cached] for s in seqs], device=self.device)
        lengths = [s.num_cached + 1 for s in seqs]
        batch = self.cache_batch(seqs, positions, lengths, step="decode")
        logits = self.decode_forward(tokens, positions, self.pool.layers, batch)
        for s in seqs:
            s.num_cached += 1
        self.name_full_blocks(seqs)
        return logits[:, -1]

    @torch.inference_mode()
    def feed(self, seqs: list, tokens: list[list[int]], checkpoints: bool = False,
             floors: list[int] | None = None) -> torch.Tensor:
        """Feed each sequence the same number T of tokens on top of its cache (every sequence from position 0: a
        prefill) in one forward; returns logits [B, T, vocab]. Speculative decoding's steps: with checkpoints the
        caches remember enough to roll each sequence back (rollback) to any length from its floor on (default: its
        length after the step's first token), and the prefix caches are told of full blocks only after that."""
        t = len(tokens[0])
        starts = [s.num_cached for s in seqs]
        step = "prefill" if not any(starts) else "decode" if t == 1 else "chunk"
        positions = torch.tensor([range(start, start + t) for start in starts], device=self.device)
        batch = self.cache_batch(seqs, positions, [start + t for start in starts], step, floors)
        batch.checkpoints = checkpoints
        logits = self.model(torch.tensor(tokens, device=self.device), positions, self.pool.layers, batch)
        for s in seqs:
            s.num_cached += t
        if not checkpoints:
            self.name_full_blocks(seqs)
        return logits

    def rollback(self, seqs: list, lengths: list[int]) -> None:
        """Keep the first `length` tokens of each sequence's cache (at least its floor in the checkpointed steps
        since forget_steps): blocks past them go back, state and ring rows return to their values there; then
        offer its full blocks, now final, to the prefix caches."""
        for manager in self.block_managers:
            for s, n in zip(seqs, lengths):
                manager.truncate(s, n)
        self.pool.rollback({s.slot: n for s, n in zip(seqs, lengths)})
        for s, n in zip(seqs, lengths):
            s.num_cached = n
        self.name_full_blocks(seqs)

    def name_full_blocks(self, seqs: list[Sequence]) -> None:
        """Once a forward has written them: offer the sequences' newly filled blocks to the prefix caches."""
        for manager in self.block_managers:
            for s in seqs:
                manager.name_full_blocks(s)

    def cache_batch(self, seqs: list[Sequence], positions: torch.Tensor, lengths: list[int], step: str,
                    floors: list[int] | None = None) -> CacheBatch:
        slots = [s.slot for s in seqs]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        batch = CacheBatch(
            positions=positions,
            lengths=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            max_length=self.max_seq_len if self.compile_decode and step == "decode" else max(lengths),
            step=step,
            slots=torch.tensor(slots, device=self.device),
            slot_range=slice(slots[0], slots[0] + len(slots)) if consecutive else None,
        )
        # a step on top of the cache reads its keys there: keep what its first query sees (prefill: none), or what
        # the shortest length a speculative rollback may return to sees
        firsts = floors or [s.num_cached + 1 if s.num_cached else None for s in seqs]
        tables, mappings = [], []
        for group, manager in enumerate(self.block_managers):
            for s, n, first in zip(seqs, lengths, firsts):
                manager.grow(s, n, first)
            if manager.copies:  # copy-on-write: a shared block this step writes into, copied before the write
                self.pool.copy_blocks(group, manager.copies)
                manager.copies = []
            rows = [manager.tables[s.request_id] for s in seqs]
            width = manager.blocks_for(self.max_seq_len) if self.compile_decode else max(map(len, rows))
            tables.append(torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32, device=self.device))
            mapping = [manager.slot(s, p, first or n)
                       for s, n, first, row in zip(seqs, lengths, firsts, positions.tolist()) for p in row]
            mappings.append(torch.tensor(mapping, dtype=torch.int64, device=self.device))
        batch.block_tables, batch.slot_mappings = tuple(tables), tuple(mappings)
        return batch
