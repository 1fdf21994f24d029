"""A dilated sliding window (W keys, every r-th: a span of (W-1)·r + 1 positions) through the whole engine: the cache
holds the span, the query sees W keys, and every path (contiguous ring, paged blocks, chunked prefill, speculative
verification, the compiled step) equals the uncached forward, which the float64 oracle checks on its own
(tests/test_reference_oracle.py)."""
import pytest
import torch

import zoo
from harness import Engine, SpeculativeConfig
from harness.roofline import decode_step_cost
from helpers import greedy, make_prompts, random_model  # tests/ is on sys.path under pytest

WINDOW, DILATION = 4, 3
SPAN = (WINDOW - 1) * DILATION + 1  # 10 positions held, 4 seen


def dilated_model(**overrides):
    return random_model("dilated", window=WINDOW, dilation=DILATION, **overrides)


def full_forward_logits(model, prompt, out):
    tokens = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        return model(tokens)[0, len(prompt) - 1:]


def test_a_query_sees_every_rth_key_of_its_span():
    """The mask the layer applies, against the definition: key p is seen from q iff q - p = j·r for j < W."""
    model = dilated_model(n_layers=1)
    retention = model.cache_specs()[0].retention
    assert (retention.window, retention.dilation, retention.span) == (WINDOW, DILATION, SPAN)
    positions = torch.arange(40)
    mask = retention.visible(positions[None, :], positions[:, None])
    for q in range(40):
        want = {q - j * DILATION for j in range(WINDOW) if q - j * DILATION >= 0}
        assert set(positions[mask[q]].tolist()) == want


def test_the_cache_holds_exactly_the_span():
    model = dilated_model()
    per_token = zoo.cache_bytes(model, seq_len=1)
    assert [zoo.cache_bytes(model, seq_len=n) for n in (5, SPAN, SPAN + 1, 200)] == [
        5 * per_token, SPAN * per_token, SPAN * per_token, SPAN * per_token]
    # the contiguous layout is a ring of exactly the span per slot, whatever max_seq_len
    assert Engine(model, max_batch=3, max_seq_len=300).cache_bytes_allocated == 3 * SPAN * per_token
    # a decode step reads only the W keys its query sees
    assert zoo.cache_read_bytes(model, seq_len=200) == WINDOW * per_token


def test_paged_blocks_outside_the_span_return_to_the_pool():
    model = dilated_model(n_layers=1)
    block_size = 2
    engine = Engine(model, max_batch=1, max_seq_len=120, kv_cache="paged", block_size=block_size)
    request = engine.add_request(make_prompts([7], model.config.vocab_size)[0], greedy(100))
    (manager,) = engine.block_managers
    lengths = []
    while engine.has_unfinished():
        engine.step()
        seq = engine.unfinished.get(request)
        if seq is None:
            break
        length, table = seq.num_cached, manager.tables[request]
        first_held = max(0, length - SPAN) // block_size
        assert all(block == -1 for block in table[:first_held]), f"a block before the span kept at {length}"
        assert all(block >= 0 for block in table[first_held:])
        assert manager.used <= -(-SPAN // block_size) + 1
        lengths.append(length)
    assert max(lengths) > 5 * SPAN and manager.used == 0


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_decode_far_past_the_span_equals_the_full_forward(kv_cache, chunked):
    """A 23-token prompt (prefilled whole, or in 5-token chunks on top of the ring) and 60 decoded tokens."""
    model = dilated_model()
    prompts = make_prompts([23, 4], model.config.vocab_size, seed=3)
    engine = Engine(model, max_batch=2, max_seq_len=90, kv_cache=kv_cache, block_size=4,
                    max_num_batched_tokens=6 if chunked else None)
    for prompt, out in zip(prompts, engine.generate(prompts, greedy(60))):
        torch.testing.assert_close(torch.stack(out.logits), full_forward_logits(model, prompt, out),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_speculative_verification_over_the_ring_keeps_greedy_tokens(kv_cache):
    """Prompt-lookup drafts, 3 tokens verified a step: a ring's rejected writes roll back, tokens equal plain greedy."""
    model = dilated_model()
    prompt = make_prompts([12], model.config.vocab_size, seed=5)[0] * 2  # repeats, so lookups propose something
    plain = Engine(model, max_batch=1, max_seq_len=80, kv_cache=kv_cache, block_size=4).generate([prompt], greedy(40))
    speculative = Engine(model, max_batch=1, max_seq_len=80, kv_cache=kv_cache, block_size=4,
                         speculative=SpeculativeConfig("prompt_lookup", num_speculative_tokens=3))
    assert speculative.generate([prompt], greedy(40))[0].token_ids == plain[0].token_ids


def test_the_roofline_counts_seen_keys_for_flops_and_held_keys_for_memory():
    """Against a plain window of W keys: the same attention FLOPs and cache read per step; a larger cache held."""
    dilated = dilated_model()
    plain = random_model("swa", window=WINDOW)
    context = 100
    a, b = decode_step_cost(dilated, 1, context), decode_step_cost(plain, 1, context)
    assert a.flops == b.flops and a.cache_read_bytes == b.cache_read_bytes
    assert zoo.cache_bytes(dilated, seq_len=context) == SPAN / WINDOW * zoo.cache_bytes(plain, seq_len=context)


def test_bad_dilation_is_refused_before_building():
    with pytest.raises(ValueError, match="dilation"):
        zoo.make_config("dilated", preset="tiny", dilation=0)
    with pytest.raises(ValueError, match="no sinks or chunk"):
        zoo.build(zoo.ModelConfig(vocab_size=64, d_model=32, mlp_hidden=64, layers=[
            zoo.MixerSpec("attention", {"n_heads": 2, "window": 4, "sinks": 2, "dilation": 2})]))
