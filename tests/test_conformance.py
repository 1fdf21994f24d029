"""The shared conformance suite: every registered architecture, through every KV layout.

cached decode == full forward, batched == alone, paged == contiguous, measured cache bytes == analytic.
A new registry entry is picked up here without editing this file.
"""
import copy

import pytest
import torch

import zoo
from harness import Engine, SamplingParams
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest

# Causal architectures only: a masked diffusion LM (non-causal) has no one-token decode for the engine to run;
# its cached path is held against its full forward in tests/test_diffusion_model.py.
ARCHS = [name for name in zoo.architectures() if zoo.registry.is_causal(name)]
LAYOUTS = ("contiguous", "paged")
BLOCK_SIZE = 8  # small blocks so short prompts already span several of them
MAX_SEQ_LEN = 96
ATOL = 1e-4


def engine_for(model, kv_cache: str, max_batch: int, **kwargs) -> Engine:
    kwargs.setdefault("max_seq_len", MAX_SEQ_LEN)
    if kv_cache == "paged":
        kwargs.setdefault("block_size", BLOCK_SIZE)
    return Engine(model, max_batch=max_batch, kv_cache=kv_cache, **kwargs)


# models made by surgery on a registry model (zoo.prune, zoo.convert): their configs hold per-layer sizes and mixed
# mixers no registry entry builds, and they must meet the same contract
SURGERY = {
    "gqa-pruned": lambda: zoo.prune(random_model("gqa", n_layers=3), zoo.PrunePlan(
        (0, 2), kv_heads={0: (1,)}, channels={0: tuple(range(0, 192, 2)), 2: tuple(range(100))},
        embedding=tuple(range(0, 64, 2)))),
    "hybrid-pruned": lambda: zoo.prune(random_model("hybrid", layers="gqa,gdn"), zoo.PrunePlan(
        (0, 1), kv_heads={0: (1,)}, state_heads={1: (0, 2)})),
    "mha-to-gqa": lambda: zoo.convert(random_model("mha"), "gqa", kv_heads=2),
    "gqa-to-gdn": lambda: zoo.convert(random_model("gqa", n_layers=3), "gdn", layers=[1]),
    "gqa-to-mla": lambda: zoo.convert(random_model("gqa"), "mla", kv_rank=8, layers=[1], calibration=torch.randint(
        0, 256, (4, 16), generator=torch.Generator().manual_seed(0))),
}


@pytest.fixture(params=ARCHS + list(SURGERY))
def arch_name(request) -> str:
    return request.param


@pytest.fixture
def model(arch_name):
    if arch_name in SURGERY:
        return SURGERY[arch_name]()
    return random_model(arch_name, seed=ARCHS.index(arch_name))


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_cached_decode_matches_full_forward(model, arch_name, kv_cache):
    """Each step's logits within ATOL of the same weights' full forward in float64: the fp32 full forward is itself up
    to ~8e-5 from it (Mamba's scan), so against that the two paths' errors would add."""
    oracle = copy.deepcopy(model).double()
    prompts = make_prompts([1, 5, 8, 17, 33], model.config.vocab_size, seed=1)
    outputs = engine_for(model, kv_cache, max_batch=len(prompts)).generate(prompts, greedy(24))
    for prompt, out in zip(prompts, outputs):
        context = f"{arch_name}/{kv_cache} prompt len {len(prompt)}"
        assert_not_constant(out.token_ids, context)
        assert len(out.token_ids) == 24 and len(out.logits) == 24
        cached = torch.stack(out.logits)
        # greedy means each token is the argmax of the logits it was sampled from
        assert cached.argmax(-1).tolist() == out.token_ids, context
        sequence = prompt + out.token_ids[:-1]
        with torch.no_grad():
            full = oracle(torch.tensor([sequence]))[0, len(prompt) - 1 :]
        assert full.shape == cached.shape
        err = (full - cached.double()).abs().max().item()
        assert err <= ATOL, f"{context}: cached decode differs from the float64 full forward by {err:.3g}"


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_batch_of_mixed_lengths_equals_each_alone(model, arch_name, kv_cache):
    lengths = [3, 40, 11, 1, 26, 17]
    new_tokens = [16, 5, 20, 9, 12, 1]  # requests finish at different steps, the batch shrinks under the others
    prompts = make_prompts(lengths, model.config.vocab_size, seed=2)
    params = [greedy(n) for n in new_tokens]
    batched = engine_for(model, kv_cache, max_batch=len(prompts)).generate(prompts, params)
    assert [len(o.token_ids) for o in batched] == new_tokens
    assert_not_constant([t for o in batched for t in o.token_ids], arch_name)
    for prompt, p, out in zip(prompts, params, batched):
        alone = engine_for(model, kv_cache, max_batch=1).generate([prompt], p)[0]
        # the prompts are prefilled as one right-padded batch: a recurrence over other matrix shapes rounds fp32
        # differently (Mamba: batched and alone each within 7e-5 of the float64 forward, 1.05e-4 of each other)
        assert_same_output(out, alone, 2 * ATOL, f"{arch_name}/{kv_cache} prompt len {len(prompt)}")


def test_preempted_requests_equal_their_alone_runs(model, arch_name):
    """Optimistic admission into a pool too small for every request's worst case: the newest running requests are
    preempted and recomputed, and every output (greedy, and a seeded sampled one) equals its run alone."""
    prompts = make_prompts([5, 17, 33, 9, 26], model.config.vocab_size, seed=4)
    params = [greedy(24)] * 4 + [SamplingParams(max_new_tokens=24, temperature=0.8, seed=7)]
    managers = engine_for(model, "paged", max_batch=1).block_managers
    # two blocks over the smallest legal pool (the largest request alone): several requests start, then run out
    blocks = max([m.peak_blocks(len(p) + 23) for m in managers for p in prompts], default=1) + 2
    engine = engine_for(model, "paged", max_batch=5, num_blocks=blocks, admission="optimistic")
    outputs = engine.generate(prompts, params)
    if managers:  # a model made only of recurrent state has no blocks to run out of
        assert engine.preemptions > 0 and any(o.preemptions for o in outputs), arch_name
    for prompt, p, out in zip(prompts, params, outputs):
        alone = engine_for(model, "paged", max_batch=1).generate([prompt], p)[0]
        context = f"{arch_name} prompt len {len(prompt)}, preempted {out.preemptions} times"
        if p.greedy:
            assert_same_output(out, alone, ATOL, context)
        else:
            assert out.token_ids == alone.token_ids, context


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_whole_prefill(model, arch_name, kv_cache, budget):
    """A token budget per step: decodes first, prompt chunks in the rest, every mixer continuing a chunk from its
    cache (or state). Prompts longer than the budget and than the tiny preset's window are split over steps."""
    prompts = make_prompts([40, 3, 29, 1, 17], model.config.vocab_size, seed=5)
    params = [greedy(n) for n in (9, 14, 6, 11, 8)]
    whole = engine_for(model, kv_cache, max_batch=3).generate(prompts, params)
    chunked = engine_for(model, kv_cache, max_batch=3, max_num_batched_tokens=budget).generate(prompts, params)
    assert_not_constant([t for o in whole for t in o.token_ids], arch_name)
    for prompt, c, w in zip(prompts, chunked, whole):
        assert_same_output(c, w, ATOL, f"{arch_name}/{kv_cache} budget {budget}, prompt len {len(prompt)}")


@pytest.mark.parametrize("budget", [None, 7])
def test_prefix_caching_equals_no_prefix_caching(model, arch_name, budget):
    """Prompts sharing a 20-token prefix, one repeated whole and one a prefix of another, in two waves on one engine
    (the second finds the first's blocks cached, some evicted by then in the small pool): outputs equal an engine
    without prefix caching. A model with a recurrent state turns it off and says why."""
    vocab = model.config.vocab_size
    shared = make_prompts([20], vocab, seed=6)[0]
    suffixes = make_prompts([5, 14, 1, 9], vocab, seed=7)
    first = [shared + suffix for suffix in suffixes[:2]]
    second = [shared + suffixes[1], shared + suffixes[2], shared[:17], shared + suffixes[3] + suffixes[0]]
    params = greedy(12)
    plain = engine_for(model, "paged", max_batch=1)
    cached = engine_for(model, "paged", max_batch=2, prefix_caching=True, max_num_batched_tokens=budget,
                        num_blocks=14, admission="optimistic")
    for wave in (first, second):
        want = [plain.generate([prompt], params)[0] for prompt in wave]
        for prompt, got, alone in zip(wave, cached.generate(wave, params), want):
            assert_same_output(got, alone, ATOL, f"{arch_name} prefix caching, prompt len {len(prompt)}")
    if cached.prefix_caching_off:
        assert "recurrent state" in cached.prefix_caching_off and cached.prefix_cache_hit_rate == 0.0
    else:  # windows too: a prefill under prefix caching writes and caches its whole prompt
        assert cached.prefix_cache_hit_rate > 0.3, arch_name


def test_paged_equals_contiguous(model, arch_name):
    prompts = make_prompts([2, 9, 16, 31, 45], model.config.vocab_size, seed=3)
    params = greedy(30)
    contiguous = engine_for(model, "contiguous", max_batch=3).generate(prompts, params)
    paged = engine_for(model, "paged", max_batch=3).generate(prompts, params)
    for prompt, c, p in zip(prompts, contiguous, paged):
        assert_not_constant(c.token_ids, arch_name)
        assert_same_output(p, c, ATOL, f"{arch_name} paged vs contiguous, prompt len {len(prompt)}")


def test_contiguous_cache_bytes_equal_analytic(model):
    engine = engine_for(model, "contiguous", max_batch=3, max_seq_len=48)
    assert engine.cache_bytes_allocated == zoo.cache_bytes(model, seq_len=48, batch=3)
    assert engine.cache_bytes_allocated > 0
    # a budget of 2.5 rows caps the batch at 2 rows, and the allocation follows
    row = zoo.cache_bytes(model, seq_len=48)
    capped = engine_for(model, "contiguous", max_batch=8, max_seq_len=48, cache_budget_bytes=row * 5 // 2)
    assert capped.max_batch == 2
    assert capped.cache_bytes_allocated == zoo.cache_bytes(model, seq_len=48, batch=2)


def test_measured_cache_grows_with_context_exactly_as_analytic(model):
    """A KV cache grows per token up to the most its retention keeps (a window, sinks + window, one chunk); a
    recurrent state does not grow at all. Each layer's allocation holds its peak: the most any length up to n needs."""
    sizes = {n: engine_for(model, "contiguous", max_batch=2, max_seq_len=n).cache_bytes_allocated for n in (24, 48, 96)}
    dtype = next(model.parameters()).dtype
    peak = {n: 2 * sum(max(spec.bytes(t, dtype) for t in range(n + 1)) for spec in model.cache_specs()) for n in sizes}
    for a, b in ((24, 48), (48, 96)):
        assert sizes[b] - sizes[a] == peak[b] - peak[a]


def test_contiguous_cache_bytes_in_use_count_whole_rows(model):
    engine = engine_for(model, "contiguous", max_batch=4, max_seq_len=48)
    for prompt in make_prompts([5, 12], model.config.vocab_size, seed=4):
        engine.add_request(prompt, greedy(10))
    assert engine.cache_bytes_in_use() == 0
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert engine.cache_bytes_in_use() == zoo.cache_bytes(model, seq_len=48, batch=2)


def test_paged_cache_bytes_track_analytic(model, arch_name):
    max_batch, max_seq_len = 4, 64
    engine = engine_for(model, "paged", max_batch=max_batch, max_seq_len=max_seq_len)
    managers, pool = engine.block_managers, engine.pool
    block_bytes = [pool.block_bytes(g) for g in range(len(managers))]
    # one block of every group and one state slot: the analytic cost of BLOCK_SIZE tokens (every window is wider)
    assert sum(block_bytes) + pool.state_slot_bytes == zoo.cache_bytes(model, seq_len=BLOCK_SIZE) > 0
    # each group's pool holds max_batch requests at their peak, and the tensors are exactly that many blocks
    for manager in managers:
        assert manager.num_blocks == max_batch * manager.peak_blocks(max_seq_len)
    assert engine.cache_bytes_allocated == (sum(m.num_blocks * b for m, b in zip(managers, block_bytes))
                                            + max_batch * pool.state_slot_bytes)
    if all(m.retention.keeps_all for m in managers):
        assert engine.cache_bytes_allocated == zoo.cache_bytes(model, seq_len=max_seq_len, batch=max_batch)
    # a bounded sequence's blocks may be part-filled at both ends of its span (and its last sink block), a full
    # one's at its end only
    edges = lambda r: 1 if r.keeps_all else 2 + bool(r.sinks)  # noqa: E731
    waste = sum(edges(m.retention) * b for m, b in zip(managers, block_bytes))

    lengths, new_tokens = [1, 7, 8, 9, 30, 50], [20, 12, 1, 17, 25, 14]
    for prompt, n in zip(make_prompts(lengths, model.config.vocab_size, seed=5), new_tokens):
        engine.add_request(prompt, greedy(n))
    assert engine.cache_bytes_in_use() == 0
    checked = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        analytic = sum(zoo.cache_bytes(model, seq_len=s.num_cached) for s in running)
        in_use = engine.cache_bytes_in_use()
        assert all(s.num_cached > 0 for s in running)
        assert in_use >= analytic, f"{arch_name}: {in_use} B in use < {analytic} B the cached tokens need"
        if running:
            assert in_use - analytic < len(running) * waste or in_use == analytic, (
                f"{arch_name}: {in_use} B in use wastes more than part-filled edge blocks (analytic {analytic} B)"
            )
        assert in_use == sum(m.used * b for m, b in zip(managers, block_bytes)) + len(running) * pool.state_slot_bytes
        checked += bool(running)
    assert checked > 5
    assert engine.cache_bytes_in_use() == 0 and all(m.used == 0 and m.reserved == 0 for m in managers)
