"""Lookahead decoding without a draft model (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"), in a one-row form: the target's own Jacobi iteration makes n-grams, a pool keeps them, and
the step's forward verifies the pool's continuations of the newest token.

Each request keeps a window: k guessed tokens for the positions after its newest token, each with its lineage, the
tokens that led to it (a guess was the target's argmax right after the token before it in its lineage). A step
feeds the window as the tree's first branch and, with branches > 1, up to branches - 1 of the pool's latest
continuations of the newest token as the others; the target verifies them all in its one forward (or, where it
verifies chains only, the pool's latest continuation, else the window). That forward is also the Jacobi iteration:
the target's argmax after each token of the first branch is a new guess for the position after it, and each guess
extended by its token's lineage is an n-gram whose every token followed the one before it, which joins the pool
(as do the request's text's own n-grams). The next window is the guesses past the accepted tokens. The paper keeps
N - 1 past iterations of a W-wide window in the forward; here the lineages carry the past iterations instead.
Proposals are deterministic, so verification is exact for sampled requests too.
"""
from dataclasses import dataclass, field

import torch

from harness.engine.sampling import processed_logits
from harness.engine.sequence import Sequence
from harness.engine.speculative.proposers import Proposal

POOL_PER_TOKEN = 8  # continuations the pool keeps per first token, the newest: a bound on its memory and lookups


@dataclass
class Trajectory:
    """One request's Jacobi window (tokens and lineages), n-gram pool, and what its last step fed first."""

    window: list[int] = field(default_factory=list)
    lineages: list[list[int]] = field(default_factory=list)
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    seen: int = 0  # tokens of the request's text already added to the pool
    fed: list[list[int]] = field(default_factory=list)  # the first branch's lineages, the root's first


class Lookahead:
    def __init__(self, k: int):
        self.k = k
        self.requests: dict[int, Trajectory] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        return [chains[0] for chains in self.propose_chains(seqs, limits, 1)]

    def propose_chains(self, seqs: list[Sequence], limits: list[int], branches: int) -> list[list[Proposal]]:
        """Per request: the window first, then up to branches - 1 pool continuations of the newest token (one
        branch: the latest continuation in the window's place, where there is one), each cut to the limit."""
        live = {seq.request_id for seq in seqs}
        for request_id in set(self.requests) - live:  # ended, or preempted and readmitted as new text
            del self.requests[request_id]
        out = []
        for seq, limit in zip(seqs, limits):
            trajectory = self.trajectory(seq)
            root = seq.all_ids[-1]
            known = [list(c) for c in reversed(trajectory.pool.get(root, []))]
            if branches == 1 and known:
                first, lineages = known[0], [[root, *known[0][:i + 1]] for i in range(len(known[0]))]
            else:
                first, lineages = trajectory.window, trajectory.lineages
            first = first[:limit]
            trajectory.fed = [[root], *lineages[:len(first)]]
            others = [c[:limit] for c in known if c[:limit] and c[:limit] != first][:branches - 1]
            out.append([Proposal(chain, None) for chain in [first, *others]])
        return out

    def trajectory(self, seq: Sequence) -> Trajectory:
        """The request's trajectory, its pool brought up to its text; a new request's window is its newest token's
        latest continuation in the pool, else its last k tokens."""
        trajectory = self.requests.setdefault(seq.request_id, Trajectory())
        ids = seq.all_ids
        add_ngrams(trajectory.pool, ids[max(0, trajectory.seen - self.k):], self.k)
        trajectory.seen = len(ids)
        if not trajectory.window:
            known = trajectory.pool.get(ids[-1])
            trajectory.window = list(known[-1]) if known else (ids[-self.k:] * self.k)[:self.k]
            trajectory.lineages = [[token] for token in trajectory.window]
        return trajectory

    def observe(self, seqs: list[Sequence], logits: list[torch.Tensor], accepted: list[int]) -> None:
        """After a verification: logits[i] the target's at request i's root and each token of the first branch it
        fed, accepted[i] the proposals it accepted (-1: its verdict failed). Each guess with its token's lineage
        joins the pool; the window becomes the guesses past the accepted tokens, topped up from the pool."""
        for seq, rows, kept in zip(seqs, logits, accepted):
            trajectory = self.requests.get(seq.request_id)
            if trajectory is None or kept < 0:
                continue
            guesses = [int(processed_logits(row, seq.params, seq.all_ids).argmax()) for row in rows]
            lineages = [(lineage + [guess])[-(self.k + 1):] for lineage, guess in zip(trajectory.fed, guesses)]
            for lineage in lineages:
                add_ngrams(trajectory.pool, lineage, len(lineage) - 1)
            window, lineages = guesses[kept + 1:], lineages[kept + 1:]
            while len(window) < self.k:  # top up: the pool's continuation of the last guess, else repeat it
                last = window[-1] if window else guesses[-1]
                known = trajectory.pool.get(last)
                extra = list(known[-1]) if known else [last]
                lineages += [[last, *extra[:i + 1]] for i in range(len(extra))]
                window += extra
            trajectory.window, trajectory.lineages = window[:self.k], lineages[:self.k]

    def keep(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """Nothing cached to roll back: the windows already follow the verdicts."""


def add_ngrams(pool: dict[int, list[tuple[int, ...]]], tokens: list[int], k: int) -> None:
    """Each token of `tokens` with the k after it, where there are k (k >= 1), as the pool's newest continuation of
    that token (moved to newest if already there), POOL_PER_TOKEN kept per token."""
    if k < 1:
        return
    for i in range(len(tokens) - k):
        key, continuation = tokens[i], tuple(tokens[i + 1:i + 1 + k])
        known = pool.setdefault(key, [])
        if continuation in known:
            known.remove(continuation)
        known.append(continuation)
        del known[:-POOL_PER_TOKEN]
