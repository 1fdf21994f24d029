"""Turns scheduled sequences into model calls: builds each step's CacheBatch and runs prefill or batched decode."""
import torch

from cache import CacheBatch, TreeBatch
from harness.engine.block_manager import BlockManager
from harness.engine.cache_pool import CachePool
from harness.engine.decode_graphs import DecodeGraphs, StepRows
from harness.engine.sequence import Sequence
from kernels import cpu_memory
from zoo.decode_plan import DecodePlans
from zoo.resources import memory_limit


def place_weights(model) -> str:
    """Move a CPU model's parameters and buffers into 2 MiB pages (kernels/cpu_memory.py), each tensor in place, where
    the kernel grants such pages, they fill at least one, and the memory free holds a second copy while they move.
    Returns "" once they lie there, else why they stay."""
    off = cpu_memory.huge_pages_off()
    if off:
        return off
    tensors = cpu_memory.movable(model)
    needed = cpu_memory.placed_bytes(tensors)
    if not tensors:
        return "nothing left to move (placed by an earlier engine, or every tensor a view or in shared memory)"
    if needed < cpu_memory.HUGE_PAGE:  # nothing to gain: a step's weights this small stay in the caches
        return f"the weights take {needed:,} B, less than one 2 MiB page"
    limit, source = memory_limit("cpu")
    if needed > limit:
        return f"moving the weights needs {needed:,} B beside them, more than {source} ({limit:,} B)"
    cpu_memory.place_on_huge_pages(tensors)
    return ""


class ModelRunner:
    def __init__(self, model, pool: CachePool, block_managers: list[BlockManager], device, max_seq_len: int,
                 compile_decode: bool = False, graph_mode: str | None = None):
        """graph_mode: None runs the decode step as it comes; "capture" replays it from a CUDA graph per batch-size
        bucket, "static" runs the same padded step on the same buffers eagerly (harness/engine/decode_graphs.py)."""
        self.model = model
        # a CPU decode step reads every weight each step, and reads them faster from 2 MiB pages: "" once they lie there
        self.huge_pages_off = place_weights(model) if torch.device(device).type == "cpu" else "not a CPU model"
        self.pool = pool
        self.block_managers = block_managers
        self.device = device
        self.max_seq_len = max_seq_len
        # A compiled or captured step needs fixed shapes: attend over the whole cache (masked) instead of the longest
        # sequence, with block tables as wide as max_seq_len needs.
        self.fixed_shapes = compile_decode or graph_mode is not None
        # No weight freezing: oneDNN's pre-packed linears measured no faster than the eager GEMMs on CPU (gqa base,
        # batch 1 and 16, fp32 and bf16), and a frozen step would keep the weights it was compiled with.
        self.decode_forward = torch.compile(model, dynamic=False) if compile_decode else model
        self.decode_plans = DecodePlans()  # an eager CPU step's blocks in one call, decided once (zoo/decode_plan.py)
        self.graphs = None if graph_mode is None else DecodeGraphs(
            self.decode_forward, pool.layers, pool.max_batch, max_seq_len,
            [manager.blocks_for(max_seq_len) for manager in block_managers], pool.spare_slot, pool.spare_blocks,
            pool.block_size, device, graph_mode)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Feed each sequence the next n tokens of its prefill_ids (the prompt; for a preempted request also its
        tokens so far) in one forward: all from position 0 (a prefill) or all on top of their caches (a chunk), each
        row right-padded to the longest (padding is neither cached nor folded into a state). Returns each row's
        logits at its last real token [B, vocab]."""
        seqs = [seq for seq, _ in chunks]
        width = max(n for _, n in chunks)
        starts = [seq.num_cached for seq in seqs]
        tokens = torch.tensor([seq.prefill_ids[start:start + n] + [0] * (width - n)
                               for (seq, n), start in zip(chunks, starts)], device=self.device)
        positions = [list(range(start, start + width)) for start in starts]
        step = "prefill" if not any(starts) else "chunk" if width > 1 else "decode"
        batch = self.cache_batch(seqs, positions, [start + n for (_, n), start in zip(chunks, starts)], step)
        batch.padded = any(n < width for _, n in chunks)
        logits = self.model(tokens, batch.positions, self.pool.layers, batch, last_only=True)
        for seq, n in chunks:
            seq.num_cached += n
        self.name_full_blocks(seqs)
        return logits[:, -1]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; returns logits [B, vocab]."""
        tokens = [s.output_ids[-1] for s in seqs]
        positions = [[s.num_cached] for s in seqs]
        lengths = [s.num_cached + 1 for s in seqs]
        if self.graphs is not None:
            tables, mappings = self.layout(seqs, positions, lengths)
            logits = self.graphs.run(StepRows(tokens, [p for p, in positions], lengths, [s.slot for s in seqs],
                                              tables, mappings))
        else:
            batch = self.cache_batch(seqs, positions, lengths, step="decode")
            batch.decode_plans = None if self.fixed_shapes else self.decode_plans
            logits = self.decode_forward(torch.tensor([[t] for t in tokens], device=self.device), batch.positions,
                                         self.pool.layers, batch)[:, -1]
        for s in seqs:
            s.num_cached += 1
        self.name_full_blocks(seqs)
        return logits

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
        positions = [list(range(start, start + t)) for start in starts]
        batch = self.cache_batch(seqs, positions, [start + t for start in starts], step, floors)
        batch.checkpoints = checkpoints
        logits = self.model(torch.tensor(tokens, device=self.device), batch.positions, self.pool.layers, batch)
        for s in seqs:
            s.num_cached += t
        if not checkpoints:
            self.name_full_blocks(seqs)
        return logits

    @torch.inference_mode()
    def feed_tree(self, seqs: list, trees: list) -> torch.Tensor:
        """Feed each sequence a token tree (speculative.TokenTree, its root the sequence's newest token) on top of its
        cache in one forward, every tree padded to the widest with leaves under the root; returns logits [B, T,
        vocab], row t the target's at node t. The nodes take physical rows num_cached .. + T - 1 (checkpointed: a
        rollback keeps any prefix), each seeing only its own path (cache.TreeBatch); move_path then brings the
        accepted nodes' rows down to consecutive positions before the rollback."""
        width = max(map(len, trees))
        starts = [s.num_cached for s in seqs]
        tokens, logical, ancestors = [], [], []
        for tree, start in zip(trees, starts):
            pad = width - len(tree)
            tokens.append(tree.tokens + [0] * pad)
            logical.append([start + depth for depth in tree.depths()] + [start + 1] * pad)
            mask = torch.eye(width, dtype=torch.bool)
            mask[:len(tree), :len(tree)] = tree.ancestors()
            mask[len(tree):, 0] = True  # a pad node hangs under the root
            ancestors.append(mask)
        positions = [list(range(start, start + width)) for start in starts]
        batch = self.cache_batch(seqs, positions, [start + width for start in starts], "chunk")
        batch.checkpoints = True
        batch.tree = TreeBatch(torch.tensor(logical, device=self.device), torch.stack(ancestors).to(self.device))
        logits = self.model(torch.tensor(tokens, device=self.device), batch.tree.logical, self.pool.layers, batch)
        for s in seqs:
            s.num_cached += width
        return logits

    def move_path(self, seqs: list, starts: list[int], paths: list[list[int]]) -> None:
        """After feed_tree: sequence i's accepted nodes paths[i] (tree indices, root's child first) move from their
        physical rows starts[i] + node to starts[i] + 1, + 2, ... in every cache layer (starts[i]: the root's row).
        A node's index is at least its depth, so no destination is a later move's source."""
        moves = [(s, start + node, start + depth) for s, start, path in zip(seqs, starts, paths)
                 for depth, node in enumerate(path, 1) if node != depth]
        if not moves:
            return
        kept = {seq.request_id: start + 1 + len(path) for seq, start, path in zip(seqs, starts, paths)}
        if self.pool.layout == "contiguous":  # no block managers: a sequence's rows are its slot's, a ring's wrap
            slots = torch.tensor([seq.slot for seq, _, _ in moves], device=self.device)
            positions = [torch.tensor([move[column] for move in moves], device=self.device) for column in (1, 2)]
            for group, cache_group in enumerate(self.pool.groups):
                rows = [cache_group.retention.row(p) for p in positions]
                self.pool.move_rows(group, *[(slots, slice(None), r) for r in rows])
            return
        for group, manager in enumerate(self.block_managers):
            flat = [torch.tensor([manager.slot(seq, move[column], kept[seq.request_id]) for seq, *move in moves],
                                 device=self.device) for column in (0, 1)]
            self.pool.move_rows(group, *[(f // manager.block_size, f % manager.block_size) for f in flat])

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

    def cache_batch(self, seqs: list[Sequence], positions: list[list[int]], lengths: list[int], step: str,
                    floors: list[int] | None = None) -> CacheBatch:
        """The step's CacheBatch: positions [B][T] of its new tokens, lengths [B] after it."""
        slots = [s.slot for s in seqs]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        fixed = self.fixed_shapes and step == "decode"
        batch = CacheBatch(
            positions=torch.tensor(positions, device=self.device),
            lengths=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            max_length=self.max_seq_len if fixed else max(lengths),
            step=step,
            slots=torch.tensor(slots, device=self.device),
            slot_range=slice(slots[0], slots[0] + len(slots)) if consecutive else None,
        )
        tables, mappings = self.layout(seqs, positions, lengths, floors)
        widths = [manager.blocks_for(self.max_seq_len) if fixed else max(map(len, rows))
                  for manager, rows in zip(self.block_managers, tables)]
        batch.block_tables = tuple(torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32,
                                                device=self.device) for rows, width in zip(tables, widths))
        batch.slot_mappings = tuple(torch.tensor(mapping, dtype=torch.int64, device=self.device) for mapping in mappings)
        return batch

    def layout(self, seqs: list[Sequence], positions: list[list[int]], lengths: list[int],
               floors: list[int] | None = None) -> tuple[list[list[list[int]]], list[list[int]]]:
        """Grow each cache group's block tables to the step's lengths (copying shared blocks it writes into first);
        returns per group each sequence's block table and the flat pool slot of each new token (-1: not written)."""
        tables, mappings = [], []
        for group, manager in enumerate(self.block_managers):
            # a step on top of the cache reads its keys there: keep what its first query sees (see first_length), or
            # what the shortest length a speculative rollback may return to sees
            firsts = floors or [manager.first_length(s.num_cached) for s in seqs]
            for s, n, first in zip(seqs, lengths, firsts):
                manager.grow(s, n, first)
            if manager.copies:  # copy-on-write: a shared block this step writes into, copied before the write
                self.pool.copy_blocks(group, manager.copies)
                manager.copies = []
            tables.append([manager.tables[s.request_id] for s in seqs])
            mappings.append([manager.slot(s, p, first or n) if p < n else -1  # padding is not written
                             for s, n, first, row in zip(seqs, lengths, firsts, positions) for p in row])
        return tables, mappings


PADDING_WASTE = 0.25  # a batched prefill pads its rows to the longest: at most this share of its tokens is padding
# Rows enough to fill a matrix multiply: past this, batching only makes the first requests wait for the others (a
# 1024-token gqa small prefill is compute-bound on 2 CPU cores: four batched took 1633 ms mean TTFT, against about
# 975 one after another, for the same total)
BATCH_TOKENS = 512


def prefill_batches(chunks: list[tuple[Sequence, int]]) -> list[list[tuple[Sequence, int]]]:
    """The step's prefill work as forwards: requests starting from nothing batched with others of similar length (the
    padding under PADDING_WASTE of a batch, its padded tokens under BATCH_TOKENS unless one row alone is longer),
    longest first; a chunk continuing from a cache alone, so a failed forward never leaves another request's
    recurrent state half-updated."""
    fresh = sorted((c for c in chunks if not c[0].num_cached), key=lambda c: -c[1])
    batches: list[list[tuple[Sequence, int]]] = [[c] for c in chunks if c[0].num_cached]
    for chunk in fresh:
        group = batches[-1] if batches and not batches[-1][0][0].num_cached else None
        width, rows = (group[0][1], len(group) + 1) if group else (0, 1)
        if group and width * rows <= min(BATCH_TOKENS, (1 + PADDING_WASTE) * (sum(n for _, n in group) + chunk[1])):
            group.append(chunk)
        else:
            batches.append([chunk])
    return batches
