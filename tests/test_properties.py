"""Property-based checks of every request and engine knob: random SamplingParams, prompts and Engine settings,
valid and invalid. Whether an input is valid is decided here by a rule of this file (never by asking the code under
test): an invalid one raises ValueError before any work, a valid one runs to "length" or "stop", and an engine that
saw any mix still gives a fresh engine's greedy tokens."""
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from harness import Engine, SamplingParams
from helpers import assert_not_constant, make_prompts, random_model  # tests/ is on sys.path under pytest

VOCAB = 512  # the tiny preset's
MODEL_MAX_SEQ_LEN = 64
REFERENCE_NEW_TOKENS = 4
# Derandomized (the seed comes from each test's source) and no example database: every CI run tries the same
# examples. Hypothesis' caches and failure patches go to the temp directory, not into the checkout.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "archzoo-hypothesis")
PROPERTY = settings(deadline=None, database=None, derandomize=True)


# ---- the validity rule, written from the documented contract ----------------------------------------------


def is_integer(value) -> bool:
    """An int or numpy integer; a bool is not an integer."""
    return (type(value) is int) or isinstance(value, np.integer)


def real_sign(value) -> int | None:
    """-1, 0 or 1 for a finite real number (int, float or numpy number, not bool), None for anything else. A float's
    sign is read from its IEEE bits: exact even where the process flushes subnormals to zero."""
    if is_integer(value):
        try:
            float(value)
        except OverflowError:  # an int beyond any float
            return None
        return int(value > 0) - int(value < 0)
    if not isinstance(value, (float, np.floating)) or not math.isfinite(value):
        return None
    raw = np.array(value)
    bits, sign_bit = int.from_bytes(raw.tobytes(), "little"), 8 * raw.itemsize - 1
    if bits & ((1 << sign_bit) - 1) == 0:
        return 0
    return -1 if bits >> sign_bit else 1


def params_are_valid(kwargs: dict) -> bool:
    """SamplingParams' documented types and ranges; a missing key takes its default."""
    max_new_tokens, top_k = kwargs.get("max_new_tokens", 64), kwargs.get("top_k", 0)
    temperature, top_p = kwargs.get("temperature", 1.0), kwargs.get("top_p", 1.0)
    seed, stop = kwargs.get("seed"), kwargs.get("stop_token_ids", ())
    return all([
        is_integer(max_new_tokens) and max_new_tokens >= 1,
        real_sign(temperature) in (0, 1),
        is_integer(top_k) and top_k >= 0,
        real_sign(top_p) == 1 and float(top_p) <= 1,
        real_sign(kwargs.get("repetition_penalty", 1.0)) == 1,
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
        # HUGE_INTEGERS (2**63 and up) ask for a cache larger than any machine's memory: refused before allocating
        all(not is_integer(v) or v < 2**62 for v in (max_batch, num_blocks, budget) if v is not None),
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


def grid(low: float, high: float) -> st.SearchStrategy:
    """Floats from low to high in steps of 1/1024. Floats are built from integers and fixed values, not
    st.floats(): Hypothesis' float draws assume the process keeps subnormals."""
    return st.integers(round(low * 1024), round(high * 1024)).map(lambda n: n / 1024)


HUGE_INTEGERS = st.sampled_from([2**63, 2**64, 10**30, 10**400, -(10**400)])  # 10**400: beyond any float
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1e-300, 2e-308, 0.5, 1.0, 1 + 2**-52, 1e300,
                               1.7976931348623157e308, math.nan, math.inf, -math.inf])
EDGE_FLOAT32S = st.sampled_from([0.0, 1e-45, -1e-45, 0.5, 1.0, 3e38, math.nan, math.inf, -math.inf]).map(np.float32)
FLOATS = st.one_of(EDGE_FLOATS, grid(-4, 4), EDGE_FLOATS.map(np.float64), EDGE_FLOAT32S, grid(-2, 2).map(np.float32))
JUNK = st.one_of(st.booleans(), st.just(np.bool_(True)), st.none(), st.text(max_size=3), st.binary(max_size=2),
                 st.lists(st.integers(0, 3), max_size=2), st.just(1 + 1j), st.just({}))
NOT_AN_INTEGER = st.one_of(HUGE_INTEGERS, FLOATS, JUNK)  # HUGE_INTEGERS: integers, but beyond every range here


def either(*kinds: st.SearchStrategy) -> st.SearchStrategy:
    """A value of one of the kinds, each kind as likely as the others (st.one_of draws some branches far less)."""
    return st.sampled_from(kinds).flatmap(lambda kind: kind)


def mostly(valid: st.SearchStrategy, *invalid_kinds: st.SearchStrategy) -> st.SearchStrategy:
    """Valid four times in five (a request is valid only if all its values are, and both kinds must be common), else
    one of the invalid kinds."""
    invalid = either(*invalid_kinds)
    return st.integers(0, 4).flatmap(lambda pick: invalid if pick == 4 else valid)  # shrinks towards valid


def real(low: float, high: float) -> st.SearchStrategy:
    """Reals valid in [low, high] (where the parameter allows, tiny and huge ones too) and anything else."""
    tiny_and_huge = st.sampled_from([5e-324, 2e-308, 1e-300, 1e300, 1.7976931348623157e308])
    valid = either(grid(low, high), grid(low, high).map(np.float32), tiny_and_huge)
    return mostly(valid, FLOATS, integers(-3, 3), HUGE_INTEGERS, JUNK)


TOKEN = integers(0, VOCAB - 1)
OUT_OF_VOCAB = st.one_of(integers(VOCAB, VOCAB + 3), st.sampled_from([2**63, 2**64, 10**30]))
WRONG_TOKEN = st.one_of(integers(-3, -1), OUT_OF_VOCAB, FLOATS, JUNK)
STOP_IDS = mostly(
    either(st.integers(0, VOCAB).map(lambda first: range(first, VOCAB)),  # long ranges make "stop" likely
           st.lists(TOKEN, max_size=6).map(tuple), st.lists(TOKEN, max_size=4).map(set),
           st.lists(TOKEN, max_size=4).map(frozenset)),
    # ids SamplingParams takes but the engine refuses: out of its vocabulary
    st.builds(lambda ids, beyond: (*ids, beyond), st.lists(TOKEN, max_size=2), OUT_OF_VOCAB),
    st.integers(0, VOCAB).map(lambda first: range(first, VOCAB + 1)),
    st.one_of(st.builds(lambda ids, wrong: [*ids, wrong], st.lists(TOKEN, max_size=2), WRONG_TOKEN),
              st.lists(st.one_of(TOKEN, FLOATS, st.text(max_size=2)), min_size=1, max_size=4).map(set),
              st.builds(range, st.integers(-3, -1), st.integers(-2, VOCAB)),
              TOKEN, JUNK),  # a bare id is not a list
)
SAMPLING_KWARGS = st.fixed_dictionaries(
    {"max_new_tokens": mostly(integers(1, 6), integers(-3, 0), integers(65, 2**40), NOT_AN_INTEGER)},
    optional={
        "temperature": st.one_of(st.just(0.0), real(0, 2)),  # 0 (greedy) half the time
        "top_k": mostly(integers(0, VOCAB + 8), integers(-3, -1), NOT_AN_INTEGER),
        "top_p": real(0, 1),
        "repetition_penalty": real(0.1, 3),
        "seed": mostly(st.one_of(st.none(), integers(0, 2**31), st.integers(0, 2**64 - 1).map(np.uint64)),
                       integers(-3, -1), st.integers(2**64, 2**64 + 3), FLOATS, JUNK),
        "stop_token_ids": STOP_IDS,
        "return_logits": mostly(st.booleans(), JUNK),
    },
)


def tensors(ids: st.SearchStrategy, dtypes: list) -> st.SearchStrategy:
    return st.builds(lambda values, dtype: torch.tensor(values).to(dtype), ids, st.sampled_from(dtypes))


PROMPTS = mostly(
    either(st.lists(TOKEN, min_size=1, max_size=20), st.lists(TOKEN, min_size=1, max_size=8).map(tuple),
           st.integers(0, VOCAB - 8).map(lambda first: range(first, first + 5)), st.text(min_size=1, max_size=12),
           tensors(st.lists(st.integers(0, 255), min_size=1, max_size=8), [torch.int64, torch.int32, torch.uint8])),
    # lengths about the pool's and max_seq_len's edges once the new tokens are added
    st.integers(40, MODEL_MAX_SEQ_LEN + 2).flatmap(lambda n: st.lists(TOKEN, min_size=n, max_size=n)),
    st.builds(lambda head, wrong, tail: [*head, wrong, *tail], st.lists(TOKEN, max_size=4), WRONG_TOKEN,
              st.lists(TOKEN, max_size=3)),
    st.sampled_from(["", [], (), range(0), "\ud800", "a\udfff"]),  # empty; lone surrogates have no UTF-8 bytes
    st.builds(range, st.integers(-2, VOCAB + 2), st.integers(VOCAB - 4, VOCAB + 2)),
    tensors(st.lists(st.integers(0, 9), max_size=4), [torch.float32, torch.bool, torch.int64]),  # int64: empty
    st.lists(st.integers(0, 9), min_size=1, max_size=4).map(lambda ids: torch.tensor([ids])),  # 2-D
    TOKEN, NOT_AN_INTEGER,  # not a sequence
)
REQUESTS = st.lists(st.tuples(PROMPTS, SAMPLING_KWARGS), min_size=1, max_size=5)


@st.composite
def requests_at_an_edge(draw) -> tuple:
    """(kv_cache, limits, prompt length, max_new_tokens) with the request within two tokens of what max_seq_len or
    the pool allows."""
    kv_cache = draw(st.sampled_from(["contiguous", "paged"]))
    limits = Limits(draw(st.integers(8, MODEL_MAX_SEQ_LEN)), draw(st.sampled_from([1, 2, 4, 8, 16])),
                    draw(st.integers(1, 20)) if kv_cache == "paged" else None)
    new = draw(st.integers(1, 6))
    edges = [limits.max_seq_len - new]  # prompt + new tokens <= max_seq_len
    if limits.num_blocks is not None:
        edges.append(limits.num_blocks * limits.block_size - new + 1)  # prompt + new - 1 cached tokens fill the pool
    length = draw(st.sampled_from(edges)) + draw(st.integers(-2, 2))
    return kv_cache, limits, max(1, length), new


ENGINE_KWARGS = st.fixed_dictionaries({}, optional={
    # no huge valid max_batch, num_blocks or budget: the cache is allocated
    "max_batch": mostly(integers(1, 4), integers(-2, 0), NOT_AN_INTEGER),
    "max_seq_len": mostly(st.one_of(st.none(), integers(1, MODEL_MAX_SEQ_LEN)),
                          integers(-2, 0), integers(MODEL_MAX_SEQ_LEN + 1, 2**40), NOT_AN_INTEGER),
    "kv_cache": mostly(st.sampled_from(["contiguous", "paged"]), st.sampled_from(["pages", "Paged", "", None, 1])),
    "block_size": mostly(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), st.sampled_from([0, -4, 3, 6, 12, 100]),
                         NOT_AN_INTEGER),
    "num_blocks": mostly(st.one_of(st.none(), integers(1, 64)), integers(-2, 0), NOT_AN_INTEGER),
    "cache_budget_bytes": mostly(st.one_of(st.none(), integers(1, 2**20)), integers(-2, 0), NOT_AN_INTEGER),
    # compile=True is valid, but compiling is too slow for examples
    "compile": mostly(st.just(False), JUNK.filter(lambda value: value is not True)),
})


# ---- running a mix of requests --------------------------------------------------------------------------


def engine_state(engine: Engine) -> tuple:
    """Everything a refused request must leave as it was: the queue, the tokens so far, the slots and the blocks."""
    scheduler = engine.scheduler
    managers = [(list(m.free), {k: list(v) for k, v in m.tables.items()}, m.reserved) for m in engine.block_managers]
    return (engine.requests_added, {k: len(s.output_ids) for k, s in engine.unfinished.items()},
            [s.request_id for s in scheduler.waiting], [s.request_id for s in scheduler.running],
            list(scheduler.free_slots), engine.decode_stats.steps, managers)


def assert_pool_whole(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.unfinished
    assert sorted(engine.scheduler.free_slots) == list(range(engine.max_batch))
    for manager in engine.block_managers:
        assert manager.reserved == 0 and not manager.tables
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
def model():
    return random_model("gqa", max_seq_len=MODEL_MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference_prompt():
    return make_prompts([5], VOCAB, seed=11)[0]


@pytest.fixture(scope="module")
def reference(model, reference_prompt):
    """A fresh engine's greedy tokens for the reference prompt, once per module."""
    greedy = SamplingParams(REFERENCE_NEW_TOKENS, temperature=0.0)
    tokens = Engine(model).generate([reference_prompt], greedy)[0].token_ids
    assert_not_constant(tokens, "reference")
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


@settings(PROPERTY, max_examples=200)
@given(requests=REQUESTS, kv_cache=st.sampled_from(["contiguous", "paged"]))
# subnormal settings are valid, also once the CPU kernels are loaded (loading them must not flush subnormals to zero)
@example(requests=[([1, 2, 3], {"max_new_tokens": 2, "top_p": 5e-324}),
                   ([4, 5], {"max_new_tokens": 2, "temperature": 5e-324, "repetition_penalty": 2e-308})],
         kv_cache="paged")
def test_a_mix_of_requests_is_refused_or_completed(model, reference_prompt, reference, requests, kv_cache):
    paged = kv_cache == "paged"
    limits = Limits(MODEL_MAX_SEQ_LEN, 4, 12 if paged else None)
    engine = Engine(model, max_batch=2, kv_cache=kv_cache, block_size=4, num_blocks=12 if paged else None)
    run_mix(engine, requests, limits)
    assert_reference(engine, limits, reference_prompt, reference)


@settings(PROPERTY, max_examples=200)
@given(case=requests_at_an_edge())
def test_a_request_is_taken_exactly_when_it_fits(model, case):
    kv_cache, limits, length, max_new_tokens = case
    engine = Engine(model, max_batch=1, max_seq_len=limits.max_seq_len, kv_cache=kv_cache,
                    block_size=limits.block_size, num_blocks=limits.num_blocks)
    run_mix(engine, [(list(range(length)), {"max_new_tokens": max_new_tokens, "temperature": 0.0})], limits)


@settings(PROPERTY, max_examples=200)
@given(kwargs=ENGINE_KWARGS, requests=st.lists(st.tuples(PROMPTS, SAMPLING_KWARGS), max_size=3))
@example(kwargs={"max_batch": 2**63}, requests=[])  # once a TypeError from torch.zeros, found by a CI run
@example(kwargs={"kv_cache": "paged", "cache_budget_bytes": 2**64}, requests=[])
def test_engine_settings_are_refused_or_serve_requests(model, reference_prompt, reference, kwargs, requests):
    limits = engine_limits(kwargs, kv_bytes_per_token(model.config))
    if limits is None:
        with pytest.raises(ValueError):
            Engine(model, **kwargs)
        return
    engine = Engine(model, **kwargs)
    run_mix(engine, requests, limits)
    assert_reference(engine, limits, reference_prompt, reference)
