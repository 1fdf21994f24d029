"""Scored retention (H2O, TOVA): the engine's selection against the plain-Python one, a layer fed as the engine feeds
it against the float64 evicting reference, the engine's cache bytes and kept rows, and bad settings refused."""
import random

import pytest
import torch

import zoo
from attention import Attention
from attention.reference import evicting_attention_reference, kept_by_score
from cache import CacheBatch, Retention, ScoredKV
from cache.eviction import keep_mask
from harness import BeamSearchParams, Engine, SamplingParams
from zoo.eviction import pyramid_budgets

SCORED = [Retention(score="h2o", budget=3, sinks=1, window=2), Retention(score="tova", budget=4),
          Retention(score="h2o", budget=2, window=1), Retention(score="tova", budget=1, sinks=2, window=1),
          Retention(score="snapkv", budget=3, window=2)]


@pytest.mark.parametrize("retention", SCORED, ids=lambda r: r.describe())
def test_the_batched_selection_is_the_plain_one(retention):
    rng = random.Random(0)
    for _ in range(150):
        rows, batch = rng.randint(1, 12), 3
        positions, scores, lengths = torch.full((batch, rows), -1), torch.zeros(batch, rows), []
        for b in range(batch):
            held = rng.randint(0, rows)
            length = held + rng.randint(0, 3)
            for row, pos in zip(rng.sample(range(rows), held), rng.sample(range(max(length, 1)), held)):
                positions[b, row] = pos
                scores[b, row] = rng.choice([0.0, 0.25, 1.0, rng.random()])  # ties too: the older leaves first
            lengths.append(max(length, 1))
        kept = keep_mask(retention, scores, positions, torch.tensor(lengths))
        for b in range(batch):
            held = positions[b] >= 0
            expected = kept_by_score(retention, scores[b][held].tolist(), positions[b][held].tolist(), lengths[b])
            assert set(positions[b][kept[b]].tolist()) == expected


def scored_layer(score: str, budget: int, sinks: int, window: int | None, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    layer = Attention(32, 0, n_heads=4, n_kv_heads=2, score=score, budget=budget, sinks=sinks, window=window)
    for param in (layer.q_proj.weight, layer.k_proj.weight):  # peaked attention, so scores differ clearly
        param.data.normal_(0, 0.6)
    return layer.eval()


def feed_like_the_engine(layer: Attention, x: torch.Tensor, prompt_len: int, lengths: list[int]):
    """x [B, T, d]: each row's first prompt_len tokens as one prefill, then one token a step up to its length (rows
    end at different lengths, as a batch's sequences do); returns outputs [B, T, d] (0 past a row's length) and each
    row's kept positions after every step."""
    b, t, _ = x.shape
    cache = ScoredKV(layer.cache_spec(), b + 1, t, torch.float32, "cpu")
    slots = torch.arange(1, b + 1)  # not from slot 0: a slot is an index, not a row of the batch
    out = torch.zeros(b, t, x.shape[-1])
    kept = [[] for _ in range(b)]
    positions = torch.arange(prompt_len).expand(b, prompt_len)
    batch = CacheBatch(positions, torch.full((b,), prompt_len, dtype=torch.int32), prompt_len, "prefill", slots=slots)
    out[:, :prompt_len] = layer(x[:, :prompt_len], positions, cache, batch)
    capacity = layer.retention.capacity
    for row in range(b):
        kept[row].append(set(cache.kept_positions(int(slots[row]), min(prompt_len, capacity))))
    for step in range(prompt_len, t):
        rows = [row for row in range(b) if lengths[row] > step]
        if not rows:
            break
        live = torch.tensor(rows)
        batch = CacheBatch(torch.full((len(rows), 1), step), torch.full((len(rows),), step + 1, dtype=torch.int32),
                           step + 1, "decode", slots=slots[live])
        out[live, step] = layer(x[live, step:step + 1], batch.positions, cache, batch)[:, 0]
        for row in rows:
            kept[row].append(set(cache.kept_positions(int(slots[row]), min(step + 1, capacity))))
    return out, kept


@pytest.mark.parametrize("score,budget,sinks,window", [("h2o", 4, 1, 2), ("tova", 5, 0, None), ("h2o", 3, 2, None),
                                                       ("tova", 2, 1, 3), ("snapkv", 4, 0, 3), ("snapkv", 2, 1, 1)])
def test_decode_with_eviction_is_attention_over_the_kept_tokens(score, budget, sinks, window):
    layer = scored_layer(score, budget, sinks, window)
    lengths, prompt_len = [24, 19], 9
    x = torch.randn(2, max(lengths), 32)
    out, kept = feed_like_the_engine(layer, x, prompt_len, lengths)
    capacity = layer.retention.capacity
    for row, length in enumerate(lengths):
        expected, expected_kept = evicting_attention_reference(layer, x[row:row + 1, :length], prompt_len)
        assert kept[row] == expected_kept[0]  # token for token: the same keys stay after every step
        torch.testing.assert_close(out[row, :length].double(), expected[0], atol=1e-5, rtol=1e-5)
        assert all(len(s) == min(capacity, prompt_len + i) for i, s in enumerate(kept[row]))
        assert any(p not in kept[row][-1] for p in range(prompt_len, length))  # decode evicted tokens


def test_a_budget_the_sequence_never_fills_changes_nothing():
    layer = scored_layer("h2o", 40, 2, 4)
    x = torch.randn(1, 30, 32)
    out, kept = feed_like_the_engine(layer, x, 10, [30])
    plain = Attention(32, 0, n_heads=4, n_kv_heads=2).eval()
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(out, plain(x), atol=1e-5, rtol=1e-5)
    assert kept[0][-1] == set(range(30))


def scored_model(score: str, scored: int, sinks: int = 2, window: int = 4):
    torch.manual_seed(0)
    return zoo.evict(zoo.build("gqa", preset="tiny"), policy=score, budget=sinks + window + scored, sinks=sinks,
                     window=window).eval()


def test_the_engine_holds_budget_sinks_and_window_rows():
    model = scored_model("h2o", 6, sinks=2, window=4)
    engine = Engine(model, max_batch=2, max_seq_len=64)
    outputs = engine.generate([list(range(1, 21)), [5, 6, 7]], SamplingParams(max_new_tokens=20, temperature=0))
    assert all(len(o.token_ids) == 20 for o in outputs)
    capacity = 2 + 4 + 6
    token_bytes = model.cache_specs()[0].token_bytes(torch.float32)
    # measured = analytic: each slot's capacity rows and one spare, in every layer
    assert engine.pool.nbytes == 2 * (capacity + 1) * token_bytes * model.config.n_layers
    for layer in engine.pool.layers:
        for slot, total in ((0, 39), (1, 22)):  # prompt + 19 fed tokens (the last one is sampled, never fed)
            kept = layer.kept_positions(slot, capacity)
            assert len(kept) == capacity and kept[:2] == [0, 1] and kept[-4:] == list(range(total - 4, total))


def test_a_budget_no_request_fills_generates_what_full_attention_does():
    torch.manual_seed(0)
    plain = zoo.build("gqa", preset="tiny").eval()
    scored = zoo.evict(plain, policy="tova", budget=40)  # the longest request here is 20 tokens
    prompts, params = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]], SamplingParams(max_new_tokens=12, temperature=0)
    got = [o.token_ids for o in Engine(scored, max_batch=2, max_seq_len=64).generate(prompts, params)]
    assert got == [o.token_ids for o in Engine(plain, max_batch=2, max_seq_len=64).generate(prompts, params)]


@pytest.mark.parametrize("settings,message", [
    (dict(score="h2o", budget=0), "budget"),
    (dict(score="h2o", budget=-3), "budget"),
    (dict(score="lru", budget=4), "unknown retention score 'lru'"),
    (dict(budget=4), "give score"),
    (dict(score="tova", budget=4, chunk=8), "no chunk or dilation"),
    (dict(score="h2o", budget=4, window=0), "window"),
    (dict(score="snapkv", budget=4), "observation window"),
])
def test_bad_scored_retention_is_refused_with_its_value(settings, message):
    with pytest.raises(ValueError, match=message):
        Retention(**settings)


@pytest.mark.parametrize("options,message", [
    (dict(max_num_batched_tokens=8), "max_num_batched_tokens=8"),
    (dict(kv_cache="paged", kv_dtype="fp8"), "kv_dtype='fp8'"),
    (dict(kv_dtype="int8"), "kv_dtype='int8'"),
    (dict(cuda_graphs="static"), "host reads"),
    (dict(max_seq_len=10), "keeps 10 tokens a sequence, and max_seq_len=10"),
])
def test_the_engine_refuses_what_scored_retention_cannot_take(options, message):
    with pytest.raises(ValueError, match=message):
        Engine(scored_model("h2o", 4), **{"max_batch": 1, "max_seq_len": 64, **options})


@pytest.mark.parametrize("arch,message", [("mamba", "Mamba keeps recurrent state"), ("mla", "a .latent. cache"), ("swa", "keeps by position"),
                                          ("cla", "shares its cache")])
def test_a_model_with_nothing_to_evict_is_refused(arch, message):
    with pytest.raises(ValueError, match=message):
        zoo.evict(zoo.build(arch, preset="tiny"), policy="h2o", budget=16)


@pytest.mark.parametrize("settings,message", [
    (dict(policy="h2o", budget=8, sinks=2, window=6), "leave none of budget=8"),
    (dict(policy="snap", budget=8), "unknown policy 'snap'"),
    (dict(policy="tova", budget=0), "budget"),
    (dict(policy="tova", budget=8, schedule="cone"), "unknown schedule 'cone'"),
])
def test_bad_eviction_settings_are_refused_before_the_copy(settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.evict(zoo.build("gqa", preset="tiny"), **settings)


def test_eviction_changes_what_is_kept_not_the_weights():
    torch.manual_seed(0)
    model = zoo.build("hybrid-1in6", preset="tiny", n_layers=6).eval()
    evicted = zoo.evict(model, policy="h2o", budget=10)
    x = torch.randint(0, 512, (2, 24))
    torch.testing.assert_close(evicted(x), model(x))  # uncached, every key is kept
    kinds = [spec.retention.describe() for spec in evicted.cache_specs() if spec.elements_per_token]
    assert kinds == ["window 16"] * 5 + ["window 5 + h2o budget 5"]  # the attention layer only
    assert model.cache_specs()[5].retention.keeps_all  # the original is untouched


def test_the_pyramid_schedule_keeps_the_mean_budget():
    assert pyramid_budgets(40, 4) == [78, 53, 27, 2]  # 2·40 − 40/20 = 78 down to 40/20 = 2, sum 160
    model = zoo.evict(zoo.build("gqa", preset="tiny", n_layers=4), policy="tova", budget=40, schedule="pyramid")
    assert [spec.retention.capacity for spec in model.cache_specs()] == [78, 53, 27, 2]
    # the taper is of what the sinks and the window leave: each layer keeps those whole
    model = zoo.evict(zoo.build("gqa", preset="tiny", n_layers=4), policy="snapkv", budget=48, window=8,
                      schedule="pyramid")
    assert [spec.retention.capacity for spec in model.cache_specs()] == [8 + 78, 8 + 53, 8 + 27, 8 + 2]


PROMPTS = [list(range(1, 30)), [5, 6, 7], list(range(40, 52)), [9] * 17]


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_paged_eviction_generates_what_contiguous_does(policy):
    model = scored_model(policy, 5, sinks=1, window=3)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    contiguous = Engine(model, max_batch=4, max_seq_len=64).generate(PROMPTS, params)
    engine = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged", block_size=4)
    paged = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in paged] == [o.token_ids for o in contiguous]
    manager = engine.block_managers[0]
    assert sorted(manager.free) == list(range(manager.num_blocks))  # every block back
    # a sequence never held more than its capacity + 1 rows: 9 + 1 rows in 4-token blocks
    assert manager.peak_blocks(64) == 3


def test_a_long_prompt_runs_in_the_blocks_its_kept_rows_fill():
    model = scored_model("h2o", 5, sinks=1, window=2)
    engine = Engine(model, max_batch=1, max_seq_len=128, kv_cache="paged", block_size=4)
    manager = engine.block_managers[0]
    assert manager.num_blocks == 3  # the pool is sized for 8 held rows and a new one, not 128 tokens
    engine.add_request(list(range(1, 100)), SamplingParams(max_new_tokens=10, temperature=0))
    engine.step()  # the 99-token prompt scored and cut to 8 rows, then its first decode step
    (table,) = manager.tables.values()
    kept = engine.pool.layers[0].kept_positions(table, 8)
    assert kept[0] == 0 and kept[-2:] == [98, 99] and len(set(kept)) == 8  # the sink, the window, 5 by score
    while engine.has_unfinished():
        engine.step()
    assert sorted(manager.free) == list(range(3))


def test_beams_copy_a_shared_block_before_an_eviction_writes_it():
    model = scored_model("tova", 4, sinks=1, window=2)
    params = BeamSearchParams(num_beams=3, max_new_tokens=12, num_return_sequences=3)

    def search():
        engine = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged", block_size=4)
        return engine, engine.beam_search(list(range(3, 20)), params)

    engine, beams = search()
    assert beams == search()[1]  # every fork wrote its own copies: a rerun finds the same beams
    manager = engine.block_managers[0]
    assert sorted(manager.free) == list(range(manager.num_blocks))


def test_preempted_requests_end_and_leave_the_pool_whole():
    model = scored_model("h2o", 6, sinks=1, window=3)
    engine = Engine(model, max_batch=4, max_seq_len=64, kv_cache="paged", block_size=4, num_blocks=5,
                    admission="optimistic")  # room for one sequence's 3 blocks and a short one's: others wait
    outputs = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=30, temperature=0))
    assert engine.preemptions > 0 and all(o.finish_reason == "length" for o in outputs)
    manager = engine.block_managers[0]
    assert sorted(manager.free) == list(range(manager.num_blocks))
    alone = Engine(model, max_batch=1, max_seq_len=64).generate(PROMPTS * 2, SamplingParams(30, temperature=0))
    for out, solo in zip(outputs, alone):  # a request never preempted decodes as it does alone
        if not out.preemptions:
            assert out.token_ids == solo.token_ids


def test_prefix_caching_is_off_for_scored_caches_and_says_why():
    engine = Engine(scored_model("h2o", 4), max_batch=2, max_seq_len=64, kv_cache="paged", prefix_caching=True)
    assert "keeps tokens by score" in engine.prefix_caching_off
    assert all(manager.cache is None for manager in engine.block_managers)


def test_a_scored_step_writes_only_blocks_its_sequence_holds_alone():
    from types import SimpleNamespace

    from harness.engine.block_manager import BlockManager

    manager = BlockManager(12, 4, Retention(score="h2o", budget=6, window=2))  # capacity 8: 2 blocks, 3 mid-step
    parent = SimpleNamespace(request_id=0, num_cached=0, max_length=40)
    manager.admit(parent, 20)
    manager.grow(parent, 20)  # a 20-token prompt keeps 8 rows
    assert len(manager.tables[0]) == 2
    parent.num_cached = 20
    child = SimpleNamespace(request_id=1, num_cached=20, max_length=40)
    manager.fork(parent, child)
    shared = list(manager.tables[0])
    manager.grow(child, 21)  # a decode step: 8 held rows and the new one, any of which an eviction may write
    assert [source for source, _ in manager.copies] == shared  # each shared block copied before the step
    assert all(manager.refs[block] == 1 for block in manager.tables[1]) and len(manager.tables[1]) == 3
    assert manager.tables[0] == shared and all(manager.refs[block] == 1 for block in shared)


@pytest.mark.usefixtures("machine_rates_once")
def test_zoo_compare_runs_the_eviction_axis(tmp_path):
    from harness.compare import CompareSettings, run_compare

    settings = CompareSettings(archs=["gqa"], preset="tiny", contexts=[32], batches=[2], new_tokens=3, out=tmp_path,
                               kv_policies=["none", "tova"], kv_budgets=[0.5, 0.25])
    rows = {(r["kv_policy"], r["kv_budget"]): r for r in run_compare(settings, show_progress=False)}
    assert set(rows) == {("none", None), ("tova", 0.5), ("tova", 0.25)}
    token_bytes = zoo.build("gqa", preset="tiny").cache_specs()[0].token_bytes(torch.float32) * 2  # two layers
    for share in (0.5, 0.25):  # each batch row holds the kept tokens and one spare: measured as analytic says
        kept = round(share * 32)
        assert rows["tova", share]["measured_cache_bytes"] == 2 * token_bytes * (kept + 1)
        assert rows["tova", share]["analytic_cache_bytes"] == 2 * token_bytes * kept
    assert rows["none", None]["measured_cache_bytes"] == 2 * token_bytes * (32 + 3)


@pytest.mark.parametrize("settings,message", [
    (dict(kv_policies=["h2o"], kv_budgets=[0]), "kv_budget 0 is not a share"),
    (dict(kv_policies=["h2o"], kv_budgets=[1.5]), "kv_budget 1.5"),
    (dict(kv_policies=["lru"]), "unknown kv_policy 'lru'"),
    (dict(kv_policies=["h2o"], archs=["mamba"]), "Mamba keeps recurrent state"),
    (dict(kv_policies=["tova"], kv_dtypes=["int8"]), "evicting cache keeps rows in the model's dtype"),
])
def test_zoo_compare_refuses_a_bad_eviction_before_any_work(tmp_path, settings, message):
    from harness.compare import CompareSettings, run_compare

    settings = {"archs": ["gqa"], "preset": "tiny", "contexts": [32], "batches": [1], "out": tmp_path, **settings}
    with pytest.raises(ValueError, match=message):
        run_compare(CompareSettings(**settings), show_progress=False)
    assert not (tmp_path / "results.jsonl").exists()
