"""Sizes a user chooses are priced or bounded before anything is allocated (issue 33): an engine pool beyond the
memory limit, a block size past the largest allowed, ten million batch slots, a billion stop ids. Each is a
ValueError naming the option, raised at once with a short message, with no cache, scheduler or block manager built."""
import json
import os
import time

import pytest

import harness.engine.llm_engine
import zoo
from harness import BeamSearchParams, Engine, SamplingParams, SpeculativeConfig
from harness.engine.block_manager import HOST_BYTES_PER_BLOCK
from harness.engine.cache_pool import MAX_BLOCK_SIZE
from harness.engine.sampling import MAX_STOP_TOKEN_IDS
from harness.engine.scheduler import HOST_BYTES_PER_SLOT
from harness.engine.speculative.config import MAX_SPECULATIVE_TOKENS
from zoo import checks

LIMIT = 64 * 2**20  # ZOO_MEMORY_LIMIT for the refusals: 64 MiB
QUICK = 1.0  # seconds a refusal may take: pricing is arithmetic, allocating would be far slower


@pytest.fixture(scope="module")
def model():
    return zoo.build("gqa", preset="tiny")


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the engine gets as far as building its cache pool, scheduler or block managers."""
    def forbidden(*args, **kwargs):
        raise AssertionError("refused too late: the engine began allocating")

    for name in ("CachePool", "Scheduler", "BlockManager"):
        monkeypatch.setattr(harness.engine.llm_engine, name, forbidden)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def refused(match: str, build) -> str:
    """The message of the ValueError `build()` raises, checked quick, short and without the process growing."""
    rss, start = rss_bytes(), time.perf_counter()
    with pytest.raises(ValueError, match=match) as error:
        build()
    assert time.perf_counter() - start < QUICK
    assert rss_bytes() - rss < 16 * 2**20
    message = str(error.value)
    assert len(message) < 400, message
    return message


@pytest.mark.parametrize("kwargs, lower", [
    (dict(kv_cache="paged", num_blocks=10**9), "num_blocks, block_size or max_batch"),
    (dict(max_batch=10**7), "max_batch or max_seq_len"),
    (dict(max_batch=10**9), "max_batch or max_seq_len"),  # once a SystemError from the scheduler's slot list
    (dict(max_batch=10**7, kv_cache="paged", num_blocks=8), "num_blocks, block_size or max_batch"),
    (dict(max_batch=10**6, max_seq_len=512, kv_cache="paged"), "max_batch or max_seq_len"),
])
def test_an_engine_beyond_the_memory_limit_is_refused_before_allocating(model, monkeypatch, nothing_built, kwargs,
                                                                        lower):
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(LIMIT))
    message = refused("the engine's caches", lambda: Engine(model, **kwargs))
    assert f"more than the ZOO_MEMORY_LIMIT limit ({LIMIT:,} B): lower {lower}" in message


def test_a_billion_blocks_exceed_this_machine_without_a_limit(model, monkeypatch, nothing_built):
    monkeypatch.delenv("ZOO_MEMORY_LIMIT", raising=False)
    message = refused("1,000,000,000 blocks of 16 tokens", lambda: Engine(model, kv_cache="paged", num_blocks=10**9))
    assert "more than this cpu device's free memory" in message


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_batch=10**6, kv_cache="paged", num_blocks=8), "max_batch=1,000,000 is more batch slots than"),
    (dict(kv_cache="paged", num_blocks=2**31, block_size=1), "2,147,483,648 blocks per cache group are more than"),
])
def test_counts_past_the_engine_bounds_are_refused_where_memory_would_hold_them(model, monkeypatch, nothing_built,
                                                                                 kwargs, match):
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(10**16))
    refused(match, lambda: Engine(model, **kwargs))


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_a_cache_budget_beyond_the_memory_is_refused(model, nothing_built, kv_cache):
    message = refused("cache_budget_bytes", lambda: Engine(model, kv_cache=kv_cache, cache_budget_bytes=10**15))
    assert message.startswith("the cache budget would take 1,000,000,000,000,000 B, more than")


def test_the_host_bookkeeping_is_priced_too(model, monkeypatch):
    """The block managers' and scheduler's free lists count against the limit beside the tensors: a limit that holds
    the pool alone refuses the engine."""
    kwargs = dict(max_batch=64, max_seq_len=32, kv_cache="paged", num_blocks=4096, block_size=1)
    engine = Engine(model, **kwargs)
    assert engine.footprint.host == 64 * HOST_BYTES_PER_SLOT + 4096 * HOST_BYTES_PER_BLOCK
    assert engine.footprint.cache == engine.footprint.device == engine.cache_bytes_allocated
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(engine.footprint.device + engine.footprint.host - 1))
    with pytest.raises(ValueError, match="the engine's caches .* would take"):
        Engine(model, **kwargs)
    monkeypatch.setenv("ZOO_MEMORY_LIMIT", str(engine.footprint.device + engine.footprint.host))
    Engine(model, **kwargs)


@pytest.mark.parametrize("block_size", [512, 2**20])
def test_a_block_size_past_the_largest_is_refused(model, nothing_built, block_size):
    refused(fr"block_size \(tokens per paged block\) must be <= {MAX_BLOCK_SIZE}, got {block_size}",
            lambda: Engine(model, kv_cache="paged", block_size=block_size))


def test_the_largest_block_size_serves(model):
    engine = Engine(model, max_batch=1, max_seq_len=300, kv_cache="paged", block_size=MAX_BLOCK_SIZE)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("params", [SamplingParams, BeamSearchParams])
def test_a_billion_stop_ids_are_refused_by_their_count(params):
    message = refused(f"stop_token_ids holds 1,000,000,000 ids; at most {MAX_STOP_TOKEN_IDS:,} are allowed",
                      lambda: params(stop_token_ids=range(10**9)))
    assert len(message) < 100


@pytest.mark.parametrize("params", [SamplingParams, BeamSearchParams])
def test_the_most_stop_ids_are_taken(params):
    assert len(params(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids) == MAX_STOP_TOKEN_IDS
    with pytest.raises(ValueError, match="stop_token_ids holds 1,025 ids"):
        params(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))


@pytest.mark.parametrize("params", [SamplingParams, BeamSearchParams])
@pytest.mark.parametrize("stop, match", [
    (5, r"stop_token_ids must be a list or tuple of integer token ids, got 5 \(int\)"),
    ("5", r"stop_token_ids must be a list or tuple .* got '5' \(str\)"),
    ([1, "2"], r"stop_token_ids\[\] must be an integer >= 0, got '2' \(str\)"),
    ([-1], r"stop_token_ids\[\] must be >= 0, got -1"),
])
def test_bad_stop_ids_are_value_errors_naming_the_field(params, stop, match):
    with pytest.raises(ValueError, match=match):
        params(stop_token_ids=stop)


@pytest.mark.parametrize("params", [SamplingParams, BeamSearchParams])
def test_a_huge_bad_value_is_quoted_short(params):
    """A stop id that is itself a million-entry list: the message quotes the start of it."""
    huge = [list(range(10**6))]
    refused(r"stop_token_ids\[\] must be an integer >= 0, got \[0, 1, 2, 3, 4, 5, \.\.\.\] \(list\)",
            lambda: params(stop_token_ids=huge))


def test_out_of_vocabulary_ids_are_listed_first_few_and_counted():
    with pytest.raises(ValueError) as error:
        checks.in_vocabulary("stop_token_ids", range(10**6), 512, " (they could never fire)")
    assert str(error.value) == ("stop_token_ids [512, 513, 514, 515, 516] (5 of 999,488) out of vocabulary (they "
                                "could never fire): ids must lie in [0, 512)")
    with pytest.raises(ValueError, match=r"prompt token id\(s\) \[600\] out of vocabulary: ids must lie in \[0, 512\)"):
        checks.token_ids("prompt", [1, 600], 512)


@pytest.mark.parametrize("value", [True, False, "never", json.loads('"never"'), "".join(["ne", "ver"])])
def test_early_stopping_takes_equal_values(value):
    assert BeamSearchParams(early_stopping=value).early_stopping == value


@pytest.mark.parametrize("value", [1, 0, "Never", None, 1.0])
def test_early_stopping_refuses_other_values(value):
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never', got"):
        BeamSearchParams(early_stopping=value)


def test_early_stopping_read_from_json_searches_as_the_literal(model):
    engine = Engine(model, max_batch=2, max_seq_len=32, kv_cache="paged", block_size=4)
    params = json.loads('{"num_beams": 2, "max_new_tokens": 6, "early_stopping": "never", "length_penalty": 1.5}')
    from_json = engine.beam_search([5, 6, 7], BeamSearchParams(**params))
    literal = engine.beam_search([5, 6, 7], BeamSearchParams(**{**params, "early_stopping": "never"}))
    assert [(b.token_ids, b.score) for b in from_json] == [(b.token_ids, b.score) for b in literal]


def test_more_stop_ids_than_candidates_search(model):
    """1 + #stop ids candidates per beam, as transformers counts them, can outnumber the (beam, token) pairs: the
    search takes them all instead of asking topk for more than there are."""
    engine = Engine(model, max_batch=2, max_seq_len=32, kv_cache="paged", block_size=4)
    stops = tuple(range(512)) + tuple(range(100))  # every token ends a beam
    beams = engine.beam_search([5, 6, 7], BeamSearchParams(num_beams=2, max_new_tokens=4, stop_token_ids=stops))
    assert len(beams) == 1 and len(beams[0].token_ids) == 1


def test_a_billion_token_prompt_is_refused_by_its_length_first(model):
    """The length is compared with max_seq_len before any of the billion ids is read; a thousand out-of-vocabulary
    stop ids name the first few."""
    engine = Engine(model, max_batch=1, max_seq_len=64)
    message = refused(r"prompt of 1,000,000,000 tokens \+ max_new_tokens=16 exceeds max_seq_len=64",
                      lambda: engine.add_request(range(10**9), SamplingParams(max_new_tokens=16)))
    assert "1,000,000,000" in message
    stops = list(range(10**4, 10**4 + 1000))
    refused(r"stop_token_ids \[10000, 10001, 10002, 10003, 10004\] \(5 of 1,000\) out of vocabulary",
            lambda: engine.add_request([1, 2], SamplingParams(stop_token_ids=stops)))
    assert not engine.has_unfinished()


def test_speculative_tokens_are_bounded():
    """A million proposed tokens per step would size every verification forward: refused by name, at once."""
    refused(r"num_speculative_tokens \(k\) must be in \[1, 256\], got 1000000",
            lambda: SpeculativeConfig("prompt_lookup", num_speculative_tokens=10**6))
    most = SpeculativeConfig("prompt_lookup", num_speculative_tokens=MAX_SPECULATIVE_TOKENS)
    assert most.num_speculative_tokens == 256
