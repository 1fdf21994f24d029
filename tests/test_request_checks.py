"""Every request and engine knob is checked for type and range before any work, with an error that names the
parameter, the bad value and what is allowed; extreme but valid sampling settings complete without inf/NaN."""
import math

import numpy as np
import pytest
import torch

from harness import Engine, SamplingParams
from harness.engine.sampling import sample_token
from helpers import make_prompts, random_model  # tests/ is on sys.path under pytest

VOCAB = 512  # the tiny preset's


@pytest.fixture(scope="module")
def model():
    return random_model("gqa", max_seq_len=64)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": float("nan")}, r"max_new_tokens must be an integer >= 1, got nan \(float\)"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer >= 1, got 2.5"),
    ({"max_new_tokens": "5"}, r"max_new_tokens must be an integer >= 1, got '5' \(str\)"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer >= 1, got True \(bool\)"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1, got 0"),
    ({"top_k": 2.5}, r"top_k \(0 = off\) must be an integer >= 0, got 2.5"),
    ({"top_k": -1}, r"top_k \(0 = off\) must be >= 0, got -1"),
    ({"temperature": float("inf")}, r"temperature \(0 = greedy\) must be a finite number >= 0, got inf"),
    ({"temperature": float("nan")}, r"temperature .* got nan"),
    ({"temperature": -0.5}, r"temperature .* >= 0, got -0.5"),
    ({"temperature": "1"}, r"temperature .* got '1' \(str\)"),
    ({"top_p": 0.0}, r"top_p must be a finite number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a finite number in \(0, 1\], got 1.5"),
    ({"top_p": float("nan")}, r"top_p .* got nan"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty \(1 = off\) must be a finite number > 0, got 0.0"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty .* got inf"),
    ({"seed": 1.5}, r"seed must be an integer in \[0, 18446744073709551615\], got 1.5"),
    ({"seed": "7"}, r"seed must be an integer .* got '7' \(str\)"),
    ({"seed": -1}, r"seed must be in \[0, 18446744073709551615\], got -1"),
    ({"seed": 2**64}, r"seed must be in \[0, 18446744073709551615\], got 18446744073709551616"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a list or tuple of integer token ids, got 5 \(int\)"),
    ({"stop_token_ids": "5"}, r"stop_token_ids must be a list or tuple .* got '5' \(str\)"),
    ({"stop_token_ids": [1.0]}, r"stop_token_ids\[\] must be an integer >= 0, got 1.0 \(float\)"),
    ({"stop_token_ids": [-2]}, r"stop_token_ids\[\] must be >= 0, got -2"),
    ({"return_logits": 1}, r"return_logits must be True or False, got 1 \(int\)"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_numpy_and_int_values():
    params = SamplingParams(max_new_tokens=np.int64(4), temperature=1, top_p=1, seed=np.uint64(3), stop_token_ids=[np.int32(2)])
    assert type(params.max_new_tokens) is int and type(params.temperature) is float and params.seed == 3
    assert params.stop_token_ids == (2,) and type(params.stop_token_ids[0]) is int


@pytest.mark.parametrize("prompt, message", [
    ([1.9], r"prompt must hold integer token ids; got \[1.9\] \(float\)"),
    ([1, "5"], r"prompt must hold integer token ids; got \['5'\] \(str\)"),
    ([True, 2], r"prompt must hold integer token ids; got \[True\] \(bool\)"),
    (torch.tensor([1.0, 2.0]), r"prompt as a tensor must be 1-D with an integer dtype"),
    (torch.tensor([[1, 2]]), r"prompt as a tensor must be 1-D"),
    (5, r"prompt must be a list of integer token ids, got int"),
    (b"abc", r"prompt must be a list of integer token ids, got bytes"),
])
def test_bad_prompts_are_refused(model, prompt, message):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    assert not engine.has_unfinished()


def test_integer_tensor_and_numpy_prompts_are_accepted(model):
    engine = Engine(model, max_batch=2, max_seq_len=64)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    want = engine.generate([[3, 1, 4]], greedy)[0].token_ids
    assert engine.generate([torch.tensor([3, 1, 4])], greedy)[0].token_ids == want
    assert engine.generate([list(np.array([3, 1, 4]))], greedy)[0].token_ids == want


def test_stop_ids_outside_the_vocabulary_are_refused(model):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    with pytest.raises(ValueError, match=r"stop_token_ids \[512, 9999\] out of vocabulary .* \[0, 512\)"):
        engine.add_request([1, 2], SamplingParams(max_new_tokens=2, stop_token_ids=(3, 512, 9999)))


def test_params_of_the_wrong_type_are_refused(model):
    engine = Engine(model, max_batch=1, max_seq_len=64)
    with pytest.raises(ValueError, match=r"params must be a harness.SamplingParams, got dict"):
        engine.add_request([1, 2], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match=r"prompts must be a list of prompts .* got int"):
        engine.generate(7)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch": 2.0}, r"max_batch must be an integer >= 1, got 2.0 \(float\)"),
    ({"max_batch": True}, r"max_batch must be an integer >= 1, got True \(bool\)"),
    ({"max_seq_len": 32.0}, r"max_seq_len .* must be an integer in \[1, 64\], got 32.0"),
    ({"max_seq_len": 65}, r"max_seq_len .* must be in \[1, 64\], got 65"),
    ({"block_size": 4.0, "kv_cache": "paged"}, r"block_size must be an integer >= 1, got 4.0"),
    ({"block_size": 6, "kv_cache": "paged"}, r"block_size must be a power of two >= 1, got 6"),
    ({"num_blocks": 8.5, "kv_cache": "paged"}, r"num_blocks must be an integer >= 1, got 8.5"),
    ({"num_blocks": 0, "kv_cache": "paged"}, r"num_blocks must be >= 1, got 0"),
    ({"num_blocks": 8}, r"num_blocks=8 sizes a paged pool, but kv_cache='contiguous'"),
    ({"num_blocks": 8, "cache_budget_bytes": 10**6, "kv_cache": "paged"}, r"give num_blocks \(8\) or cache_budget_bytes"),
    ({"cache_budget_bytes": 1e6}, r"cache_budget_bytes must be an integer >= 1, got 1000000.0"),
    ({"kv_cache": "pages"}, r"unknown kv_cache 'pages'; allowed: contiguous, paged"),
    ({"compile": "yes"}, r"compile must be True or False, got 'yes'"),
])
def test_bad_engine_settings_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(model, **{"max_seq_len": 64, **kwargs})


# ---- numerically safe sampling ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-300, seed=1),
    SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
    SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1),
    SamplingParams(temperature=1e-300, repetition_penalty=1e300, top_k=1, seed=1),
])
def test_extreme_but_valid_settings_sample_without_nan(params):
    logits = torch.tensor([2.0, 7.5, -3.0, 7.5 - 1e-3, 0.0])
    generator = torch.Generator().manual_seed(0)
    tokens = {sample_token(logits, params, [0, 1, 2], generator) for _ in range(50)}
    assert tokens <= set(range(5))
    if params.repetition_penalty == 1.0:  # no penalty: a vanishing temperature or top-p leaves the top token
        assert tokens == {1}


def test_a_vanishing_temperature_is_greedy_through_the_engine(model):
    prompts = make_prompts([5, 9], VOCAB, seed=3)
    engine = Engine(model, max_batch=2, max_seq_len=64, kv_cache="paged")
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    cold = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1e-300, seed=5))
    assert [o.token_ids for o in cold] == [o.token_ids for o in greedy]
    hot = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, repetition_penalty=1e-300, seed=5))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in hot)


def test_non_finite_logits_end_only_that_request(model, monkeypatch):
    engine = Engine(model, max_batch=2, max_seq_len=64)
    real_decode = engine.runner.decode

    def decode_with_a_nan_row(seqs):
        logits = real_decode(seqs).clone()
        for row, seq in enumerate(seqs):
            if seq.request_id == 0:
                logits[row, 3] = math.nan
        return logits

    monkeypatch.setattr(engine.runner, "decode", decode_with_a_nan_row)
    prompts = make_prompts([4, 6], VOCAB, seed=8)
    bad, good = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error and len(bad.token_ids) == 1
    assert good.finish_reason == "length" and len(good.token_ids) == 5
