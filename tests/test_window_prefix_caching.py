"""Prefix caching with a sliding window, a shared prefix longer than the window: the second request finds the window's
blocks at the end of the shared prefix (a prefill writes and caches its whole prompt, as vLLM does for sliding-window
groups), and every output equals an engine without prefix caching."""
import pytest

from harness import Engine
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model

BLOCK_SIZE = 16
SHARED = 96  # six full blocks, longer than every window below


def engine(model, **kwargs) -> Engine:
    return Engine(model, max_batch=2, max_seq_len=160, kv_cache="paged", block_size=BLOCK_SIZE, **kwargs)


@pytest.mark.parametrize("window", [16, 32, 64])
@pytest.mark.parametrize("admission", ["reserve", "optimistic"])
def test_a_prefix_longer_than_the_window_is_found(window, admission):
    model = random_model("swa", seed=1, window=window)
    vocab = model.config.vocab_size
    shared = make_prompts([SHARED], vocab, seed=2)[0]
    prompts = [shared + suffix for suffix in make_prompts([7, 12, 3], vocab, seed=3)]
    params = greedy(10)
    plain = engine(model)
    cached = engine(model, prefix_caching=True, admission=admission)
    outputs = [cached.generate([prompt], params)[0] for prompt in prompts]  # one after another: the cache is warm
    assert_not_constant([t for o in outputs for t in o.token_ids], f"window {window}")
    for prompt, got in zip(prompts, outputs):
        assert_same_output(got, plain.generate([prompt], params)[0], 1e-4, f"window {window}, {len(prompt)} tokens")
    # the first request computes all; each later one finds the shared prefix's six full blocks
    assert [o.cached_tokens for o in outputs] == [0, SHARED, SHARED]
    assert cached.cache_bytes_in_use() == 0


def test_blocks_behind_the_window_go_back_after_the_prefill():
    """Writing the whole prompt costs room only during its prefill: a running request then holds its window's
    blocks, the rest are cached (evictable), not held."""
    window = 16
    model = random_model("swa", seed=1, window=window)
    cached = engine(model, prefix_caching=True)
    prompt = make_prompts([SHARED + 5], model.config.vocab_size, seed=4)[0]
    request = cached.add_request(prompt, greedy(3))
    cached.step()
    (manager,) = cached.block_managers
    held = manager.held(cached.unfinished[request])
    assert held <= manager.peak_blocks(window + 1) < -(-(SHARED + 5) // BLOCK_SIZE)
    assert len(manager.cache.evictable) >= SHARED // BLOCK_SIZE - held
