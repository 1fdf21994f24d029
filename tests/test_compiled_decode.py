"""Engine(compile=True): the fixed-shape compiled decode step gives what the eager step gives."""
import pytest

from harness import Engine


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_compiled_decode_equals_eager(helpers, kv_cache):
    model = helpers.random_model("gqa")
    prompts = helpers.make_prompts([5, 19, 11], model.config.vocab_size)
    params = helpers.greedy(8)
    eager = Engine(model, max_batch=3, max_seq_len=48, kv_cache=kv_cache, block_size=8).generate(prompts, params)
    compiled = Engine(model, max_batch=3, max_seq_len=48, kv_cache=kv_cache, block_size=8, compile=True).generate(prompts, params)
    for got, want in zip(compiled, eager):
        helpers.assert_not_constant(want.token_ids)
        helpers.assert_same_output(got, want, context=f"compiled {kv_cache}")


@pytest.mark.parametrize("arch,settings", [
    ("hybrid", {"layers": "mla,swa", "window": 12}), ("cla", {}),
    ("hybrid", {"layers": "mamba,mamba2,linear", "n_layers": 3}),
])
def test_compiled_decode_equals_eager_for_latent_rolling_shared_and_state_caches(helpers, arch, settings):
    model = helpers.random_model(arch, **settings)
    prompts = helpers.make_prompts([5, 19], model.config.vocab_size)
    params = helpers.greedy(8)
    eager = Engine(model, max_batch=2, max_seq_len=40).generate(prompts, params)
    compiled = Engine(model, max_batch=2, max_seq_len=40, compile=True).generate(prompts, params)
    for got, want in zip(compiled, eager):
        helpers.assert_not_constant(want.token_ids)
        helpers.assert_same_output(got, want, context=f"compiled {arch}")


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_compiled_decode_compiles_once_across_context_lengths(helpers, kv_cache):
    """Shapes of a compiled step do not depend on the lengths: one compilation serves every context at a batch size."""
    from torch._dynamo.utils import counters

    model = helpers.random_model("gqa")
    engine = Engine(model, max_batch=1, max_seq_len=64, kv_cache=kv_cache, block_size=8, compile=True)
    engine.generate(helpers.make_prompts([3], model.config.vocab_size), helpers.greedy(4))
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    for length in (9, 17, 40):  # contexts that cross block boundaries, decoded one after another
        engine.generate(helpers.make_prompts([length], model.config.vocab_size), helpers.greedy(6))
    assert counters["stats"]["unique_graphs"] == compiled
