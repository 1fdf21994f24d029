"""Serving-style use of the engine: one failing request ends alone, abort frees its cache at once, streamed tokens
equal generate()'s, generate() never swallows queued requests, concurrent use is refused, statistics stay bounded."""
import threading

import pytest

import harness.engine.decode_stats
import harness.engine.llm_engine
from harness import Engine, SamplingParams
from helpers import make_prompts, random_model  # tests/ is on sys.path under pytest

ARCHS = ["gqa", "mamba", "hybrid"]  # attention, a state architecture, a window + global hybrid
LAYOUTS = ["contiguous", "paged"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return random_model(request.param, max_seq_len=64)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def alone(model, prompt, params, kv_cache):
    return Engine(model, max_batch=1, max_seq_len=64, kv_cache=kv_cache).generate([prompt], params)[0].token_ids


def assert_pool_whole(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.unfinished
    assert sorted(engine.scheduler.free_slots) == list(range(engine.max_batch))
    for manager in engine.block_managers:
        assert manager.used == 0 and manager.reserved == 0 and not manager.tables
        assert sorted(manager.free) == list(range(manager.num_blocks))


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_a_request_failing_mid_step_ends_alone(model, kv_cache, monkeypatch):
    prompts = make_prompts([3 + i % 7 for i in range(21)], model.config.vocab_size, seed=1)
    bad = 7
    params = [greedy(6 + i % 3) for i in range(21)]
    params[bad] = SamplingParams(max_new_tokens=8, temperature=1.0, seed=99)  # only it reaches the sampler
    real_sample = harness.engine.llm_engine.sample_token

    def sampler_that_fails_on_the_third_token(logits, p, history, generator):
        if p.seed == 99 and len(history) == len(prompts[bad]) + 2:
            raise RuntimeError("injected sampler failure")
        return real_sample(logits, p, history, generator)

    monkeypatch.setattr(harness.engine.llm_engine, "sample_token", sampler_that_fails_on_the_third_token)
    engine = Engine(model, max_batch=21, max_seq_len=64, kv_cache=kv_cache, block_size=4)  # all 21 run at once
    outputs = engine.generate(prompts, params)
    assert [o.request_id for o in outputs] == list(range(21))
    failed = outputs[bad]
    assert failed.finish_reason == "error" and "injected sampler failure" in failed.error
    assert len(failed.token_ids) == 2  # the tokens it had before it failed
    for i, out in enumerate(outputs):
        if i != bad:
            assert out.finish_reason == "length" and out.error == ""
            assert out.token_ids == alone(model, prompts[i], params[i], kv_cache), f"request {i}"
    assert_pool_whole(engine)


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_a_failing_prefill_ends_that_request_only(model, kv_cache, monkeypatch):
    engine = Engine(model, max_batch=3, max_seq_len=64, kv_cache=kv_cache)
    prompts = make_prompts([5, 6, 7], model.config.vocab_size, seed=2)
    real_prefill = engine.runner.prefill

    def prefill(chunks):
        if any(seq.request_id == 1 for seq, _ in chunks):
            raise ValueError("injected prefill failure")
        return real_prefill(chunks)

    monkeypatch.setattr(engine.runner, "prefill", prefill)
    outputs = engine.generate(prompts, greedy(5))
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert outputs[1].token_ids == [] and "injected prefill failure" in outputs[1].error
    for i in (0, 2):
        assert outputs[i].token_ids == alone(model, prompts[i], greedy(5), kv_cache)
    assert_pool_whole(engine)


def test_a_failing_decode_forward_ends_its_batch_and_the_engine_goes_on(model, monkeypatch):
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged")
    prompts = make_prompts([4, 5], model.config.vocab_size, seed=3)
    real_decode = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda seqs: (_ for _ in ()).throw(RuntimeError("injected")))
    outputs = engine.generate(prompts, greedy(4))
    assert [o.finish_reason for o in outputs] == ["error", "error"]
    assert_pool_whole(engine)
    monkeypatch.setattr(engine.runner, "decode", real_decode)
    assert engine.generate(prompts[:1], greedy(4))[0].token_ids == alone(model, prompts[0], greedy(4), "paged")


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_abort_frees_the_cache_at_once_and_others_go_on(model, kv_cache):
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache, block_size=4)
    prompts = make_prompts([6, 9, 5], model.config.vocab_size, seed=4)
    ids = [engine.add_request(p, greedy(10)) for p in prompts]
    engine.step()
    engine.step()
    held_before = [sum(m.held(s) for m in engine.block_managers) for s in engine.scheduler.running]
    out = engine.abort(ids[1])
    assert out.finish_reason == "abort" and out.request_id == ids[1] and len(out.token_ids) == 3  # prefill + 2 decodes
    assert ids[1] not in engine.unfinished and all(s.request_id != ids[1] for s in engine.scheduler.running)
    assert len(engine.scheduler.free_slots) == 1  # its slot is free before the next step
    if kv_cache == "paged":
        assert sum(m.used for m in engine.block_managers) == held_before[0]
    waiting = engine.abort(ids[2])  # never admitted: leaves the queue
    assert waiting.finish_reason == "abort" and waiting.token_ids == []
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert [o.request_id for o in finished] == [ids[0]]
    assert finished[0].token_ids == alone(model, prompts[0], greedy(10), kv_cache)
    assert engine.abort(ids[0]) is None  # already finished
    assert_pool_whole(engine)


def test_abort_of_an_unknown_id_is_an_error(model):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    with pytest.raises(ValueError, match="unknown request_id 0"):
        engine.abort(0)
    engine.add_request([1, 2], greedy(2))
    with pytest.raises(ValueError, match=r"unknown request_id 5: this engine has issued ids 0 to 0"):
        engine.abort(5)
    with pytest.raises(ValueError, match=r"request_id must be an integer"):
        engine.abort("0")


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_streamed_tokens_equal_generate(model, kv_cache):
    prompts = make_prompts([3, 8, 5, 11], model.config.vocab_size, seed=5)
    params = [greedy(7), SamplingParams(max_new_tokens=9, temperature=0.8, seed=3), greedy(4), greedy(9)]
    want = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache).generate(prompts, params)
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache=kv_cache)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed = {i: [] for i in ids}
    finished = {}
    for event in engine.stream():
        streamed[event.request_id].append(event.token_id)
        if event.finished is not None:
            finished[event.request_id] = event.finished
    assert [streamed[i] for i in ids] == [w.token_ids for w in want]
    assert [finished[i].token_ids for i in ids] == [w.token_ids for w in want]
    assert_pool_whole(engine)


def test_abort_while_streaming(model):
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged")
    prompts = make_prompts([4, 6], model.config.vocab_size, seed=6)
    keep, drop = (engine.add_request(p, greedy(12)) for p in prompts)
    seen = {keep: [], drop: []}
    for event in engine.stream():
        seen[event.request_id].append(event.token_id)
        if len(seen[drop]) == 3:
            engine.abort(drop)
    assert len(seen[drop]) == 3
    assert seen[keep] == alone(model, prompts[0], greedy(12), "paged")
    assert_pool_whole(engine)


def test_generate_refuses_while_requests_are_queued(model):
    engine = Engine(model, max_batch=2, max_seq_len=64)
    queued = engine.add_request([1, 2, 3], greedy(3))
    with pytest.raises(RuntimeError, match=r"1 request\(s\) queued with add_request are unfinished"):
        engine.generate([[4, 5]], greedy(3))
    assert list(engine.unfinished) == [queued] and len(engine.scheduler.waiting) == 1  # nothing was lost
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [queued]
    assert len(engine.generate([[4, 5]], greedy(3))[0].token_ids) == 3


def test_a_second_thread_is_refused_while_a_step_runs(model, monkeypatch):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    inside, release = threading.Event(), threading.Event()
    real_decode = engine.runner.decode

    def slow_decode(seqs):
        inside.set()
        release.wait(timeout=10)
        return real_decode(seqs)

    monkeypatch.setattr(engine.runner, "decode", slow_decode)
    engine.add_request([1, 2, 3], greedy(3))
    worker = threading.Thread(target=engine.step)
    worker.start()
    assert inside.wait(timeout=10)
    try:
        for call in (engine.step, lambda: engine.add_request([1], greedy(1)), lambda: engine.abort(0),
                     lambda: engine.generate([[1]], greedy(1))):
            with pytest.raises(RuntimeError, match="not thread-safe"):
                call()
    finally:
        release.set()
        worker.join()
    while engine.has_unfinished():
        engine.step()  # the refused calls changed nothing: the request runs to the end
    assert_pool_whole(engine)


def test_decode_statistics_are_bounded(model, monkeypatch):
    monkeypatch.setattr(harness.engine.decode_stats, "STATS_WINDOW", 8)
    engine = Engine(model, max_batch=2, max_seq_len=64)
    engine.generate([[1, 2], [3, 4, 5]], greedy(21))
    stats = engine.decode_stats
    assert stats.steps == 20 and stats.total_tokens == 40
    assert len(stats.seconds) == len(stats.batch_sizes) == len(stats.kv_bytes) == 8
    assert stats.tokens_per_second == pytest.approx(40 / stats.total_seconds)
