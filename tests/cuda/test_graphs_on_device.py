"""On CUDA: decode replayed from captured graphs gives the tokens of the same padded step run eagerly ("static"),
and of the plain eager step, for every causal architecture in both layouts."""
import pytest
import torch

from harness import Engine
from zoo.registry import architectures, is_causal
from helpers import assert_not_constant, assert_same_output, greedy, make_prompts, random_model

CAUSAL = [name for name in architectures() if is_causal(name)]
LENGTHS, NEW_TOKENS = [5, 19, 11], [9, 4, 6]  # batches of 3, 2, 1: buckets 4, 2, 1
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs capture CUDA work")


def generate(model, kv_cache, cuda_graphs, kv_dtype="auto"):
    engine = Engine(model, max_batch=5, max_seq_len=48, kv_cache=kv_cache, block_size=8, cuda_graphs=cuda_graphs,
                    kv_dtype=kv_dtype)
    outs = engine.generate(make_prompts(LENGTHS, model.config.vocab_size), [greedy(n) for n in NEW_TOKENS])
    return engine, outs


BF16 = ["gqa", "mla", "mamba2", "hybrid-1in6"]  # one per cache kind: GPU minutes are scarce


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch,dtype", [(a, torch.float32) for a in CAUSAL] + [(a, torch.bfloat16) for a in BF16])
def test_graph_replay_equals_eager(arch, kv_cache, dtype):
    model = random_model(arch).to("cuda", dtype)
    engine, replayed = generate(model, kv_cache, cuda_graphs=True)
    assert engine.cuda_graphs and engine.cuda_graphs_off == "", engine.cuda_graphs_off
    assert engine.graph_bytes > 0
    _, static = generate(model, kv_cache, cuda_graphs="static")
    _, plain = generate(model, kv_cache, cuda_graphs=False)
    for got, padded, want in zip(replayed, static, plain):
        assert_not_constant(want.token_ids, arch)
        # the same kernels on the same padded shapes: the same tokens and logits
        assert_same_output(got, padded, atol=0.0, context=f"{arch} {kv_cache} {dtype} replay vs static")
        if dtype == torch.float32:  # other batch shapes may pick other GEMM kernels: close, not bitwise
            assert_same_output(got, want, atol=1e-3, context=f"{arch} {kv_cache} replay vs eager")


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("arch,kv_dtype", [("gqa", "int8"), ("mla", "fp8"), ("hybrid-1in6", "int8")])
def test_one_byte_cache_graph_replay_equals_static(arch, kv_dtype, kv_cache):
    model = random_model(arch).to("cuda", torch.bfloat16)
    engine, replayed = generate(model, kv_cache, cuda_graphs=True, kv_dtype=kv_dtype)
    assert engine.cuda_graphs, engine.cuda_graphs_off
    _, static = generate(model, kv_cache, cuda_graphs="static", kv_dtype=kv_dtype)
    for got, padded in zip(replayed, static):
        assert_same_output(got, padded, atol=0.0, context=f"{arch} {kv_cache} {kv_dtype} replay vs static")
