"""The engine's memory estimate, as a property (issue 33): for random registry models and engine sizes under a small
ZOO_MEMORY_LIMIT, either the estimate refuses before the cache pool is built, naming more bytes than the limit, or
the engine builds within the limit and its measured cache (the pool's tensors' nbytes) is the estimate's."""
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

import zoo
from harness import Engine
from harness.engine import llm_engine

# gqa, latent, state only, a sliding window, sinks, chunks, a cross-layer share and a hybrid of attention and state
ARCHS = ["gqa", "mla", "mamba2", "swa", "sink", "chunked", "cla", "hybrid-1in6"]
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "archzoo-hypothesis")
PROPERTY = settings(deadline=None, database=None, derandomize=True, max_examples=200)


@pytest.fixture(scope="module")
def models():
    """One tiny model per architecture, built before any limit is set (building is priced against it too)."""
    return {arch: zoo.build(arch, preset="tiny") for arch in ARCHS}


@contextmanager
def memory_limit(nbytes: int):
    """ZOO_MEMORY_LIMIT for one example (monkeypatch is function-scoped, and a property runs many examples)."""
    before = os.environ.get("ZOO_MEMORY_LIMIT")
    os.environ["ZOO_MEMORY_LIMIT"] = str(nbytes)
    try:
        yield
    finally:
        if before is None:
            del os.environ["ZOO_MEMORY_LIMIT"]
        else:
            os.environ["ZOO_MEMORY_LIMIT"] = before


@st.composite
def engine_sizes(draw) -> tuple[str, dict, int]:
    """(architecture, Engine keyword arguments, memory limit): every option valid, only the memory in question."""
    arch = draw(st.sampled_from(ARCHS))
    kv_cache = draw(st.sampled_from(["contiguous", "paged"]))
    kwargs = dict(kv_cache=kv_cache, max_batch=draw(st.integers(1, 64)), max_seq_len=draw(st.integers(1, 512)),
                  block_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])),
                  cuda_graphs=draw(st.sampled_from([False, "static"])))
    if kv_cache == "paged" and draw(st.booleans()):
        kwargs["num_blocks"] = draw(st.integers(1, 4096))
    if arch != "mamba2":  # a state-only model keeps no per-token cache to store in one byte
        kwargs["kv_dtype"] = draw(st.sampled_from(["auto", "int8"]))
    return arch, kwargs, draw(st.integers(12, 24).flatmap(lambda e: st.integers(2**e, 2 ** (e + 1))))  # 4 KiB to 32 MiB


@PROPERTY
@given(case=engine_sizes())
def test_the_estimate_refuses_before_work_or_is_what_the_engine_allocates(models, case):
    arch, kwargs, limit = case
    with memory_limit(limit), mock.patch.object(llm_engine, "CachePool", wraps=llm_engine.CachePool) as pool:
        try:
            engine = Engine(models[arch], **kwargs)
        except ValueError as error:
            asked = re.search(r"would take ([\d,]+) B, more than the ZOO_MEMORY_LIMIT limit \(([\d,]+) B\)", str(error))
            assert asked, error
            assert int(asked[1].replace(",", "")) > int(asked[2].replace(",", "")) == limit
            assert not pool.called  # refused before the pool was built
            event("refused")
            return
    event("built")
    needs = engine.footprint
    assert needs.device + needs.host <= limit
    assert abs(engine.cache_bytes_allocated - needs.cache) <= 0.1 * needs.cache
    graphs = engine.runner.graphs
    inputs = 0 if graphs is None else graphs.inputs.nbytes
    assert abs(engine.pool.allocated_bytes + inputs - needs.device) <= 0.1 * needs.device
