"""Property-based checks of every request and engine knob: random SamplingParams, prompts and Engine settings,
valid and invalid. Whether an input is valid is decided here by a rule of this file (never by asking the code under
test): an invalid one raises ValueError before any work, a valid one runs to "length" or "stop", and an engine that
saw any mix still gives a fresh engine's greedy tokens."""
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Engine, SamplingParams

VOCAB = 512  # the tiny preset's
MODEL_MAX_SEQ_LEN = 64
REFERENCE_NEW_TOKENS = 4
# Derandomized (the seed comes from each test's source) and no example database: every CI run tries the same
# examples and writes no files.
PROPERTY = settings(deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# ---- the validity rule, written from the documented contract ----------------------------------------------


def is_integer(value) -> bool:
    """An int or numpy integer; a bool is not an integer."""
    return (type(value) is int) or isinstance(value, np.integer)


def finite_real(value) -> float | None:
    """The value as a float if it is a finite real number (int, float or numpy number, not bool), else None."""
    if not (is_integer(value) or isinstance(value, (float, np.floating))):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return number if math.isfinite(number) else None


def in_range(value, low: float, high: float) -> bool:
    return value is not None and low <= value <= high


def params_are_valid(kwargs: dict) -> bool:
    """SamplingParams' documented types and ranges; a missing key takes its default."""
    stop = kwargs.get("stop_token_ids", ())
    top_p = finite_real(kwargs.get("top_p", 1.0))
    penalty = finite_real(kwargs.get("repetition_penalty", 1.0))
    seed = kwargs.get("seed")
    return all([
        is_integer(kwargs.get("max_new_tokens", 64)) and kwargs.get("max_new_tokens", 64) >= 1,
        in_range(finite_real(kwargs.get("temperature", 1.0)), 0, math.inf),
        is_integer(kwargs.get("top_k", 0)) and kwargs.get("top_k", 0) >= 0,
        top_p is not None and 0 < top_p <= 1,
        penalty is not None and penalty > 0,
        seed is None or (is_integer(seed) and 0 <= seed <= 2**64 - 1),
        isinstance(stop, (list, tuple, set, frozenset, range)) and all(is_integer(t) and t >= 0 for t in stop),
        type(kwargs.get("return_logits", False)) is bool,
    ])


def prompt_tokens(prompt) -> list[int] | None:
    """The token ids a valid prompt stands for, None for an invalid one: a non-empty UTF-8 text (its bytes), or a
    non-empty list, tuple, range or 1-D integer tensor of ids in [0, VOCAB)."""
    if isinstance(prompt, str):
        try:
            return list(prompt.encode("utf-8")) or None
        except UnicodeEncodeError:  # a lone surrogate has no UTF-8 bytes
            return None
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            return None
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)) or not prompt:
        return None
    if not all(is_integer(t) and 0 <= t < VOCAB for t in prompt):
        return None
    return [int(t) for t in prompt]


@dataclass(frozen=True)
class Limits:
    """What an engine's settings allow one request: its tokens, and (paged with a given num_blocks) its blocks."""

    max_seq_len: int
    block_size: int
    num_blocks: int | None  # None: the pool holds any request that fits max_seq_len


def request_is_valid(prompt, kwargs: dict, limits: Limits) -> bool:
    tokens = prompt_tokens(prompt)
    if tokens is None or not params_are_valid(kwargs):
        return False
    new = kwargs["max_new_tokens"]
    if any(t >= VOCAB for t in kwargs.get("stop_token_ids", ())) or len(tokens) + new > limits.max_seq_len:
        return False
    cached = len(tokens) + new - 1  # the last sampled token is never cached
    return limits.num_blocks is None or -(-cached // limits.block_size) <= limits.num_blocks


def kv_bytes_per_token(config) -> int:
    """fp32 K and V of every attention layer of the gqa preset, for one token."""
    layer = config.layers[0].params
    return len(config.layers) * 2 * layer["n_kv_heads"] * (config.d_model // layer["n_heads"]) * 4


def engine_limits(kwargs: dict, bytes_per_token: int) -> Limits | None:
    """The limits a valid set of Engine settings gives (missing keys take their defaults), None if invalid."""
    max_batch = kwargs.get("max_batch", 8)
    max_seq_len = kwargs.get("max_seq_len")
    max_seq_len = MODEL_MAX_SEQ_LEN if max_seq_len is None else max_seq_len
    kv_cache = kwargs.get("kv_cache", "contiguous")
    block_size = kwargs.get("block_size", 16)
    num_blocks = kwargs.get("num_blocks")
    budget = kwargs.get("cache_budget_bytes")
    valid = all([
        is_integer(max_batch) and max_batch >= 1,
        is_integer(max_seq_len) and 1 <= max_seq_len <= MODEL_MAX_SEQ_LEN,
        isinstance(kv_cache, str) and kv_cache in ("contiguous", "paged"),
        is_integer(block_size) and block_size >= 1 and bin(int(block_size)).count("1") == 1,
        num_blocks is None or (is_integer(num_blocks) and num_blocks >= 1),
        budget is None or (is_integer(budget) and budget >= 1),
        type(kwargs.get("compile", False)) is bool,
        num_blocks is None or kv_cache == "paged",
        num_blocks is None or budget is None,
    ])
    if not valid:
        return None
    # a budget must hold one full-length request: a contiguous row, or its whole blocks
    cached_tokens = max_seq_len if kv_cache == "contiguous" else -(-max_seq_len // block_size) * block_size
    if budget is not None and budget < cached_tokens * bytes_per_token:
        return None
    return Limits(int(max_seq_len), int(block_size), None if num_blocks is None else int(num_blocks))


# ---- strategies: valid values, values of the right type out of range, and values of the wrong type ----------


def integers(low: int, high: int) -> st.SearchStrategy:
    """Python ints and the same values as numpy integers (low and high within int64)."""
    as_int32 = st.integers(max(low, -(2**31)), min(high, 2**31 - 1)).map(np.int32)
    return st.one_of(st.integers(low, high), st.integers(low, high).map(np.int64), as_int32)


HUGE_INTEGERS = st.sampled_from([2**63, 2**64, 10**30, 10**400, -(10**400)])  # 10**400: beyond any float
SPECIAL_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e300, 1.7976931348623157e308, math.nan, math.inf,
                                  -math.inf, 1.0, 0.5])
FLOATS = st.one_of(SPECIAL_FLOATS, st.floats(), st.floats(width=32).map(np.float32), SPECIAL_FLOATS.map(np.float64))
JUNK = st.one_of(st.booleans(), st.just(np.bool_(True)), st.none(), st.text(max_size=3), st.binary(max_size=2),
                 st.lists(st.integers(0, 3), max_size=2), st.complex_numbers(max_magnitude=2), st.just({}))
UNIT_FLOATS = st.floats(0, 1)  # where top_p and temperature mostly live


def any_real(typical: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(typical, typical, FLOATS, integers(-3, 3), HUGE_INTEGERS, JUNK)


STOP_ID = st.one_of(integers(0, VOCAB - 1), integers(-3, VOCAB + 3), HUGE_INTEGERS, FLOATS, JUNK)
HASHABLE_STOP_ID = st.one_of(integers(0, VOCAB - 1), integers(-3, VOCAB + 3), HUGE_INTEGERS, FLOATS, st.text(max_size=2))
STOP_IDS = st.one_of(
    st.lists(STOP_ID, max_size=6), st.lists(STOP_ID, max_size=4).map(tuple), st.lists(HASHABLE_STOP_ID, max_size=4).map(set),
    st.lists(integers(0, VOCAB - 1), max_size=4).map(frozenset),
    st.builds(range, st.integers(-2, VOCAB + 8), st.integers(-2, VOCAB + 8)),  # big ranges make "stop" likely
    STOP_ID,  # a bare id is not a list
)
SAMPLING_KWARGS = st.fixed_dictionaries(
    {"max_new_tokens": st.one_of(integers(1, 6), integers(1, 6), integers(-3, 0), integers(65, 2**40), HUGE_INTEGERS,
                                 FLOATS, JUNK)},
    optional={
        "temperature": st.one_of(st.just(0.0), any_real(st.floats(0, 2))),
        "top_k": st.one_of(integers(0, VOCAB + 8), integers(-3, 0), HUGE_INTEGERS, FLOATS, JUNK),
        "top_p": any_real(UNIT_FLOATS),
        "repetition_penalty": any_real(st.floats(0.1, 3)),
        "seed": st.one_of(st.none(), integers(-3, 2**31), st.integers(0, 2**64 - 1).map(np.uint64), st.integers(0, 2**64 + 3),
                          FLOATS, JUNK),
        "stop_token_ids": STOP_IDS,
        "return_logits": st.one_of(st.booleans(), JUNK),
    },
)

TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, VOCAB - 1), integers(0, VOCAB - 1))
ANY_TOKEN = st.one_of(TOKEN, TOKEN, TOKEN, integers(-3, VOCAB + 3), HUGE_INTEGERS, FLOATS, JUNK)
TENSOR_DTYPES = st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool])
PROMPTS = st.one_of(
    st.lists(TOKEN, max_size=20), st.lists(TOKEN, min_size=40, max_size=70),  # long: over the pool or max_seq_len
    st.lists(ANY_TOKEN, max_size=8), st.lists(ANY_TOKEN, max_size=8).map(tuple),
    st.integers(0, VOCAB - 8).map(lambda first: range(first, first + 5)),
    st.builds(range, st.integers(-2, VOCAB + 2), st.integers(-2, VOCAB + 2)),
    st.text(max_size=12), st.sampled_from(["\ud800", "a\udfff"]),  # lone surrogates: no UTF-8 bytes
    st.builds(lambda ids, dtype: torch.tensor(ids).to(dtype), st.lists(st.integers(0, 255), max_size=8), TENSOR_DTYPES),
    st.lists(st.integers(0, 9), min_size=2, max_size=4).map(lambda ids: torch.tensor([ids])),  # 2-D
    HUGE_INTEGERS, FLOATS, JUNK,
)
REQUESTS = st.lists(st.tuples(PROMPTS, SAMPLING_KWARGS), min_size=1, max_size=5)

ENGINE_KWARGS = st.fixed_dictionaries({}, optional={
    "max_batch": st.one_of(integers(1, 4), integers(-2, 0), FLOATS, JUNK),  # no huge valid values: rows are allocated
    "max_seq_len": st.one_of(st.none(), integers(1, MODEL_MAX_SEQ_LEN), integers(-2, 0), integers(65, 2**40),
                             HUGE_INTEGERS, FLOATS, JUNK),
    "kv_cache": st.one_of(st.sampled_from(["contiguous", "paged"]), st.sampled_from(["pages", "Paged", ""]), JUNK),
    "block_size": st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), integers(-2, 130), FLOATS, JUNK),
    "num_blocks": st.one_of(st.none(), integers(1, 64), integers(-2, 0), FLOATS, JUNK),
    "cache_budget_bytes": st.one_of(st.none(), integers(1, 2**20), integers(-2, 0), FLOATS, JUNK),
    # compile=True is valid, but compiling is too slow for examples
    "compile": st.one_of(st.just(False), JUNK.filter(lambda value: value is not True)),
})


# ---- running a mix of requests --------------------------------------------------------------------------


def engine_state(engine: Engine) -> tuple:
    """Everything a refused request must leave as it was: the queue, the tokens so far, the slots and the blocks."""
    scheduler = engine.scheduler
    managers = [(list(m.free), {k: list(v) for k, v in m.tables.items()}, m.promised) for m in engine.block_managers]
    return (engine.requests_added, {k: len(s.output_ids) for k, s in engine.unfinished.items()},
            [s.request_id for s in scheduler.waiting], [s.request_id for s in scheduler.running],
            list(scheduler.free_slots), engine.decode_stats.steps, managers)


def assert_pool_whole(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.unfinished
    assert sorted(engine.scheduler.free_slots) == list(range(engine.max_batch))
    for manager in engine.block_managers:
        assert manager.promised == 0 and not manager.tables
        assert sorted(manager.free) == list(range(manager.num_blocks))


def assert_completed(output, max_new_tokens: int, stop_ids: set[int]) -> None:
    """Ended by its length or by a stop id, and by nothing earlier."""
    tokens = output.token_ids
    assert output.finish_reason in ("length", "stop"), f"{output.finish_reason}: {output.error}"
    assert all(0 <= t < VOCAB for t in tokens) and not stop_ids.intersection(tokens[:-1])
    if output.finish_reason == "stop":
        assert 1 <= len(tokens) <= max_new_tokens and tokens[-1] in stop_ids
    else:
        assert len(tokens) == max_new_tokens and tokens[-1] not in stop_ids


def run_mix(engine: Engine, requests, limits: Limits) -> None:
    """Queue each request (one engine step after each, so later ones arrive while earlier ones run), then drain;
    a refused one changes nothing, an accepted one completes."""
    accepted: dict[int, tuple[int, set[int]]] = {}
    done = {}
    for prompt, kwargs in requests:
        if request_is_valid(prompt, kwargs, limits):
            request_id = engine.add_request(prompt, SamplingParams(**kwargs))
            accepted[request_id] = (int(kwargs["max_new_tokens"]), {int(t) for t in kwargs.get("stop_token_ids", ())})
        else:
            before = engine_state(engine)
            with pytest.raises(ValueError):
                engine.add_request(prompt, SamplingParams(**kwargs))
            assert engine_state(engine) == before
        done.update((out.request_id, out) for out in engine.step())
    for _ in range(len(requests) * 6):  # each accepted request needs at most 6 steps
        done.update((out.request_id, out) for out in engine.step())
    assert set(done) == set(accepted)
    for request_id, (max_new_tokens, stop_ids) in accepted.items():
        assert_completed(done[request_id], max_new_tokens, stop_ids)
    assert_pool_whole(engine)


# ---- the properties -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(helpers):
    return helpers.random_model("gqa", max_seq_len=MODEL_MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference_prompt(helpers):
    return helpers.make_prompts([5], VOCAB, seed=11)[0]


@pytest.fixture(scope="module")
def reference(model, reference_prompt, helpers):
    """A fresh engine's greedy tokens for the reference prompt, once per module."""
    tokens = Engine(model).generate([reference_prompt], SamplingParams(REFERENCE_NEW_TOKENS, temperature=0.0))[0].token_ids
    helpers.assert_not_constant(tokens, "reference")
    return tokens


def assert_reference(engine: Engine, limits: Limits, prompt: list[int], tokens: list[int]) -> None:
    """The engine still gives the reference tokens, or refuses the reference request if its limits exclude it."""
    greedy = SamplingParams(REFERENCE_NEW_TOKENS, temperature=0.0)
    if request_is_valid(prompt, {"max_new_tokens": REFERENCE_NEW_TOKENS}, limits):
        assert engine.generate([prompt], greedy)[0].token_ids == tokens
    else:
        with pytest.raises(ValueError):
            engine.generate([prompt], greedy)
    assert_pool_whole(engine)


@settings(PROPERTY, max_examples=400)
@given(kwargs=SAMPLING_KWARGS)
def test_sampling_params_are_refused_exactly_when_invalid(kwargs):
    if params_are_valid(kwargs):
        SamplingParams(**kwargs)
    else:
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


@settings(PROPERTY, max_examples=60)
@given(requests=REQUESTS, kv_cache=st.sampled_from(["contiguous", "paged"]))
def test_a_mix_of_requests_is_refused_or_completed(model, reference_prompt, reference, requests, kv_cache):
    paged = kv_cache == "paged"
    limits = Limits(MODEL_MAX_SEQ_LEN, 4, 12 if paged else None)
    engine = Engine(model, max_batch=2, kv_cache=kv_cache, block_size=4, num_blocks=12 if paged else None)
    run_mix(engine, requests, limits)
    assert_reference(engine, limits, reference_prompt, reference)


@settings(PROPERTY, max_examples=60)
@given(kwargs=ENGINE_KWARGS, requests=st.lists(st.tuples(PROMPTS, SAMPLING_KWARGS), max_size=3))
def test_engine_settings_are_refused_or_serve_requests(model, reference_prompt, reference, kwargs, requests):
    limits = engine_limits(kwargs, kv_bytes_per_token(model.config))
    if limits is None:
        with pytest.raises(ValueError):
            Engine(model, **kwargs)
        return
    engine = Engine(model, **kwargs)
    run_mix(engine, requests, limits)
    assert_reference(engine, limits, reference_prompt, reference)
