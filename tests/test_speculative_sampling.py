"""Speculative sampling is exact: with a five-token vocabulary, the target's distribution over a request's first
three tokens (the first from the prefill, the next two from one speculative step verifying two proposals) is
enumerated from its logits, and the empirical joint of 4,000 speculative samples must match it by a chi-square
test (p > 1e-5), at temperature 1 and with top-p 0.9. The same test must catch a deliberately biased rule:
resampling a rejected position from p instead of norm(max(0, p - q)) over-weights the draft's tokens."""
import itertools

import pytest
import torch

import zoo
from harness import Engine, SamplingParams, SpeculativeConfig
from harness.engine.sampling import token_distribution
from harness.engine.speculative import rejection
from helpers import spread_weights

VOCAB = 5
PROMPT = [0, 1, 2]
# power: the biased rule below scores p ~ 4e-76 at this size (1e-167 at 8,000), 70 orders of magnitude past ALPHA
SAMPLES = 4_000
TOKENS = 3  # the joint is over these; a fourth is decoded so the first speculative step verifies k = 2 proposals
ALPHA = 1e-5  # a right rule fails one seed in 100,000


def small_model(arch: str, seed: int):
    torch.manual_seed(seed)
    model = zoo.build(arch, preset="tiny", vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, mlp_hidden=32,
                      tie_embeddings=False)
    return spread_weights(model, seed=seed, gain=1.5)


@torch.no_grad()
def exact_joint(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(y1, y2, y3 | prompt) under the target's processed distribution, by enumeration."""
    joint = {}
    for tokens in itertools.product(range(VOCAB), repeat=TOKENS):
        sequence = PROMPT + list(tokens)
        logits = model(torch.tensor([sequence[:-1]]))[0, len(PROMPT) - 1:]
        probability = 1.0
        for i, token in enumerate(tokens):
            probability *= float(token_distribution(logits[i], params, sequence[: len(PROMPT) + i])[token])
        joint[tokens] = probability
    return joint


def speculative_samples(target, draft, params: SamplingParams) -> tuple[dict, float]:
    engine = Engine(target, max_batch=1000, max_seq_len=len(PROMPT) + TOKENS + 1, kv_cache="paged", block_size=4,
                    speculative=SpeculativeConfig(draft, num_speculative_tokens=2))
    sampled = [SamplingParams(max_new_tokens=TOKENS + 1, temperature=params.temperature, top_p=params.top_p, seed=i)
               for i in range(SAMPLES)]
    counts: dict[tuple[int, ...], int] = {}
    for out in engine.generate([PROMPT] * SAMPLES, sampled):
        key = tuple(out.token_ids[:TOKENS])
        counts[key] = counts.get(key, 0) + 1
    return counts, engine.speculative_stats.acceptance_rate


def chi_square_p(counts: dict, joint: dict) -> float:
    """Pearson's test, cells expecting fewer than 5 samples pooled into one."""
    samples = sum(counts.values())
    expected = {cell: samples * p for cell, p in joint.items()}
    big = [cell for cell, e in expected.items() if e >= 5]
    observed = [counts.get(cell, 0) for cell in big] + [samples - sum(counts.get(cell, 0) for cell in big)]
    wanted = [expected[cell] for cell in big] + [samples - sum(expected[cell] for cell in big)]
    if wanted[-1] < 5:
        observed[-2] += observed.pop()
        wanted[-2] += wanted.pop()
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def models():
    return small_model("gqa", 0), small_model("mamba", 1)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["temperature 1", "top-p 0.9"])
def test_speculative_samples_follow_the_target_distribution(models, params):
    target, draft = models
    counts, acceptance = speculative_samples(target, draft, params)
    assert 0.2 < acceptance < 0.9  # the draft is neither ignored nor a copy: the rule's both branches run
    p_value = chi_square_p(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"speculative samples differ from the target's distribution (chi-square p = {p_value:.2g})"


def test_a_biased_rule_is_caught(models, monkeypatch):
    target, draft = models
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(rejection, "residual", lambda p, q, token: p)  # resample from p: the textbook mistake
    counts, _ = speculative_samples(target, draft, params)
    p_value = chi_square_p(counts, exact_joint(target, params))
    assert p_value < ALPHA, f"a biased rule passed the test (chi-square p = {p_value:.2g})"
