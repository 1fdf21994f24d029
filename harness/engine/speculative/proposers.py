"""Who proposes the tokens a target verifies: a draft model with caches of its own, or prompt lookup (no model)."""
from dataclasses import dataclass

import torch

from harness.engine.block_manager import BlockManager
from harness.engine.cache_pool import CachePool, size_cache
from harness.engine.model_runner import ModelRunner
from harness.engine.sampling import processed_logits, token_distribution
from harness.engine.sequence import Sequence
from harness.engine.speculative.tree import TokenTree


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V]: the distribution each token was drawn from; None: deterministic


class PromptLookup:
    """The tokens that followed the latest earlier occurrence of the context's last n tokens, n from `longest` down
    to `shortest` (Saxena 2023's prompt lookup decoding; vLLM's ngram proposer): free, and right wherever the output
    repeats its context (code edits, quoting, lists)."""

    def __init__(self, longest: int, shortest: int):
        self.longest, self.shortest = longest, shortest

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        return [chains[0] for chains in self.propose_chains(seqs, limits, 1)]

    def propose_chains(self, seqs: list[Sequence], limits: list[int], branches: int) -> list[list[Proposal]]:
        """Per request, up to `branches` distinct continuations (fewer where fewer matches differ), the longest
        n-gram's latest match first."""
        return [[Proposal(chain, None) for chain in self.lookups(seq.all_ids, limit, branches)] or [Proposal([], None)]
                for seq, limit in zip(seqs, limits)]

    def lookup(self, ids: list[int], limit: int) -> list[int]:
        """The continuation of the latest match of the longest n-gram that has one (empty: none)."""
        found = self.lookups(ids, limit, 1)
        return found[0] if found else []

    def lookups(self, ids: list[int], limit: int, count: int) -> list[list[int]]:
        """Up to `count` distinct continuations, the longest n-gram's matches first, each n's latest first."""
        if limit < 1:
            return []
        context = torch.tensor(ids)
        found: list[list[int]] = []
        for n in range(min(self.longest, len(ids) - 1), self.shortest - 1, -1):
            # every earlier n-gram (the last one, which is the pattern itself, left out) against the last n tokens
            hits = (context[:-1].unfold(0, n, 1) == context[-n:]).all(1).nonzero()
            for hit in reversed(hits[:, 0].tolist()):  # latest first
                chain = ids[hit + n:hit + n + limit]
                if chain and chain not in found:
                    found.append(chain)
                    if len(found) == count:
                        return found
        return found

    def keep(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """Nothing to roll back: the proposer keeps no state."""


class DraftModel:
    """A draft model run beside the target: a cache of its own in the target's layout, one draft sequence per running
    request (same id and batch slot), kept level with the request's tokens. Each step it feeds what it has not seen
    (a new request's context; after all k proposals passed, the last of them), then the request's newest token and
    k - 1 proposals, one checkpointed decode step each, so the target's verdict can roll it back to any of them.
    lookahead: the most tokens it writes past a request's newest one in a step (k, or a budget tree's candidates)."""

    def __init__(self, model, kv_cache: str, max_batch: int, cache_len: int, block_size: int, lookahead: int):
        param = next(model.parameters())
        specs = model.cache_specs()
        self.lookahead = lookahead
        # room for every slot's worst case, so a draft never waits for blocks (it is small beside its target)
        _, num_blocks = size_cache(specs, param.dtype, kv_cache, max_batch, cache_len, block_size, None, None,
                                   lookahead + 1)
        self.pool = CachePool(specs, kv_cache, max_batch, cache_len, block_size, num_blocks, param.dtype, param.device)
        self.managers = [BlockManager(n, block_size, group.retention, "reserve", step_tokens=lookahead + 1)
                         for n, group in zip(num_blocks, self.pool.groups)]
        self.runner = ModelRunner(model.eval(), self.pool, self.managers, param.device, cache_len)
        self.seqs: dict[int, tuple[Sequence, int]] = {}  # request id -> its draft sequence, the request's preemptions

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Proposal]:
        """One chain per request; the draft keeps it in its cache (the target's verdict rolls it back)."""
        return [chains[0] for chains in self.propose_chains(seqs, limits, 1, keep=True)]

    def propose_chains(self, seqs: list[Sequence], limits: list[int], branches: int,
                       keep: bool = False) -> list[list[Proposal]]:
        """Per request, `branches` chains: the b-th starts from the draft's b-th most likely token (the first from
        its own draw), each continued as the draft samples. Between chains, and after them unless keep, the draft
        goes back to the request's newest token."""
        drafts = self.level(seqs)
        self.pool.forget_steps()
        self.catch_up(seqs, drafts)
        floors = [len(seq.all_ids) for seq in seqs]  # the newest token stays: rollback never goes below it
        first = self.runner.feed(drafts, [[seq.all_ids[-1]] for seq in seqs], checkpoints=True, floors=floors)[:, -1]
        chains = []
        for rank in range(branches):
            if rank:
                self.runner.rollback(drafts, floors)
            chains.append(self.chain(seqs, drafts, floors, first, limits, rank))
        if not keep:
            self.runner.rollback(drafts, floors)
        return [list(mine) for mine in zip(*chains)]

    def chain(self, seqs, drafts, floors, first: torch.Tensor, limits: list[int], rank: int) -> list[Proposal]:
        """Each request's chain from the draft's logits after its newest token (first): its first token the rank-th
        most likely (rank 0: drawn as any other), then each drawn from the logits after the one before."""
        proposed: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        logits = first
        for i in range(max(limits)):
            if i:  # each proposal but the last is fed (the last was drawn from the logits fed last)
                logits = self.runner.feed(drafts, [[mine[-1]] for mine in proposed], checkpoints=True,
                                          floors=floors)[:, -1]
            for seq, row, limit, mine, my_probs in zip(seqs, logits, limits, proposed, probs):
                history = seq.all_ids + mine
                if i == 0 and rank:  # a deterministic proposal: a q with all its mass on its token
                    mine.append(int(processed_logits(row, seq.params, history).topk(rank + 1).indices[-1]))
                    if not seq.params.greedy:
                        my_probs.append(torch.nn.functional.one_hot(torch.tensor(mine[-1]), len(row)).to(row))
                elif seq.params.greedy or i >= limit:  # past its limit a token is a placeholder: no randomness spent
                    mine.append(int(processed_logits(row, seq.params, history).argmax()))
                else:
                    q = token_distribution(row, seq.params, history)
                    mine.append(int(torch.multinomial(q, 1, generator=seq.generator)))
                    my_probs.append(q)
        return [Proposal(mine[:limit], torch.stack(my_probs[:limit]) if my_probs[:limit] else None)
                for mine, my_probs, limit in zip(proposed, probs, limits)]

    def propose_tree(self, seqs: list[Sequence], limits: list[int], budget: int, branches: int) -> list[TokenTree]:
        """Per request, a tree of at most `budget` proposed tokens grown by the draft's probabilities (EAGLE-2):
        depth by depth (up to the request's limit), the `branches` likeliest nodes of the depth before each offer
        their `branches` likeliest tokens, scored by the log-probability of their whole path; then the `budget`
        likeliest nodes stay (a path's score only falls as it grows, so each kept node's parent is kept). Every
        proposal is deterministic (no q): the rule tests it against the target's own probability of it. The draft
        scores each depth's tree in one forward (feed_tree) and rolls it back after."""
        drafts = self.level(seqs)
        self.pool.forget_steps()
        self.catch_up(seqs, drafts)
        bases = [len(seq.all_ids) - 1 for seq in seqs]  # the newest token is each tree's root, fed with it
        grown = [([seq.all_ids[-1]], [-1], [0.0]) for seq in seqs]  # tokens, parents, path log-probabilities
        frontier = [[0] for _ in seqs]
        for depth in range(max(limits)):
            logits = self.runner.feed_tree(drafts, [TokenTree(tokens, parents) for tokens, parents, _ in grown])
            self.runner.rollback(drafts, bases)
            for seq, rows, limit, (tokens, parents, scores), mine in zip(seqs, logits, limits, grown, frontier):
                if depth >= limit:
                    mine.clear()
                    continue
                offers = []
                for node in mine:
                    path = TokenTree(tokens, parents).path(node)
                    history = seq.all_ids + [tokens[n] for n in path]
                    logp = torch.log_softmax(processed_logits(rows[node], seq.params, history).float(), dim=-1)
                    top = logp.topk(min(branches, len(logp)))
                    offers += [(scores[node] + float(lp), node, int(token)) for lp, token in zip(*top)]
                offers.sort(key=lambda offer: -offer[0])
                for score, parent, token in offers:
                    tokens.append(token)
                    parents.append(parent)
                    scores.append(score)
                mine[:] = range(len(tokens) - len(offers), len(tokens) - len(offers) + min(branches, len(offers)))
        return [likeliest(TokenTree(tokens, parents), scores, budget) for tokens, parents, scores in grown]

    def level(self, seqs: list[Sequence]) -> list[Sequence]:
        """Draft sequences for these requests: a request that ended or was preempted since (recomputed from scratch
        by the target) gives its draft's blocks back; a new or readmitted one gets an empty draft."""
        live = {seq.request_id: seq for seq in seqs}
        for request_id, (draft, preemptions) in list(self.seqs.items()):
            seq = live.get(request_id)
            if seq is None or seq.preemptions != preemptions:
                for manager in self.managers:
                    manager.release(draft)
                del self.seqs[request_id]
        for seq in seqs:
            if seq.request_id not in self.seqs:
                draft = Sequence(seq.request_id, seq.prompt_ids, seq.params, None, lookahead=self.lookahead)
                draft.slot = seq.slot
                for manager in self.managers:
                    manager.admit(draft, 0)
                self.seqs[seq.request_id] = (draft, seq.preemptions)
        return [self.seqs[seq.request_id][0] for seq in seqs]

    def catch_up(self, seqs: list[Sequence], drafts: list[Sequence]) -> None:
        """Feed each draft the request's tokens it has not seen, all but the newest, one forward per group of drafts
        that feed as many tokens, from nothing (a prefill) or on top of their caches."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            behind = len(seq.all_ids) - 1 - draft.num_cached
            if behind > 0:
                groups.setdefault((behind, draft.num_cached == 0), []).append(i)
        for members in groups.values():
            self.runner.feed([drafts[i] for i in members], [seqs[i].all_ids[drafts[i].num_cached:-1] for i in members])

    def keep(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """The target kept each request's first `length` tokens: its draft keeps as many of them as it has fed."""
        drafts = [self.seqs[seq.request_id][0] for seq in seqs]
        self.runner.rollback(drafts, [min(length, draft.num_cached) for draft, length in zip(drafts, lengths)])


def likeliest(tree: TokenTree, scores: list[float], budget: int) -> TokenTree:
    """The tree's root and its `budget` likeliest other nodes (ties: the shallower first, so a parent stays before
    its child), in their order in the tree."""
    depths = tree.depths()
    kept = sorted(sorted(range(1, len(tree)), key=lambda i: (-scores[i], depths[i]))[:budget])
    index = {node: i for i, node in enumerate([0, *kept])}
    return TokenTree([tree.tokens[0], *(tree.tokens[i] for i in kept)],
                     [-1, *(index[tree.parents[i]] for i in kept)])
