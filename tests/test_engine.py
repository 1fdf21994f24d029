"""Continuous batching, slot/block release, per-request metrics and vLLM-named summaries."""
import math
import random
import statistics

import numpy as np
import pytest

import zoo
from harness import Engine, SamplingParams, summarize
from harness.engine.request_metrics import RequestMetrics
from harness.metrics import percentile
from helpers import random_model  # tests/ is on sys.path under pytest

LAYOUTS = ("contiguous", "paged")
MAX_SEQ_LEN = 96
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model():
    return random_model("gqa", max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def workload():
    """40 requests: prompt lengths 1..60, max_new_tokens 1..30 (both ends included)."""
    rng = random.Random(0)
    lengths = [1, 60] + [rng.randint(1, 60) for _ in range(38)]
    new_tokens = [30, 1] + [rng.randint(1, 30) for _ in range(38)]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]
    return prompts, [SamplingParams(max_new_tokens=n, temperature=0) for n in new_tokens]


@pytest.fixture(scope="module")
def alone(model, workload):
    """Each request generated in a fresh engine of its own."""
    prompts, params = workload
    return [Engine(model, max_batch=1, max_seq_len=MAX_SEQ_LEN).generate([p], sp)[0].token_ids
            for p, sp in zip(prompts, params)]


def check_bookkeeping(engine: Engine) -> None:
    """Slots and blocks are held exactly by the running requests: nothing leaks, nothing is shared."""
    sched = engine.scheduler
    slots = [s.slot for s in sched.running]
    assert len(set(slots)) == len(slots)
    assert sorted(slots + list(sched.free_slots)) == list(range(engine.max_batch))
    for bm in engine.block_managers:
        assert sorted(bm.tables) == sorted(s.request_id for s in sched.running)
        held = [b for s in sched.running for b in bm.tables[s.request_id] if b >= 0]
        assert len(set(held)) == len(held), "a block is owned by two sequences"
        assert bm.used == len(held)
        assert sorted(held + list(bm.free)) == list(range(bm.num_blocks))
        assert bm.reserved == sum(bm.peak_blocks(s.max_length) for s in sched.running) <= bm.num_blocks


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_continuous_batching_of_40_requests(model, workload, alone, kv_cache):
    prompts, params = workload
    max_batch = 8
    engine = Engine(model, max_batch=max_batch, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache, block_size=BLOCK_SIZE)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs, peak, steps = {}, 0, 0
    while engine.has_unfinished():
        finished = engine.step()
        steps += 1
        running = engine.scheduler.running
        peak = max(peak, len(running) + len(finished))
        for out in finished:
            outputs[out.request_id] = out
            assert all(s.request_id != out.request_id for s in running), "finished request still running"
        check_bookkeeping(engine)
        if engine.scheduler.waiting:  # admission filled every slot this step (finished ones freed theirs after)
            assert len(running) + len(finished) == max_batch
    assert peak == max_batch
    assert steps < sum(sp.max_new_tokens for sp in params)  # requests really shared steps
    assert sorted(outputs) == sorted(ids)
    for i, (rid, sp) in enumerate(zip(ids, params)):
        out = outputs[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == sp.max_new_tokens
        assert out.token_ids == alone[i], f"request {i} (prompt {len(prompts[i])}, new {sp.max_new_tokens}) differs from alone"
    assert len({t for toks in alone for t in toks}) > 20  # varied output: equality above means something
    # everything returned at once
    assert len(engine.scheduler.free_slots) == max_batch and not engine.scheduler.running
    assert all(bm.used == 0 and bm.reserved == 0 for bm in engine.block_managers)
    assert engine.cache_bytes_in_use() == 0


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_finished_request_frees_its_slot_for_the_next_step(model, kv_cache):
    engine = Engine(model, max_batch=2, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache, block_size=BLOCK_SIZE)
    short = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0))
    engine.add_request([4, 5, 6, 7], SamplingParams(max_new_tokens=20, temperature=0))
    third = engine.add_request([8, 9], SamplingParams(max_new_tokens=5, temperature=0))
    engine.step()  # both admitted; each gets its prefill token and one decode token
    assert [s.request_id for s in engine.scheduler.waiting] == [third]
    finished = engine.step()
    assert [o.request_id for o in finished] == [short]  # 3 tokens: done on step 2
    for bm in engine.block_managers:
        long_seq = engine.scheduler.running[0]
        assert bm.used == bm.held(long_seq) == len(bm.tables[long_seq.request_id])
    assert len(engine.scheduler.free_slots) == 1
    engine.step()
    assert third in [s.request_id for s in engine.scheduler.running]  # admitted on the very next step
    while engine.has_unfinished():
        engine.step()
    check_bookkeeping(engine)
    assert len(engine.scheduler.free_slots) == 2


def test_paged_pool_for_two_requests_completes_ten(model):
    max_seq_len, block_size = 64, BLOCK_SIZE
    block_bytes = zoo.cache_bytes(model, seq_len=block_size)
    budget = 2 * (max_seq_len // block_size) * block_bytes  # room for two full-length requests
    engine = Engine(model, max_batch=8, max_seq_len=max_seq_len, kv_cache="paged", block_size=block_size,
                    cache_budget_bytes=budget)
    assert [bm.num_blocks for bm in engine.block_managers] == [2 * max_seq_len // block_size]
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(40)] for _ in range(10)]
    params = SamplingParams(max_new_tokens=24, temperature=0)  # 40 + 24 - 1 cached tokens: 8 blocks each
    for p in prompts:
        engine.add_request(p, params)
    done, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        running = len(engine.scheduler.running)
        assert running <= 2
        peak = max(peak, running)
        check_bookkeeping(engine)
    assert peak == 2 and len(done) == 10
    for rid, p in zip(sorted(done), prompts):
        alone = Engine(model, max_batch=1, max_seq_len=max_seq_len).generate([p], params)[0]
        assert done[rid].token_ids == alone.token_ids


# ---- metrics -----------------------------------------------------------------------------------------


def test_request_metrics(model):
    engine = Engine(model, max_batch=4, max_seq_len=MAX_SEQ_LEN)
    new_tokens = [1, 2, 7, 15]
    outputs = engine.generate([[1] * 5, [2] * 9, [3] * 2, [4] * 30],
                              [SamplingParams(max_new_tokens=n, temperature=0) for n in new_tokens])
    for out, n in zip(outputs, new_tokens):
        m = out.metrics
        assert len(out.token_ids) == n
        assert m.ttft > 0 and m.e2e >= m.ttft
        assert len(m.itl) == n - 1
        assert all(gap >= 0 for gap in m.itl)
        assert math.isclose(sum(m.itl), m.e2e - m.ttft, rel_tol=1e-9, abs_tol=1e-12)
        if n > 1:
            assert math.isclose(m.tpot, (m.e2e - m.ttft) / (n - 1), rel_tol=1e-9)
            assert m.tpot > 0
        else:
            assert m.tpot == 0.0
    # decode steps were recorded with their batch sizes (4 requests; the 1-token one finishes in prefill)
    assert engine.decode_stats.batch_sizes[0] == 3
    assert sum(engine.decode_stats.batch_sizes) == sum(n - 1 for n in new_tokens)


def test_request_metrics_from_token_times():
    m = RequestMetrics.of(10.0, [10.5, 10.7, 11.0, 11.6])
    assert m.ttft == pytest.approx(0.5) and m.e2e == pytest.approx(1.6)
    assert m.itl == pytest.approx([0.2, 0.3, 0.6])
    assert m.tpot == pytest.approx(1.1 / 3)


def test_summarize_uses_vllm_names_and_values(model):
    engine = Engine(model, max_batch=4, max_seq_len=MAX_SEQ_LEN)
    outputs = engine.generate([[1, 2], [3, 4, 5], [6] * 10, [7] * 4, [9]],
                              [SamplingParams(max_new_tokens=n, temperature=0) for n in (5, 1, 8, 3, 12)])
    duration = 2.0
    summary = summarize(outputs, duration)
    for name in ("Mean TTFT (ms)", "Median TPOT (ms)", "P99 ITL (ms)", "Mean E2EL (ms)",
                 "Output token throughput (tok/s)", "Request throughput (req/s)"):
        assert name in summary, name
    expected = {f"{stat} {metric} (ms)" for stat in ("Mean", "Median", "P99") for metric in ("TTFT", "TPOT", "ITL", "E2EL")}
    assert set(summary) == expected | {"Output token throughput (tok/s)", "Request throughput (req/s)"}
    assert summary["Output token throughput (tok/s)"] == pytest.approx(29 / duration)
    assert summary["Request throughput (req/s)"] == pytest.approx(5 / duration)
    assert summary["Mean TTFT (ms)"] == pytest.approx(1000 * statistics.fmean(o.metrics.ttft for o in outputs))
    tpots = [o.metrics.tpot for o in outputs if len(o.token_ids) > 1]  # one-token outputs have no TPOT
    assert summary["Median TPOT (ms)"] == pytest.approx(1000 * statistics.median(tpots))
    itls = [g for o in outputs for g in o.metrics.itl]
    assert len(itls) == 29 - 5
    assert summary["P99 ITL (ms)"] == pytest.approx(1000 * float(np.percentile(itls, 99)))
    assert summary["Mean E2EL (ms)"] == pytest.approx(1000 * statistics.fmean(o.metrics.e2e for o in outputs))


def test_percentile_matches_numpy():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch", ["gqa", "swa", "mla", "cla", "hybrid-1in6", "mamba"])
def test_the_pool_size_checked_before_allocating_is_the_size_allocated(arch, kv_cache):
    """The bytes an Engine checks against the device's memory are exactly the bytes its pool then allocates."""
    from harness.engine.cache_pool import pool_bytes, size_cache

    model = zoo.build(arch, preset="tiny")
    engine = Engine(model, max_batch=3, max_seq_len=40, kv_cache=kv_cache, block_size=8)
    specs = model.cache_specs()
    batch, blocks = size_cache(specs, engine.dtype, kv_cache, 3, 40, 8, None, None)
    assert pool_bytes(specs, engine.dtype, kv_cache, batch, 40, 8, blocks) == engine.pool.allocated_bytes


def test_a_cache_larger_than_memory_is_refused_before_allocating():
    model = zoo.build("gqa", preset="tiny")
    with pytest.raises(ValueError, match="more than this cpu device's"):
        Engine(model, max_batch=2**40)
    with pytest.raises(ValueError, match="more than this cpu device's"):
        Engine(model, kv_cache="paged", num_blocks=2**63)
