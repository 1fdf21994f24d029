"""verify_tree alone, on distributions written down (no model): over a four-token vocabulary, the first two tokens
it emits from a two-deep tree of deterministic siblings (the draft's likeliest tokens, as a budget tree proposes
them) follow the target's joint distribution, by a chi-square test of 5,000 draws (sampled siblings from two drafts
are tested through the engine, tests/test_speculative_tree_sampling.py); a rule without the residual fails on sampled
siblings; greedy walks the longest path of argmaxes."""
import itertools

import pytest
import torch

from harness import SamplingParams
from harness.engine.speculative.tree import TokenTree, verify_tree
from test_speculative_sampling import ALPHA, chi_square_p

V = 4
# power: without the residual, these deterministic trees score p ~ 1e-298 at this size (temperature 1 and top-p 0.9)
DRAWS = 5_000


def distribution(seed: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.softmax(sharp * torch.randn(V, generator=torch.Generator().manual_seed(seed)), dim=0)


TARGET_FIRST = distribution(1)
TARGET_NEXT = [distribution(10 + x) for x in range(V)]  # the target's second token after first token x
DRAFTS = [(distribution(2), [distribution(20 + x) for x in range(V)]),
          (distribution(3, 3.0), [distribution(30 + x, 3.0) for x in range(V)])]


def logits_at(tree: TokenTree) -> torch.Tensor:
    """The target's logits at each node: after the root its first-token distribution, after a first token x its
    second, deeper the uniform (the test reads two tokens)."""
    depths = tree.depths()
    rows = [TARGET_FIRST if d == 0 else TARGET_NEXT[tree.tokens[n]] if d == 1 else torch.full((V,), 1 / V)
            for n, d in enumerate(depths)]
    return torch.stack(rows).log()


def sampled_tree(generator) -> TokenTree:
    """From each draft, two chains of two tokens drawn from it: four sampled siblings under the root."""
    chains = []
    for first, nexts in DRAFTS:
        for _ in range(2):
            x = int(torch.multinomial(first, 1, generator=generator))
            y = int(torch.multinomial(nexts[x], 1, generator=generator))
            chains.append(([x, y], torch.stack([first, nexts[x]])))
    return TokenTree.from_chains(0, chains)


def deterministic_tree(_generator) -> TokenTree:
    """The first draft's two likeliest first tokens, each with its likeliest next two: no q anywhere."""
    first, nexts = DRAFTS[0]
    tokens, parents = [0], [-1]
    for x in first.topk(2).indices.tolist():
        tokens.append(x)
        parents.append(0)
        parent = len(tokens) - 1
        for y in nexts[x].topk(2).indices.tolist():
            tokens.append(y)
            parents.append(parent)
    return TokenTree(tokens, parents)


def joint(params: SamplingParams) -> dict:
    from harness.engine.sampling import token_distribution
    first = token_distribution(TARGET_FIRST.log(), params, [0])
    return {(x, y): float(first[x] * token_distribution(TARGET_NEXT[x].log(), params, [0, x])[y])
            for x, y in itertools.product(range(V), repeat=2)}


def draws(make_tree, params: SamplingParams, count: int = DRAWS) -> dict:
    from harness.engine.sampling import sample_token
    generator = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(count):
        tree = make_tree(generator)
        _, emitted = verify_tree(logits_at(tree), tree, params, [0], generator)
        if len(emitted) == 1:  # no proposal accepted: the target's next token comes from its own next step
            emitted.append(sample_token(TARGET_NEXT[emitted[0]].log(), params, [0, emitted[0]], generator))
        key = tuple(emitted[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["temperature 1", "top-p 0.9"])
def test_deterministic_tree_draws_follow_the_target_joint(params):
    p_value = chi_square_p(draws(deterministic_tree, params), joint(params))
    assert p_value > ALPHA, f"tree draws differ from the target's joint (chi-square p = {p_value:.2g})"


def test_accepting_by_p_over_q_without_the_residual_is_caught(monkeypatch):
    from harness.engine.speculative import tree as tree_rule
    monkeypatch.setattr(tree_rule, "residual", lambda p, q, token: p)
    params = SamplingParams(temperature=1.0)
    p_value = chi_square_p(draws(sampled_tree, params, 2_000), joint(params))  # p ~ 4e-184: far past ALPHA
    assert p_value < ALPHA, f"a wrong rule passed (chi-square p = {p_value:.2g})"


def test_greedy_follows_the_argmax_path_to_its_end():
    first = int(TARGET_FIRST.argmax())
    second = int(TARGET_NEXT[first].argmax())
    other = (first + 1) % V
    # the argmax path is the second branch; the first branch and a sibling under it hold other tokens
    tree = TokenTree([0, other, first, (second + 1) % V, second], [-1, 0, 0, 2, 2])
    path, emitted = verify_tree(logits_at(tree), tree, SamplingParams(temperature=0.0), [0], None)
    assert path == [2, 4] and emitted == [first, second, 0]  # then the uniform's argmax, the first token
