"""Tree speculation samples exactly: two different drafts (a gqa and a Mamba) each propose two chains a step, the
target verifies the four-branch tree in one forward, and the empirical joint of 4,000 requests' first three tokens
(one from the prefill, two from the first tree step, which proposes chains of two) matches the target's enumerated
distribution by a chi-square test (p > 1e-5) at temperature 1 and with top-p 0.9. The same test catches a
deliberately wrong rule: a rejected sibling's residual not taken, so the next sibling is tested against p again,
which over-weights the drafts' tokens."""
import pytest

from harness import Engine, SamplingParams, SpeculativeConfig
from harness.engine.speculative import tree as tree_rule
from test_speculative_sampling import ALPHA, PROMPT, TOKENS, chi_square_p, exact_joint, small_model

# power: the wrong sibling rule scores p ~ 1e-210 (temperature 1) and 5e-74 (top-p 0.9) at this size, 4e-85 at 2,000
SAMPLES = 4_000
BATCH = 2_000


@pytest.fixture(scope="module")
def models():
    return small_model("gqa", 0), (small_model("gqa", 5), small_model("mamba", 1))


def tree_samples(target, drafts, params: SamplingParams, samples: int = SAMPLES) -> tuple[dict, object]:
    engine = Engine(target, max_batch=BATCH, max_seq_len=len(PROMPT) + TOKENS + 1, kv_cache="paged", block_size=4,
                    speculative=SpeculativeConfig(drafts, num_speculative_tokens=2, branches=2))
    counts: dict[tuple[int, ...], int] = {}
    for first in range(0, samples, BATCH):
        sampled = [SamplingParams(max_new_tokens=TOKENS + 1, temperature=params.temperature, top_p=params.top_p, seed=i)
                   for i in range(first, first + BATCH)]
        for out in engine.generate([PROMPT] * BATCH, sampled):
            key = tuple(out.token_ids[:TOKENS])
            counts[key] = counts.get(key, 0) + 1
    return counts, engine.speculative_stats


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)],
                         ids=["temperature 1", "top-p 0.9"])
def test_tree_samples_follow_the_target_distribution(models, params):
    target, drafts = models
    counts, stats = tree_samples(target, drafts, params)
    assert stats.tree_fallback == "" and stats.proposed >= 4 * stats.sequence_steps  # four chains a step
    assert 0.2 < stats.accepted / stats.sequence_steps < 1.8  # of 2 a step at most: both outcomes of the rule run
    p_value = chi_square_p(counts, exact_joint(target, params))
    assert p_value > ALPHA, f"tree samples differ from the target's distribution (chi-square p = {p_value:.2g})"


def test_a_wrong_sibling_rule_is_caught(models, monkeypatch):
    target, drafts = models
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(tree_rule, "residual", lambda p, q, token: p)  # each sibling tested against p itself
    counts, _ = tree_samples(target, drafts, params, samples=2_000)  # p ~ 4e-85 at this size: far past ALPHA
    p_value = chi_square_p(counts, exact_joint(target, params))
    assert p_value < ALPHA, f"a wrong rule passed the test (chi-square p = {p_value:.2g})"
