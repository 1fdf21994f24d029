"""Scored KV eviction (H2O, TOVA, SnapKV) through the engine on the device, in fp32: the same greedy tokens and
logits as the same model's engine on the CPU (where tests/test_kv_eviction.py holds it to the float64 evicting
reference), in both layouts, with CUDA graphs off and the reason named."""
import pytest
import torch

import zoo
from harness import Engine
from helpers import greedy, make_prompts, random_model

POLICIES = ["h2o", "tova", "snapkv"]
LAYOUTS = ["contiguous", "paged"]
# a 29-token prompt scores and cuts its keys at prefill; the 3-token one fills its budget while decoding
PROMPT_LENGTHS = [29, 3, 12, 17]
NEW_TOKENS = 20
FP32_ATOL = 1e-3  # the device's kernels sum in other orders than the CPU's


def evicting_model(policy: str):
    return zoo.evict(random_model("gqa", seed=POLICIES.index(policy)), policy=policy, budget=9, sinks=1,
                     window=3).eval()


def generate(model, kv_cache: str):
    engine = Engine(model, max_batch=len(PROMPT_LENGTHS), max_seq_len=64, kv_cache=kv_cache, block_size=4)
    prompts = make_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=3)
    return engine, engine.generate(prompts, greedy(NEW_TOKENS))


@pytest.mark.parametrize("kv_cache", LAYOUTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_on_the_device_generates_what_the_cpu_does(device, policy, kv_cache):
    model = evicting_model(policy)
    _, want = generate(model, kv_cache)
    engine, got = generate(model.to(device), kv_cache)
    if device.type == "cuda":
        assert "scored retention" in engine.cuda_graphs_off
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {i}: tokens differ\n got  {g.token_ids}\n want {w.token_ids}"
        err = (torch.stack(g.logits).float().cpu() - torch.stack(w.logits).float()).abs().max().item()
        assert err <= FP32_ATOL, f"request {i}: logits differ by {err:.3g}"
