"""One speculative decoding step for the engine's running requests: a proposer offers up to k tokens per request,
the target scores each request's newest token and its proposals in one batched forward (a checkpointed "chunk"
step through its cache), the acceptance rule keeps a prefix per request, and every cache goes back to the tokens
kept: paged blocks past them return to the pool, recurrent states and ring-buffer rows return to their values
there (cache.CacheBatch.checkpoints)."""
import time
from dataclasses import asdict, dataclass

from harness.engine.model_runner import ModelRunner
from harness.engine.sequence import Sequence
from harness.engine.speculative.config import PROMPT_LOOKUP, SpeculativeConfig
from harness.engine.speculative.proposers import DraftModel, PromptLookup
from harness.engine.speculative.rejection import verify


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
        if config.draft == PROMPT_LOOKUP:
            self.proposer = PromptLookup(config.prompt_lookup_max, config.prompt_lookup_min)
        else:
            self.proposer = DraftModel(config.draft, kv_cache, max_batch, cache_len, block_size, self.k)
        self.stats = SpeculativeStats()

    def step(self, seqs: list[Sequence]) -> list[tuple[list[int], list, Exception | None]]:
        """Each request's tokens to emit (its accepted proposals, then the target's own token), the target's logits
        each came from, and the error if its verdict failed (non-finite logits): that request alone fails."""
        # no proposal whose acceptance would run past max_new_tokens with the target's token after it
        limits = [min(self.k, seq.params.max_new_tokens - len(seq.output_ids) - 1) for seq in seqs]
        start = time.perf_counter()
        proposals = self.proposer.propose(seqs, limits)
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
        self.stats.steps += 1
        self.stats.sequence_steps += len(seqs)
        self.stats.proposed += sum(len(p.tokens) for p in proposals)
        self.stats.draft_seconds += drafted - start
        self.stats.target_seconds += time.perf_counter() - drafted
        return verdicts

    def keep(self, seqs: list[Sequence]) -> None:
        """After the engine appended the emitted tokens: each request still running keeps its cache up to its newest
        token (uncached, as always), in the target and in the proposer."""
        lengths = [len(seq.all_ids) - 1 for seq in seqs]
        self.runner.rollback(seqs, lengths)
        self.proposer.keep(seqs, lengths)
