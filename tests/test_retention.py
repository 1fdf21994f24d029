"""The retention policy's answers against its definitions, brute-forced position by position."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import Retention


def sees(key: int, query: int, policy: Retention) -> bool:
    """The definitions, written out plainly: causal, then the policy."""
    if key > query:
        return False
    if policy.chunk is not None:
        return key // policy.chunk == query // policy.chunk
    if policy.window is None:
        return True
    return query - key < policy.window or key < policy.sinks


policies = st.one_of(
    st.just(Retention()),
    st.integers(1, 12).map(lambda w: Retention(window=w)),
    st.tuples(st.integers(1, 6), st.integers(1, 12)).map(lambda sw: Retention(sinks=sw[0], window=sw[1])),
    st.integers(1, 12).map(lambda c: Retention(chunk=c)),
)


@settings(max_examples=150, deadline=None)
@given(policy=policies, length=st.integers(1, 40))
def test_answers_match_the_definitions(policy, length):
    query = length - 1
    visible = [key for key in range(length) if sees(key, query, policy)]
    assert policy.tokens_held(length) == len(visible)
    mask = policy.visible(torch.arange(length), torch.tensor(query))
    assert torch.arange(length)[mask].tolist() == visible
    # the kept keys fill ring rows 0 .. held-1, one each: a decode reads exactly the first tokens_held rows
    assert sorted(policy.row(torch.tensor(visible)).tolist()) == list(range(len(visible)))
    assert [policy.row(key) for key in visible] == policy.row(torch.tensor(visible)).tolist()
    # the kernels' form: the sinks before the span start, then the span
    start = policy.span_start(length)
    assert visible == list(range(min(policy.sinks, start))) + list(range(start, length))
    assert policy.span_starts(torch.tensor([length])).tolist() == [start]
    assert policy.rows_held(torch.tensor([length])).tolist() == [len(visible)]
    # what is dropped no later query sees
    lo, hi = policy.dropped(length)
    assert not any(sees(key, later, policy) for key in range(lo, hi) for later in range(query, query + 30))
    assert policy.causal_pairs(length) == sum(policy.tokens_held(n) for n in range(1, length + 1))


@settings(max_examples=100, deadline=None)
@given(policy=policies, max_length=st.integers(1, 60), block_size=st.sampled_from([1, 2, 4, 8, 16]))
def test_peak_blocks_bounds_the_blocks_held(policy, max_length, block_size):
    held = []
    for length in range(1, max_length + 1):
        dead = set(policy.dead_blocks(length, block_size))
        blocks = range(-(-length // block_size))
        # a dead block holds only dropped positions, and every live block holds a visible one
        for block in blocks:
            positions = range(block * block_size, min((block + 1) * block_size, length))
            assert (block in dead) == (not any(sees(p, length - 1, policy) for p in positions))
        held.append(len(blocks) - len(dead))
    assert max(held) <= policy.peak_blocks(max_length, block_size)
    if policy.keeps_all or policy.chunk is not None and policy.chunk % block_size == 0:
        assert max(held) == policy.peak_blocks(max_length, block_size)  # exact where the bound is tight


@settings(max_examples=100, deadline=None)
@given(policy=policies, max_length=st.integers(1, 60), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       step_tokens=st.integers(1, 20))
def test_peak_blocks_bounds_a_chunked_step(policy, max_length, block_size, step_tokens):
    """A step feeding up to step_tokens new tokens on top of `start` cached ones keeps every block its first query
    still sees plus the blocks its own tokens land in: never more than peak_blocks(..., step_tokens)."""
    for start in range(max_length):
        end = min(max_length, start + step_tokens)
        dead = set(policy.dead_blocks(start + 1, block_size))  # what the step's first query no longer sees
        held = sum(block not in dead for block in range(-(-end // block_size)))
        assert held <= policy.peak_blocks(max_length, block_size, step_tokens), (start, end)


@pytest.mark.parametrize("settings, match", [
    (dict(window=0), "window must be an integer >= 1"), (dict(chunk=-2), "chunk must be an integer >= 1"),
    (dict(sinks=4), "give window too"), (dict(sinks=-1, window=4), "sinks must be an integer >= 0"),
    (dict(chunk=8, window=4), "takes no window or sinks"), (dict(window=2.5), "got 2.5"),
])
def test_bad_policies_raise(settings, match):
    with pytest.raises(ValueError, match=match):
        Retention(**settings)
