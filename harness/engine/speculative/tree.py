"""Token trees for speculative decoding, and the rule that verifies one exactly (SpecInfer, Miao et al. 2024).

A request's tree has the request's newest token at its root (node 0, already emitted) and proposed tokens below it:
node i > 0 holds a token, its parent (an earlier node) and the distribution the token was drawn from. A chain is a
tree whose nodes each have one child. Siblings may hold the same token: each is its own proposal, with its own
subtree. The target scores every node in one forward, each seeing its own path (cache.TreeBatch); the rule then
walks down from the root.

At a node whose target distribution is p, the children are tried in order: child c with token x, drawn from q, is
accepted with probability min(1, p(x) / q(x)) and the walk moves into it; on a rejection p becomes norm(max(0, p - q))
and the next child is tried; when no child is accepted the target's token is drawn from what p has become. Each
step is the speculative sampling lemma, applied to the residual left by the children before, so the token emitted at
every node is distributed as the target's own, provided each child's token is drawn from its q independently of its
siblings (several drafts, or one draft sampled several times): SpecInfer's multi-step speculative sampling. A
deterministic proposal (prompt lookup, a greedy draft's top tokens) is a q with all its mass on its token. Greedy:
follow the child holding the target's argmax, if any, and emit the argmax where none does.
"""
from dataclasses import dataclass, field

import torch

from harness.engine.sampling import SamplingParams, processed_logits, sample_token, token_distribution
from harness.engine.speculative.rejection import residual


@dataclass
class TokenTree:
    """Nodes 1 .. n - 1 in any order that puts each parent before its children (node 0, the root, holds the
    request's newest token). probs[i]: node i's q, or None where its token was proposed deterministically."""

    tokens: list[int]  # tokens[0] is the root's
    parents: list[int]  # parents[0] == -1
    probs: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.probs:
            self.probs = [None] * len(self.tokens)
        if not (len(self.tokens) == len(self.parents) == len(self.probs)) or self.parents[:1] != [-1]:
            raise ValueError(f"a tree needs a root (parent -1) and one parent and q per node, got {len(self.tokens)} "
                             f"tokens, {len(self.parents)} parents, {len(self.probs)} distributions")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"every node's parent must come before it, got parents {self.parents}")

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: entry (i, j) is True where node j is node i or one of its ancestors."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for i in range(1, len(self)):
            mask[i] |= mask[self.parents[i]]
        return mask

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to node (empty for the root)."""
        nodes = []
        while node > 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    @classmethod
    def from_chains(cls, root: int, chains: list[tuple[list[int], torch.Tensor | None]]) -> "TokenTree":
        """One branch from the root per chain (tokens, and the [len, V] distributions they were drawn from, or None):
        the tree several drafts' proposals make, each kept whole (a token two drafts share is two proposals)."""
        tokens, parents, probs = [root], [-1], [None]
        for chain, chain_probs in chains:
            parent = 0
            for j, token in enumerate(chain):
                tokens.append(token)
                parents.append(parent)
                probs.append(None if chain_probs is None else chain_probs[j])
                parent = len(tokens) - 1
        return cls(tokens, parents, probs)


def verify_tree(target_logits: torch.Tensor, tree: TokenTree, params: SamplingParams, history: list[int],
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """target_logits [len(tree), V]: at each node, the target's logits for the token after that node's path.
    Returns (the accepted nodes, root's child first; the tokens to emit: theirs, then one from the target)."""
    node, accepted, emitted = 0, [], []
    while True:
        children = tree.children(node)
        seen = history + emitted
        if params.greedy:
            best = int(processed_logits(target_logits[node], params, seen).argmax())
            match = next((c for c in children if tree.tokens[c] == best), None)
            if match is None:
                return accepted, emitted + [best]
            node = match
        else:
            if not children:  # a leaf: every proposal on the way was accepted
                return accepted, emitted + [sample_token(target_logits[node], params, seen, generator)]
            p = token_distribution(target_logits[node], params, seen)
            node = -1
            for child in children:
                token, q = tree.tokens[child], tree.probs[child]
                q = None if q is None else q.to(p)
                q_token = 1.0 if q is None else float(q[token])
                u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
                if u * q_token < float(p[token]):  # accepted: u < p / q
                    node = child
                    break
                p = residual(p, q, token)
            if node < 0:
                return accepted, emitted + [int(torch.multinomial(p, 1, generator=generator))]
        accepted.append(node)
        emitted.append(tree.tokens[node])


def tree_blocker(model) -> str:
    """Why this target cannot verify a token tree in one forward ("" where it can): a recurrent state would need a
    copy per branch, and eviction by score decides what a row holds from the step's own attention."""
    for i, spec in enumerate(model.cache_specs()):
        if spec.kind == "state":
            return (f"layer {i} ({model.config.layers[i].kind}) carries a recurrent state, which each branch of a tree "
                    f"would need a copy of")
        if spec.retention.scored:
            return f"layer {i} evicts by score ({spec.retention.describe()}), from each step's own attention"
    return ""
