"""Architectures whose layers keep a bounded set of positions, run far past their bound through the engine: what
stays in the cache, what goes back to the pool, and that the answers equal the uncached forward."""
import torch

import zoo
from harness import Engine
from helpers import greedy, make_prompts, random_model  # tests/ is on sys.path under pytest


def run_paged(model, prompt_len: int, new_tokens: int, block_size: int):
    """One greedy request through a paged engine; yields after every step (the engine and the request's id)."""
    engine = Engine(model, max_batch=1, max_seq_len=prompt_len + new_tokens, kv_cache="paged", block_size=block_size)
    request = engine.add_request(make_prompts([prompt_len], model.config.vocab_size)[0], greedy(new_tokens))
    while engine.has_unfinished():
        engine.step()
        yield engine, request


def test_sink_blocks_stay_and_the_rest_outside_the_window_return():
    """Sinks 4 + window 16 in 4-token blocks, run 200 tokens past the window: block 0 (the sinks) is never freed,
    every block wholly between the sinks and the window is, and the cache holds sinks + window tokens' bytes."""
    sinks, window, block_size = 4, 16, 4
    model = random_model("sink", sinks=sinks, window=window, n_layers=2)
    bound = zoo.cache_bytes(model, seq_len=sinks + window)
    steps = 0
    for engine, request in run_paged(model, 10, window + 200, block_size):
        (manager,) = engine.block_managers
        seq = engine.unfinished.get(request)
        if seq is None:
            break
        length, table = seq.num_cached, manager.tables[request]
        assert table[0] >= 0, f"the sink block was freed at length {length}"
        first_in_window = max(0, length - window) // block_size
        assert all(block == -1 for block in table[1:first_in_window]), f"a block outside the window kept at {length}"
        assert all(block >= 0 for block in table[max(1, first_in_window):])
        assert manager.used == manager.held(seq) <= 1 + (window - 1) // block_size + 2
        if length >= sinks + window:
            assert zoo.cache_bytes(model, seq_len=length) == bound  # constant once past sinks + window
        steps += 1
    assert steps >= 200 and manager.used == 0


def test_chunked_cache_is_bounded_by_one_chunk():
    chunk, block_size = 16, 4
    model = random_model("chunked", chunk=chunk)
    per_token = zoo.cache_bytes(model, seq_len=1)
    assert max(zoo.cache_bytes(model, seq_len=n) for n in range(1, 200)) == chunk * per_token
    assert zoo.cache_bytes(model, seq_len=chunk + 1) == per_token  # a new chunk starts from its own first token
    contiguous = Engine(model, max_batch=2, max_seq_len=300).cache_bytes_allocated
    assert contiguous == 2 * chunk * per_token  # a ring of one chunk per slot, whatever max_seq_len
    for engine, request in run_paged(model, 7, 60, block_size):
        (manager,) = engine.block_managers
        assert manager.used <= chunk // block_size


def test_bounded_architectures_decode_equals_full_forward_far_past_their_bound():
    """Cached decode (paged and contiguous) equals the uncached forward's next-token logits 100 tokens past the bound."""
    for name, settings in (("sink", dict(sinks=3, window=9)), ("chunked", dict(chunk=12))):
        model = random_model(name, **settings)
        prompt = make_prompts([5], model.config.vocab_size, seed=3)[0]
        for kv_cache in ("paged", "contiguous"):
            engine = Engine(model, max_batch=1, max_seq_len=130, kv_cache=kv_cache, block_size=4)
            (out,) = engine.generate([prompt], greedy(110))
            tokens = torch.tensor([prompt + out.token_ids[:-1]])
            with torch.no_grad():
                full = model(tokens)[0, len(prompt) - 1:]
            torch.testing.assert_close(torch.stack(out.logits), full, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{name} {kv_cache}: {m}")
