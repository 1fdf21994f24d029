"""The roofline knows routing: a decode step's weight bytes count the experts its batch was routed to (measured per
step as the union over the batch, read back after the steps), a uniform router's expectation E (1 - (1 - k/E)^B)
matches an enumeration, and FLOPs count the top_k experts each token applies."""
import itertools
import math

import pytest
import torch

import zoo
from harness import Engine, roofline
from helpers import greedy, make_prompts, random_model


@pytest.mark.parametrize("n_experts, top_k, tokens", [(4, 1, 1), (4, 2, 2), (5, 2, 3), (6, 3, 2), (8, 2, 1)])
def test_uniform_expectation_equals_an_enumeration(n_experts, top_k, tokens):
    """Every way `tokens` tokens can each pick top_k of n_experts, equally likely: the mean size of the union."""
    choices = list(itertools.combinations(range(n_experts), top_k))
    unions = [len(set().union(*picks)) for picks in itertools.product(choices, repeat=tokens)]
    assert zoo.expected_experts_read(n_experts, top_k, tokens) == pytest.approx(sum(unions) / len(unions))


def expert_bytes(moe) -> int:
    return sum(p.nbytes for p in moe.experts.parameters()) // moe.n_experts


def test_a_decode_step_counts_the_experts_its_batch_read():
    """Three requests decoded together: the steps' unions are recorded by a hook beside the engine's own counters,
    and the floor's weight bytes are the non-expert weights plus exactly the read experts' bytes."""
    model = random_model("moe", seed=3)
    layers = zoo.moe_layers(model)
    seen = {i: [] for i in layers}

    def record(i):
        def hook(module, args, output):
            batch = args[1] if len(args) > 1 else None
            if batch is not None and batch.is_decode:
                seen[i].append(len(set(module.routed_tokens.nonzero().flatten().tolist())))
        return hook

    hooks = [moe.register_forward_hook(record(i)) for i, moe in layers.items()]
    engine = Engine(model, max_batch=3, max_seq_len=64)
    zoo.reset_decode_routing(model)
    engine.generate(make_prompts([5, 9, 7], model.config.vocab_size, seed=4), greedy(6))
    for hook in hooks:
        hook.remove()
    read = zoo.decode_experts_read(model)
    assert set(read) == set(layers) and all(seen[i] for i in layers)
    for i in layers:
        assert read[i] == pytest.approx(sum(seen[i]) / len(seen[i]))
        assert 2 <= read[i] <= 6  # top 2 of 8 for each of up to 3 tokens

    dtype = next(model.parameters()).dtype
    step = roofline.decode_step_cost(model, 3, 10, experts_read=read)
    every = zoo.decode_weight_bytes(model)
    want = every - sum((moe.n_experts - read[i]) * expert_bytes(moe) for i, moe in layers.items())
    assert step.weight_bytes == round(want) and dtype == torch.float32
    uniform = roofline.decode_step_cost(model, 3, 10)  # no measurement: a uniform router's expectation
    expected = zoo.expected_experts_read(8, 2, 3)
    assert uniform.weight_bytes == round(every - sum((8 - expected) * expert_bytes(m) for m in layers.values()))


def test_one_token_reads_top_k_experts_and_applies_them():
    model = random_model("moe", seed=1)
    layers = zoo.moe_layers(model)
    with torch.no_grad():
        model(torch.tensor([[7]]))
    routed = zoo.routed_experts(model)
    read = {i: float(len(ids)) for i, ids in routed.items()}
    assert all(count == 2 for count in read.values())
    step = roofline.decode_step_cost(model, 1, 0, experts_read=read)
    per_expert = [expert_bytes(moe) for moe in layers.values()]
    assert step.weight_bytes == zoo.decode_weight_bytes(model) - sum(6 * b for b in per_expert)
    assert roofline.decode_step_cost(model, 1, 0).flops == step.flops  # top_k experts per token, whichever they are
    active = zoo.parameter_counts(model).active - (0 if model.config.tie_embeddings else model.embed.weight.numel())
    total = roofline.weight_elements(model)
    assert total > 2 * active  # 8 experts of which a token applies 2: the two counts are far apart
    assert math.isclose(step.flops / 2, active, rel_tol=0.05)  # attention over one key adds little


def test_a_dense_model_is_unchanged():
    model = random_model("gqa", seed=0)
    step = roofline.decode_step_cost(model, 4, 16)
    assert step.weight_bytes == roofline.weight_elements(model) * 4
    assert zoo.moe_layers(model) == {} and zoo.decode_experts_read(model) == {}


def test_the_routed_counters_survive_a_compiled_step():
    """A compiled decode step (the gathered path) still counts its reads on the device."""
    model = random_model("moe", seed=2)
    engine = Engine(model, max_batch=2, max_seq_len=32, compile=True)
    engine.generate(make_prompts([4, 6], model.config.vocab_size, seed=1), greedy(4))
    zoo.reset_decode_routing(model)
    engine.generate(make_prompts([4, 6], model.config.vocab_size, seed=2), greedy(4))
    read = zoo.decode_experts_read(model)
    assert read and all(2 <= value <= 4 for value in read.values())
