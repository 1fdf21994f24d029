"""One speculative decoding step for the engine's running requests: a proposer offers up to k tokens per request,
the target scores each request's newest token and its proposals in one batched forward (a checkpointed "chunk"
step through its cache), the acceptance rule keeps a prefix per request, and every cache goes back to the tokens
kept: paged blocks past them return to the pool, recurrent states and ring-buffer rows return to their values
there (cache.CacheBatch.checkpoints).

With several chains (speculative.tree) the proposals are one token tree per request, scored in one forward in which
each node sees only its own path (ModelRunner.feed_tree), verified by SpecInfer's rule (verify_tree); the accepted
path's cache rows then move down to consecutive positions (move_path) before the same rollback."""
import time
from dataclasses import asdict, dataclass

from harness.engine.model_runner import ModelRunner
from harness.engine.sequence import Sequence
from harness.engine.speculative.config import LOOKAHEAD, PROMPT_LOOKUP, SpeculativeConfig
from harness.engine.speculative.lookahead import Lookahead
from harness.engine.speculative.proposers import DraftModel, PromptLookup
from harness.engine.speculative.rejection import verify
from harness.engine.speculative.tree import TokenTree, tree_blocker, verify_tree


@dataclass
class SpeculativeStats:
    """Totals over the engine's speculative steps (vLLM's spec-decode metrics, with times)."""

    steps: int = 0  # target verifications: one forward each
    sequence_steps: int = 0  # the requests verified, summed over steps
    proposed: int = 0  # tokens proposed (and verified)
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens the requests gained: the accepted ones plus one from the target per request and step
    draft_seconds: float = 0.0  # proposing
    target_seconds: float = 0.0  # verifying: the target's forward and the acceptance rule
    tree_fallback: str = ""  # why several chains were asked for but the target verifies one ("" otherwise)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens a request gains per target forward (1 without speculation)."""
        return self.emitted / self.sequence_steps if self.sequence_steps else 0.0

    def summary(self) -> dict:
        per_step = 1000 / self.steps if self.steps else 0.0
        return {**asdict(self), "acceptance_rate": self.acceptance_rate, "tokens_per_forward": self.tokens_per_forward,
                "draft_ms_per_step": self.draft_seconds * per_step, "target_ms_per_step": self.target_seconds * per_step}


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, kv_cache: str, max_batch: int, cache_len: int,
                 block_size: int):
        self.k = config.num_speculative_tokens
        self.runner = runner
        blocker = tree_blocker(runner.model) if config.tree else ""
        self.stats = SpeculativeStats(tree_fallback=blocker)
        self.tree = config.tree and not blocker
        self.branches = config.branches if self.tree else 1
        self.budget = config.tree_budget if self.tree else None
        lookahead = config.draft_lookahead if self.tree else self.k
        self.proposers = [self.proposer(draft, config, kv_cache, max_batch, cache_len, block_size, lookahead)
                          for draft in (config.drafts if self.tree else config.drafts[:1])]

    def proposer(self, draft, config: SpeculativeConfig, kv_cache: str, max_batch: int, cache_len: int,
                 block_size: int, lookahead: int):
        if draft == PROMPT_LOOKUP:
            return PromptLookup(config.prompt_lookup_max, config.prompt_lookup_min)
        if draft == LOOKAHEAD:
            return Lookahead(self.k)
        return DraftModel(draft, kv_cache, max_batch, config.draft_cache_len(cache_len), block_size, lookahead)

    def step(self, seqs: list[Sequence]) -> list[tuple[list[int], list, Exception | None]]:
        """Each request's tokens to emit (its accepted proposals, then the target's own token), the target's logits
        each came from, and the error if its verdict failed (non-finite logits): that request alone fails."""
        # no proposal whose acceptance would run past max_new_tokens with the target's token after it
        limits = [min(self.k, seq.params.max_new_tokens - len(seq.output_ids) - 1) for seq in seqs]
        if self.tree:
            return self.tree_step(seqs, limits)
        start = time.perf_counter()
        proposals = self.proposers[0].propose(seqs, limits)
        drafted = time.perf_counter()
        width = 1 + max(len(p.tokens) for p in proposals)
        # a shorter proposal is padded: the rule never reads past it, and the rollback drops what the pad wrote
        inputs = [[seq.output_ids[-1], *p.tokens] + [0] * (width - 1 - len(p.tokens)) for seq, p in zip(seqs, proposals)]
        self.runner.pool.forget_steps()
        logits = self.runner.feed(seqs, inputs, checkpoints=True)
        verdicts = []
        for seq, proposal, rows in zip(seqs, proposals, logits):
            try:
                tokens = verify(rows, proposal.tokens, proposal.probs, seq.params, seq.all_ids, seq.generator)
            except Exception as error:  # noqa: BLE001 - a failing request must not take the batch with it
                verdicts.append(([], [], error))
                continue
            verdicts.append((tokens, list(rows[:len(tokens)]), None))
            self.stats.accepted += len(tokens) - 1
            self.stats.emitted += len(tokens)
        self.observe(seqs, [rows[:1 + len(p.tokens)] for rows, p in zip(logits, proposals)], verdicts)
        self.stats.steps += 1
        self.stats.sequence_steps += len(seqs)
        self.stats.proposed += sum(len(p.tokens) for p in proposals)
        self.stats.draft_seconds += drafted - start
        self.stats.target_seconds += time.perf_counter() - drafted
        return verdicts

    def tree_step(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[list[int], list, Exception | None]]:
        """step for token trees: every proposer's chains hang from each request's newest token."""
        start = time.perf_counter()
        firsts = [0] * len(seqs)  # each tree's first chain's length: a lookahead window's nodes, 1 .. that
        if self.budget is not None:
            trees = self.proposers[0].propose_tree(seqs, limits, self.budget, self.branches)
        else:
            chains: list[list] = [[] for _ in seqs]
            for proposer in self.proposers:
                for mine, proposals in zip(chains, proposer.propose_chains(seqs, limits, self.branches)):
                    mine.extend((p.tokens, p.probs) for p in proposals if p.tokens)
            firsts = [len(mine[0][0]) if mine else 0 for mine in chains]
            trees = [TokenTree.from_chains(seq.all_ids[-1], mine) for seq, mine in zip(seqs, chains)]
        drafted = time.perf_counter()
        starts = [seq.num_cached for seq in seqs]
        self.runner.pool.forget_steps()
        logits = self.runner.feed_tree(seqs, trees)
        verdicts, paths = [], []
        for seq, tree, rows in zip(seqs, trees, logits):
            try:
                path, tokens = verify_tree(rows, tree, seq.params, seq.all_ids, seq.generator)
            except Exception as error:  # noqa: BLE001 - a failing request must not take the batch with it
                verdicts.append(([], [], error))
                paths.append([])
                continue
            verdicts.append((tokens, [rows[node] for node in [0, *path]][:len(tokens)], None))
            paths.append(path)
            self.stats.accepted += len(path)
            self.stats.emitted += len(tokens)
        self.runner.move_path(seqs, starts, paths)
        self.observe(seqs, [rows[:1 + first] for rows, first in zip(logits, firsts)], verdicts)
        self.stats.steps += 1
        self.stats.sequence_steps += len(seqs)
        self.stats.proposed += sum(len(tree) - 1 for tree in trees)
        self.stats.draft_seconds += drafted - start
        self.stats.target_seconds += time.perf_counter() - drafted
        return verdicts

    def observe(self, seqs: list[Sequence], rows: list, verdicts: list) -> None:
        """A proposer that learns from the target's forward (lookahead's Jacobi window) sees each request's logits at
        its root and first chain, and how many proposals the request accepted (-1: its verdict failed)."""
        for proposer in self.proposers:
            if hasattr(proposer, "observe"):
                proposer.observe(seqs, rows, [len(tokens) - 1 if error is None else -1
                                              for tokens, _, error in verdicts])

    def keep(self, seqs: list[Sequence]) -> None:
        """After the engine appended the emitted tokens: each request still running keeps its cache up to its newest
        token (uncached, as always), in the target and in the proposers."""
        lengths = [len(seq.all_ids) - 1 for seq in seqs]
        self.runner.rollback(seqs, lengths)
        for proposer in self.proposers:
            proposer.keep(seqs, lengths)
