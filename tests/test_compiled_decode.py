"""Engine(compile=True): the fixed-shape compiled decode step gives what the eager step gives."""
import pytest
import torch

from harness import Engine
from zoo.registry import architectures, is_causal
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_compiled_decode_equals_eager(kv_cache):
    model = random_model("gqa")
    prompts = make_prompts([5, 19, 11], model.config.vocab_size)
    params = greedy(8)
    eager = Engine(model, max_batch=3, max_seq_len=48, kv_cache=kv_cache, block_size=8).generate(prompts, params)
    compiled = Engine(model, max_batch=3, max_seq_len=48, kv_cache=kv_cache, block_size=8, compile=True).generate(prompts, params)
    for got, want in zip(compiled, eager):
        assert_not_constant(want.token_ids)
        assert_same_output(got, want, context=f"compiled {kv_cache}")


@pytest.mark.parametrize("arch,settings", [
    ("hybrid", {"layers": "mla,swa", "window": 12}), ("cla", {}),
    ("hybrid", {"layers": "mamba,mamba2,linear", "n_layers": 3}),
])
def test_compiled_decode_equals_eager_for_latent_rolling_shared_and_state_caches(arch, settings):
    model = random_model(arch, **settings)
    prompts = make_prompts([5, 19], model.config.vocab_size)
    params = greedy(8)
    eager = Engine(model, max_batch=2, max_seq_len=40).generate(prompts, params)
    compiled = Engine(model, max_batch=2, max_seq_len=40, compile=True).generate(prompts, params)
    for got, want in zip(compiled, eager):
        assert_not_constant(want.token_ids)
        assert_same_output(got, want, context=f"compiled {arch}")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_compiled_quantized_decode_equals_eager(scheme):
    """A weight-quantized fp32 model's compiled step (the C GEMV as a custom op, no graph break) gives the eager
    step's tokens; with an int8 KV cache too."""
    import zoo
    model = zoo.quantize(random_model("gqa"), weights=scheme, group_size=32)
    prompts = make_prompts([5, 19], model.config.vocab_size)
    params = greedy(8)
    for kv_dtype in ("auto", "int8"):
        eager = Engine(model, max_batch=2, max_seq_len=40, kv_dtype=kv_dtype).generate(prompts, params)
        compiled = Engine(model, max_batch=2, max_seq_len=40, kv_dtype=kv_dtype, compile=True).generate(prompts, params)
        for got, want in zip(compiled, eager):
            assert_not_constant(want.token_ids)
            assert_same_output(got, want, context=f"compiled {scheme} kv {kv_dtype}")


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_compiled_decode_compiles_once_across_context_lengths(kv_cache):
    """Shapes of a compiled step do not depend on the lengths: one compilation serves every context at a batch size."""
    from torch._dynamo.utils import counters

    model = random_model("gqa")
    engine = Engine(model, max_batch=1, max_seq_len=64, kv_cache=kv_cache, block_size=8, compile=True)
    engine.generate(make_prompts([3], model.config.vocab_size), greedy(4))
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1
    for length in (9, 17, 40):  # contexts that cross block boundaries, decoded one after another
        engine.generate(make_prompts([length], model.config.vocab_size), greedy(6))
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch", [name for name in architectures() if is_causal(name)])
def test_decode_step_traces_as_one_graph(arch, kv_cache):
    """A graph break inside the layer loop makes dynamo compile each layer's frame on its own, guarded on that
    layer's weights: past its recompile limit (8) the remaining layers run eager, and the compiled step is slower."""
    model = random_model(arch)
    engine = Engine(model, max_batch=2, max_seq_len=40, kv_cache=kv_cache, block_size=8)
    calls = []
    engine.runner.decode_forward = lambda *args: calls.append(args) or model(*args)  # the step's real arguments
    engine.generate(make_prompts([5, 11], model.config.vocab_size), greedy(2))
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(model)(*calls[0])
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(reason.reason) for reason in explained.break_reasons]
    assert explained.graph_count == 1
