"""The retention policy's answers against its definitions, brute-forced position by position."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import Retention


def sees(key: int, query: int, policy: Retention) -> bool:
    """The definitions, written out plainly: causal, then the policy (dilation r: every r-th key, W of them)."""
    if key > query:
        return False
    if policy.chunk is not None:
        return key // policy.chunk == query // policy.chunk
    if policy.window is None:
        return True
    back = query - key
    return (back % policy.dilation == 0 and back // policy.dilation < policy.window) or key < policy.sinks


def held_keys(length: int, policy: Retention) -> list[int]:
    """The keys a cache must hold after `length` tokens: those the newest query or any later one sees."""
    later = range(length - 1, length + 80)  # past the widest span drawn below
    return [key for key in range(length) if any(sees(key, query, policy) for query in later)]


policies = st.one_of(
    st.just(Retention()),
    st.integers(1, 12).map(lambda w: Retention(window=w)),
    st.tuples(st.integers(1, 6), st.integers(1, 12)).map(lambda sw: Retention(sinks=sw[0], window=sw[1])),
    st.integers(1, 12).map(lambda c: Retention(chunk=c)),
    st.tuples(st.integers(1, 8), st.integers(2, 5)).map(lambda wr: Retention(window=wr[0], dilation=wr[1])),
)


@settings(max_examples=150, deadline=None)
@given(policy=policies, length=st.integers(1, 40))
def test_answers_match_the_definitions(policy, length):
    query = length - 1
    visible = [key for key in range(length) if sees(key, query, policy)]
    held = held_keys(length, policy)
    assert policy.keys_seen(length) == len(visible)
    assert policy.tokens_held(length) == len(held)
    assert len(held) <= (policy.capacity or length) and len(visible) <= (policy.visible_capacity or length)
    keys = torch.arange(length)
    assert keys[policy.visible(keys, torch.tensor(query))].tolist() == visible
    assert keys[policy.held(keys, torch.tensor(query))].tolist() == held
    # the held keys fill ring rows 0 .. held-1, one each: a decode reads rows among the first tokens_held
    assert sorted(policy.row(torch.tensor(held)).tolist()) == list(range(len(held)))
    assert [policy.row(key) for key in held] == policy.row(torch.tensor(held)).tolist()
    # the kernels' form: the sinks before the span start, then the span's every dilation-th key from span_starts
    start, first = policy.span_start(length), policy.span_starts(torch.tensor([length])).item()
    sinks = list(range(min(policy.sinks, start)))
    assert held == sinks + list(range(start, length))
    assert visible == sinks + list(range(first, length, policy.dilation))
    assert policy.rows_held(torch.tensor([length])).tolist() == [len(held)]
    # what is dropped no later query sees
    lo, hi = policy.dropped(length)
    assert not any(sees(key, later, policy) for key in range(lo, hi) for later in range(query, query + 80))
    assert policy.causal_pairs(length) == sum(policy.keys_seen(n) for n in range(1, length + 1))
    assert policy.all_visible_up_to is None or all(
        sees(key, q, policy) for q in range(min(length, policy.all_visible_up_to)) for key in range(q + 1))


@settings(max_examples=100, deadline=None)
@given(policy=policies, max_length=st.integers(1, 60), block_size=st.sampled_from([1, 2, 4, 8, 16]))
def test_peak_blocks_bounds_the_blocks_held(policy, max_length, block_size):
    held = []
    for length in range(1, max_length + 1):
        dead = set(policy.dead_blocks(length, block_size))
        blocks = range(-(-length // block_size))
        # a dead block holds only dropped positions, and every live block holds a held one
        kept = set(held_keys(length, policy))
        for block in blocks:
            positions = range(block * block_size, min((block + 1) * block_size, length))
            assert (block in dead) == (not any(p in kept for p in positions))
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
    (dict(window=4, dilation=0), "dilation must be an integer >= 1"), (dict(dilation=2), "give window and no sinks"),
    (dict(window=4, sinks=2, dilation=2), "no sinks or chunk"), (dict(chunk=8, dilation=3), "no sinks or chunk"),
])
def test_bad_policies_raise(settings, match):
    with pytest.raises(ValueError, match=match):
        Retention(**settings)
