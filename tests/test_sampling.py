"""Sampling semantics on hand-made logits, then seeds and stop tokens through the Engine."""
import math

import pytest
import torch

import zoo
from harness import Engine, SamplingParams
from harness.engine.sampling import apply_repetition_penalty, sample_token, top_k_filter, top_p_filter


def logits_of(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits).tolist()


def draw(logits, params: SamplingParams, n: int, seed: int = 0, history=()) -> torch.Tensor:
    """n tokens drawn from the same logits: counts per vocabulary id."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.shape[-1], dtype=torch.long)
    for _ in range(n):
        counts[sample_token(logits, params, list(history), generator)] += 1
    return counts


# ---- top-p / top-k ---------------------------------------------------------------------------------


def test_top_p_keeps_the_token_that_crosses_p():
    logits = logits_of([0.5, 0.3, 0.2])
    assert kept(top_p_filter(logits, 0.6)) == [True, True, False]  # 0.5 < 0.6: the 0.3 token crosses p and stays
    assert kept(top_p_filter(logits, 0.5)) == [True, False, False]  # 0.5 reaches p exactly: nothing else needed
    assert kept(top_p_filter(logits, 0.3)) == [True, False, False]  # the top token always survives
    assert kept(top_p_filter(logits, 0.95)) == [True, True, True]
    assert kept(top_p_filter(logits, 1.0)) == [True, True, True]


def test_top_p_works_on_unsorted_logits_and_leaves_kept_values_alone():
    logits = logits_of([0.2, 0.5, 0.05, 0.25])
    filtered = top_p_filter(logits, 0.7)
    assert kept(filtered) == [False, True, False, True]
    assert torch.equal(filtered[[1, 3]], logits[[1, 3]])


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    assert kept(top_k_filter(logits, 2)) == [False, True, False, True, False]
    assert kept(top_k_filter(logits, 0)) == [True] * 5  # 0 = off
    assert kept(top_k_filter(logits, 99)) == [True] * 5


def test_top_k_is_applied_before_top_p():
    # top-k=2 first renormalises [0.4, 0.3] to [0.571, 0.429]: top-p=0.5 then keeps token 0 alone.
    # top-p first would keep {0, 1} (0.4 < 0.5), and top-k=2 after it would keep both.
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    counts = draw(logits, SamplingParams(top_k=2, top_p=0.5), n=300)
    assert counts.tolist() == [300, 0, 0, 0]
    # each filter alone lets token 1 through, so the check above can fail
    assert draw(logits, SamplingParams(top_k=2), n=300)[1] > 50
    assert draw(logits, SamplingParams(top_p=0.5), n=300)[1] > 50


def test_temperature_is_applied_before_top_p():
    # At T=0.5 the probabilities become [0.658, 0.237, 0.105]: top-p=0.6 keeps token 0 alone
    # (at T=1 it would keep tokens 0 and 1).
    logits = logits_of([0.5, 0.3, 0.2])
    assert draw(logits, SamplingParams(temperature=0.5, top_p=0.6), n=300).tolist() == [300, 0, 0]
    assert draw(logits, SamplingParams(temperature=1.0, top_p=0.6), n=300)[1] > 50


def test_top_p_samples_only_from_the_nucleus():
    counts = draw(logits_of([0.5, 0.3, 0.2]), SamplingParams(top_p=0.6), n=2000)
    assert counts[2] == 0
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.05  # renormalised over the kept tokens


# ---- repetition penalty ----------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.0, 4.0])
    original = logits.clone()
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 4]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0, 0.0, 4.0]  # unseen 2, 3, 5 untouched
    assert torch.equal(logits, original)  # the caller's logits are not modified


def test_repetition_penalty_in_sample_token_counts_each_seen_token_once():
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_token(torch.tensor([3.0, 2.0]), params, [0], None) == 1  # 3/2 < 2
    assert sample_token(torch.tensor([-1.0, -1.5]), params, [0], None) == 1  # -1*2 < -1.5
    assert sample_token(torch.tensor([3.0, 2.0]), params, [1], None) == 0  # only seen tokens are penalised
    assert sample_token(torch.tensor([3.0, 1.4]), params, [0, 0, 0], None) == 0  # 3/2, not 3/8
    assert sample_token(torch.tensor([3.0, 2.0]), SamplingParams(temperature=0), [0], None) == 0  # 1.0 = off


def test_sample_token_does_not_modify_logits():
    logits = torch.tensor([3.0, -2.0, 1.0, 0.5])
    original = logits.clone()
    sample_token(logits, SamplingParams(temperature=0.7, top_k=3, top_p=0.9, repetition_penalty=1.5), [0, 1],
                 torch.Generator().manual_seed(0))
    assert torch.equal(logits, original)


# ---- greedy and temperature ------------------------------------------------------------------------


def test_greedy_is_argmax():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(100, generator=generator)
        # top-k/top-p cannot change the argmax; greedy ignores them and needs no generator
        assert sample_token(logits, SamplingParams(temperature=0, top_k=5, top_p=0.5), [], None) == int(logits.argmax())


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.5, 4)])
def test_sampling_distribution_matches_softmax(temperature, top_k):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.2, 0.6])
    n = 8000
    counts = draw(logits, SamplingParams(temperature=temperature, top_k=top_k), n=n, seed=1)
    expected = (top_k_filter(logits / temperature, top_k)).softmax(-1) * n
    support = expected > 0
    assert (counts[~support] == 0).all()
    chi2 = (((counts[support] - expected[support]) ** 2) / expected[support]).sum().item()
    dof = int(support.sum()) - 1
    # chi-square 99.9% points: dof 7 -> 24.3, dof 3 -> 16.3; the bound is loose, the seed fixed
    assert chi2 < 30, f"counts {counts.tolist()} vs expected {expected.round().tolist()}: chi2 {chi2:.1f} (dof {dof})"
    # a wrong temperature is caught: the same counts are far from the T=1 distribution
    if temperature != 1.0:
        wrong = (top_k_filter(logits, top_k)).softmax(-1) * n
        assert (((counts[support] - wrong[support]) ** 2) / wrong[support]).sum().item() > 100


# ---- through the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_model():
    """Default (std 0.02) init: at T=1 its next-token distribution is near uniform, so samples vary."""
    torch.manual_seed(0)
    return zoo.build("gqa", preset="tiny", tie_embeddings=False, max_seq_len=128).eval()


def test_same_seed_same_tokens_different_seed_different(engine_model):
    prompt = [5, 17, 200, 3]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1234)

    def run(p, others=0):
        engine = Engine(engine_model, max_batch=4, max_seq_len=128)
        # unseeded neighbours in the batch must not disturb a seeded request's random stream
        prompts = [prompt] + [[7 + i] * (3 + i) for i in range(others)]
        plist = [p] + [SamplingParams(max_new_tokens=10, temperature=1.0)] * others
        return engine.generate(prompts, plist)[0].token_ids

    first = run(params)
    assert len(set(first)) > 5  # near-uniform random model at T=1: varied tokens
    assert run(params) == first
    assert run(params, others=3) == first
    assert run(SamplingParams(max_new_tokens=24, temperature=1.0, seed=1235)) != first


def test_stop_token_ends_request_with_reason_stop(engine_model):
    engine = Engine(engine_model, max_batch=2, max_seq_len=128)
    prompt = [1, 2, 3, 4, 5]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=30, temperature=1.0, seed=7))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.token_ids[10]
    first = full.token_ids.index(stop)
    never = next(t for t in range(engine_model.config.vocab_size) if t not in full.token_ids)  # a stop id that never fires
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30, temperature=1.0, seed=7, stop_token_ids=[stop, never]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]  # ends at the first stop token, which is returned
    assert not engine.has_unfinished()
    assert len(engine.scheduler.free_slots) == engine.max_batch


def test_stop_token_from_prefill_ends_request_at_once(engine_model):
    engine = Engine(engine_model, max_batch=2, max_seq_len=128)
    prompt = [9, 8, 7]
    first_token = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0))[0].token_ids[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(first_token,)))[0]
    assert out.token_ids == [first_token] and out.finish_reason == "stop"
    assert math.isclose(out.metrics.tpot, 0.0) and out.metrics.itl == []
