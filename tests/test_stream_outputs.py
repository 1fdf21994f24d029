"""No output is lost when a consumer stops streaming early: a step's events wait on the engine until delivered (by
the next stream(), step() or step_tokens(), take_finished() or abort()), each exactly once, the cache back in the
pool at once; and an arrival in the future is refused."""
import time

import pytest

from harness import Engine, SamplingParams
from helpers import make_prompts, random_model  # tests/ is on sys.path under pytest

LAYOUTS = ["contiguous", "paged"]
TOGETHER = 8  # requests that finish in the same step


@pytest.fixture(scope="module")
def model():
    return random_model("gqa", max_seq_len=64)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def prompts(model) -> list[list[int]]:
    return make_prompts([3 + i for i in range(TOGETHER)], model.config.vocab_size, seed=11)


def queued(model, kv_cache: str) -> Engine:
    """8 requests of 5 new tokens on an engine that runs them all at once: they all end in the same step."""
    engine = Engine(model, max_batch=TOGETHER, max_seq_len=64, kv_cache=kv_cache, block_size=4)
    for prompt in prompts(model):
        engine.add_request(prompt, greedy(5))
    return engine


def full_run(model, kv_cache: str) -> dict[int, list[int]]:
    """Each request's tokens from a run stepped to the end, checking that one step ends all 8."""
    engine = queued(model, kv_cache)
    ends = []
    while engine.has_unfinished():
        ends += [outputs] if (outputs := engine.step()) else []
    assert [len(outputs) for outputs in ends] == [TOGETHER]  # the case under test: one step ends all
    return {out.request_id: out.token_ids for out in ends[0]}


def first_finished(engine: Engine):
    """Stream until the first finished event, then break (closing the generator mid-step)."""
    for event in engine.stream():
        if event.finished is not None:
            return event.finished
    raise AssertionError("no request finished")


def assert_pool_full(engine: Engine) -> None:
    assert engine.cache_bytes_in_use() == 0 and not engine.unfinished
    assert sorted(engine.scheduler.free_slots) == list(range(engine.max_batch))
    for manager in engine.block_managers:
        assert manager.used == 0 and not manager.tables


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_outputs_left_by_a_break_are_taken_without_another_step(model, kv_cache):
    want = full_run(model, kv_cache)
    engine = queued(model, kv_cache)
    first = first_finished(engine)
    assert_pool_full(engine)  # every request ended: their cache is back although 7 outputs are undelivered
    steps = engine.decode_stats.steps
    rest = engine.take_finished()
    assert engine.decode_stats.steps == steps  # taken, not computed again
    got = {out.request_id: out.token_ids for out in [first, *rest]}
    assert got == want and len(rest) == TOGETHER - 1
    assert all(out.finish_reason == "length" for out in rest)
    assert engine.take_finished() == [] and list(engine.stream()) == []  # each delivered once


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_a_new_stream_yields_what_the_closed_one_left_first(model, kv_cache):
    want = full_run(model, kv_cache)
    engine = queued(model, kv_cache)
    first = first_finished(engine)
    late = engine.add_request([7, 8, 9], greedy(3))  # joins after the leftovers
    events = list(engine.stream())
    left = [e.finished for e in events[:TOGETHER - 1]]
    assert all(out is not None for out in left)
    assert {out.request_id: out.token_ids for out in [first, *left]} == want
    assert [e.request_id for e in events[TOGETHER - 1:]] == [late] * 3 and events[-1].finished is not None
    assert_pool_full(engine)


def test_step_delivers_the_leftovers_before_its_own_outputs(model):
    want = full_run(model, "paged")
    engine = queued(model, "paged")
    first = first_finished(engine)
    rest = engine.step()
    assert {out.request_id: out.token_ids for out in [first, *rest]} == want
    assert engine.step() == []


def test_abort_of_an_ended_request_hands_over_its_undelivered_output_once(model):
    want = full_run(model, "paged")
    engine = queued(model, "paged")
    first = first_finished(engine)
    assert engine.abort(first.request_id) is None  # delivered by the stream already
    pending = (first.request_id + 1) % TOGETHER
    out = engine.abort(pending)
    assert out.finish_reason == "length" and out.token_ids == want[pending]
    assert engine.abort(pending) is None
    assert sorted(o.request_id for o in engine.take_finished()) == sorted(set(want) - {first.request_id, pending})


def test_abort_drops_the_undelivered_events_its_output_already_holds(model):
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged")
    ids = {engine.add_request(p, greedy(6)) for p in prompts(model)[:2]}
    stream = engine.stream()
    seen = [next(stream)]  # both got a token in this step: the other's event waits
    [other] = ids - {seen[0].request_id}
    assert any(e.request_id == other for e in engine.undelivered)
    stream.close()
    aborted = engine.abort(other)
    assert aborted.finish_reason == "abort" and aborted.token_ids  # the tokens its dropped events carried
    assert all(e.request_id != other for e in engine.undelivered)
    seen += engine.stream()
    assert {e.request_id for e in seen} == ids - {other}
    assert [e.token_id for e in seen] == seen[-1].finished.token_ids  # each of the kept one's tokens, once
    assert_pool_full(engine)


def test_a_full_stream_leaves_nothing_queued(model):
    engine = queued(model, "paged")
    assert sum(e.finished is not None for e in engine.stream()) == TOGETHER
    assert not engine.undelivered and engine.take_finished() == []


def test_an_arrival_in_the_future_is_refused_and_queues_nothing(model):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    later = time.perf_counter() + 5
    with pytest.raises(ValueError, match=rf"arrival={later!r} is .* s in the future \(time.perf_counter\(\) is now"):
        engine.add_request([1, 2, 3], greedy(2), arrival=later)
    assert engine.requests_added == 0 and not engine.has_unfinished()
    engine.add_request([1, 2, 3], greedy(2), arrival=time.perf_counter())  # now is allowed
    [out] = [e.finished for e in engine.stream() if e.finished]
    assert out.metrics.ttft >= 0 and out.metrics.e2e >= out.metrics.ttft
