"""Recurrent state in the engine: state slots under continuous batching, hybrids of state and KV layers,
memory accounting and budgets, and the registry's errors for the constant-state family."""
import random
import subprocess
import sys

import pytest
import torch

import zoo
from harness import Engine, SamplingParams
from helpers import assert_not_constant, greedy, make_prompts, random_model  # tests/ is on sys.path under pytest

MAX_SEQ_LEN = 96


def workload(n: int, seed: int):
    rng = random.Random(seed)
    lengths = [1, 60] + [rng.randint(1, 60) for _ in range(n - 2)]
    new_tokens = [30, 1] + [rng.randint(1, 30) for _ in range(n - 2)]
    prompts = [[rng.randrange(512) for _ in range(k)] for k in lengths]
    return prompts, [SamplingParams(max_new_tokens=k, temperature=0.0) for k in new_tokens]


@pytest.mark.parametrize("arch,settings,kv_cache", [
    ("mamba", {}, "contiguous"), ("linear", {}, "paged"), ("mamba2", {}, "contiguous"),
    ("hybrid", {"layers": "mamba,gqa"}, "paged"),
])
def test_40_requests_through_8_state_slots_equal_their_alone_runs(arch, settings, kv_cache):
    """Slots are reused as requests finish: a new request must start from a zero state, not its predecessor's."""
    model = random_model(arch, **settings)
    prompts, params = workload(40, seed=1)
    engine = Engine(model, max_batch=8, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache, block_size=8)
    batched = engine.generate(prompts, params)
    alone = [Engine(model, max_batch=1, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache, block_size=8).generate([p], sp)[0]
             for p, sp in zip(prompts, params)]
    assert_not_constant([t for o in batched for t in o.token_ids], arch)
    for i, (b, a) in enumerate(zip(batched, alone)):
        assert b.token_ids == a.token_ids, f"{arch} request {i}"
    assert engine.cache_bytes_in_use() == 0 and len(engine.scheduler.free_slots) == 8


@pytest.mark.parametrize("arch", ["linear", "mamba", "mamba2"])
def test_state_bytes_are_analytic_and_constant_in_context(arch):
    model = random_model(arch)
    per_sequence = zoo.cache_bytes(model, seq_len=1)
    assert per_sequence > 0
    assert [zoo.cache_bytes(model, seq_len=t) for t in (1, 100, 10_000)] == [per_sequence] * 3
    for kv_cache in ("contiguous", "paged"):
        engine = Engine(model, max_batch=3, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache)
        assert engine.cache_bytes_allocated == 3 * per_sequence  # state rows only: no blocks, nothing per token
        assert engine.block_managers == []
        engine.add_request(list(range(40)), SamplingParams(max_new_tokens=30, temperature=0.0))
        in_use = []
        while engine.has_unfinished():
            engine.step()
            in_use.append(engine.cache_bytes_in_use())
        assert set(in_use[:-1]) == {per_sequence} and in_use[-1] == 0


def test_hybrid_of_state_and_kv_layers_accounts_both():
    model = random_model("hybrid", layers="mamba,mamba,mamba,gqa", n_layers=4)
    specs = model.cache_specs()
    assert [s.kind for s in specs] == ["state", "state", "state", "kv"]
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged", block_size=8)
    state = sum(s.state_elements for s in specs) * 4
    assert engine.pool.state_slot_bytes == state
    engine.add_request(list(range(20)), SamplingParams(max_new_tokens=5, temperature=0.0))
    engine.step()
    seq = engine.scheduler.running[0]
    blocks = engine.block_managers[0].held(seq)
    assert blocks == 3  # 21 tokens in 8-token blocks
    assert engine.cache_bytes_in_use() == state + blocks * engine.pool.block_bytes(0)


def test_cache_budget_counts_state_slots():
    model = zoo.build("hybrid", preset="tiny", layers="mamba,gqa")
    per_request = zoo.cache_bytes(model, seq_len=64)
    engine = Engine(model, max_batch=16, max_seq_len=64, kv_cache="paged", block_size=16, cache_budget_bytes=3 * per_request)
    assert engine.max_batch < 16  # each batch slot costs a state row, so the budget caps the slots
    assert engine.cache_bytes_allocated <= 3 * per_request
    contiguous = Engine(model, max_batch=16, max_seq_len=64, cache_budget_bytes=3 * per_request)
    assert contiguous.max_batch == 3 and contiguous.cache_bytes_allocated == 3 * per_request
    with pytest.raises(ValueError, match="too small for one request"):
        Engine(zoo.build("mamba", preset="tiny"), kv_cache="paged", cache_budget_bytes=100)


@pytest.mark.parametrize("arch,settings,message", [
    ("mamba", {"d_state": 0}, "d_state"),
    ("mamba2", {"d_state": -1}, "d_state"),
    ("mamba2", {"head_dim": 48}, "head_dim"),
    ("linear", {"feature_map": "relu"}, "relu"),
    ("linear", {"n_heads": 3}, "3"),
])
def test_bad_state_settings_raise_clear_errors(arch, settings, message):
    with pytest.raises(ValueError, match=message):
        zoo.build(arch, preset="tiny", **settings)


def test_cpu_import_and_run_never_import_mamba_ssm():
    code = ("import sys, torch, zoo; m = zoo.build('hybrid', preset='tiny', layers='mamba,mamba2,linear'); "
            "m(torch.tensor([[1, 2, 3]])); "
            "assert not any(n.split('.')[0] in ('mamba_ssm', 'causal_conv1d') for n in sys.modules), 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_linear_attention_state_stays_fp32_in_a_bf16_model():
    """S and z are running sums: in bf16 they stop resolving new terms, so the state is declared fp32."""
    model = random_model("linear").to(torch.bfloat16)
    spec = model.cache_specs()[0]
    assert spec.state_dtype == torch.float32
    assert zoo.cache_bytes(model, seq_len=5) == 4 * sum(s.state_elements for s in model.cache_specs())
    engine = Engine(model, max_batch=1, max_seq_len=256)
    assert engine.cache_bytes_allocated == zoo.cache_bytes(model, seq_len=256)
    prompt = make_prompts([150], 512, seed=4)[0]
    out = engine.generate([prompt], greedy(60))[0]
    with torch.no_grad():
        full = model(torch.tensor([prompt + out.token_ids[:-1]]))[0, len(prompt) - 1 :].float()
    assert full.argmax(-1).tolist() == out.token_ids  # cached decode picks what the full forward picks
