"""Optimistic admission and preemption (vLLM's recompute policy): the newest running request gives its blocks back,
waits at the front of the queue and is recomputed; the oldest always makes progress; nothing deadlocks."""
import pytest

from harness import Engine, SamplingParams
from helpers import assert_same_output, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest


def optimistic_engine(num_blocks: int, max_batch: int = 4) -> Engine:
    model = random_model("gqa", seed=0)
    return Engine(model, max_batch=max_batch, kv_cache="paged", block_size=8, max_seq_len=96, num_blocks=num_blocks,
                  admission="optimistic")


def test_newest_request_is_preempted_and_requeued_first():
    engine = optimistic_engine(num_blocks=8)
    prompts = make_prompts([16, 16, 16], engine.model.config.vocab_size, seed=1)
    ids = [engine.add_request(p, greedy(40)) for p in prompts]
    preempted_order = []
    while engine.has_unfinished():
        before = [s.request_id for s in engine.scheduler.running]
        engine.step()
        after = {s.request_id for s in engine.scheduler.running}
        preempted_order += [r for r in before if r not in after and r in {s.request_id for s in engine.scheduler.waiting}]
        for manager in engine.block_managers:  # free + held = pool after every step
            held = sum(manager.held(s) for s in engine.scheduler.running)
            assert len(manager.free) + held == manager.num_blocks
    assert engine.preemptions > 0 and preempted_order and ids[0] not in preempted_order  # the oldest never yields


def test_a_pool_sized_for_the_largest_request_still_admits_it_alone():
    """The watermark is waived when nothing runs: otherwise a request needing every block would wait forever."""
    engine = optimistic_engine(num_blocks=6, max_batch=2)
    prompt = make_prompts([40], engine.model.config.vocab_size, seed=2)[0]
    (out,) = engine.generate([prompt], greedy(8))  # 47 tokens = 6 blocks of 8: the whole pool
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_reserve_admission_never_preempts():
    engine = Engine(random_model("gqa", seed=0), max_batch=4, kv_cache="paged", block_size=8, max_seq_len=96,
                    num_blocks=8)
    prompts = make_prompts([16, 16, 16], engine.model.config.vocab_size, seed=1)
    outputs = engine.generate(prompts, [greedy(40)] * 3)
    assert engine.preemptions == 0 and all(o.preemptions == 0 for o in outputs)


@pytest.mark.parametrize("kwargs,message", [
    ({"admission": "eager"}, "unknown admission 'eager'; allowed: reserve, optimistic"),
    ({"admission": "optimistic", "kv_cache": "contiguous"}, "admission='optimistic' needs kv_cache='paged'"),
])
def test_bad_admission_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(random_model("gqa", seed=0), max_batch=2, **{"kv_cache": "paged", **kwargs})


def test_seeded_sampling_survives_preemption():
    """A sampled request's generator is not advanced by its recompute: the same tokens with or without preemption."""
    engine = optimistic_engine(num_blocks=8)
    prompts = make_prompts([16, 16, 16], engine.model.config.vocab_size, seed=3)
    params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=s) for s in (1, 2, 3)]
    outputs = engine.generate(prompts, params)
    assert any(o.preemptions for o in outputs)
    for prompt, p, out in zip(prompts, params, outputs):
        alone = Engine(engine.model, max_batch=1, kv_cache="paged", block_size=8, max_seq_len=96).generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids


def test_a_preempted_request_recomputes_its_recurrent_state():
    """A Mamba + attention hybrid: preemption frees the request's blocks and its state slot; the recompute rebuilds
    both, and the outputs equal the alone-runs."""
    model = random_model("hybrid", seed=3, layers="mamba,gqa")
    prompts = make_prompts([5, 17, 33, 9, 26], model.config.vocab_size, seed=4)
    engine = Engine(model, max_batch=5, kv_cache="paged", block_size=8, max_seq_len=96, num_blocks=9,
                    admission="optimistic")
    outputs = engine.generate(prompts, greedy(24))
    assert engine.preemptions > 0
    for prompt, out in zip(prompts, outputs):
        alone = Engine(model, max_batch=1, kv_cache="paged", block_size=8, max_seq_len=96).generate([prompt], greedy(24))[0]
        assert_same_output(out, alone, 1e-4, f"prompt len {len(prompt)}, preempted {out.preemptions} times")
