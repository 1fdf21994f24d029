"""The conformance suite's core on the device, in fp32 and bf16, for every registered causal architecture at the
`tiny` size: cached decode = full forward, paged = contiguous, allocated cache bytes = analytic bytes.

fp32: the same greedy tokens and logits within FP32_ATOL. bf16: vLLM's rule for model tests, since bf16 near-ties
flip between kernels that sum in other orders: where two greedy tokens differ, each is in the other side's top 5
(hf_agreement.within_top_k). A full forward over the engine's own tokens sees the same inputs at every step, so
there the rule holds at every step; two independent runs are compared up to their first difference only."""
import pytest
import torch

import zoo
from helpers import assert_not_constant, greedy, make_prompts, random_model
from hf_agreement import first_difference, within_top_k
from test_conformance import ARCHS, BLOCK_SIZE, LAYOUTS, MAX_SEQ_LEN, engine_for

PROMPT_LENGTHS = [1, 5, 17, 33]  # a fresh sequence, one inside a block, several blocks, past the tiny window
NEW_TOKENS = 16
# fp32 on a GPU: kernels that split and sum in other orders than the full forward's
FP32_ATOL = 1e-3
# device bytes an engine may allocate beside its cache and its graphs' buffers: block tables, slot maps, the
# allocator's rounding of each tensor to 512 bytes; under the tiny caches here (0.1-0.8 MB), so a second copy shows
ENGINE_SLACK_BYTES = 64 * 2**10


@pytest.fixture(scope="module", params=ARCHS)
def model(request, device, model_dtype):
    return random_model(request.param, seed=ARCHS.index(request.param)).to(device, model_dtype)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    return make_prompts(PROMPT_LENGTHS, model.config.vocab_size, seed=1)


@pytest.fixture(scope="module")
def outputs(model, prompts) -> dict:
    """Each layout's greedy run over the prompts, one batch, computed once for the tests below."""
    return {layout: engine_for(model, layout, max_batch=len(prompts)).generate(prompts, greedy(NEW_TOKENS))
            for layout in LAYOUTS}


def logits_of(out) -> torch.Tensor:
    return torch.stack(out.logits).float().cpu()


def assert_same_greedy_steps(got_tokens, got_logits, want_tokens, want_logits, dtype, context) -> None:
    """Step by step on the same inputs: fp32 equal tokens and close logits; bf16 each difference within top 5."""
    if dtype == torch.float32:
        assert got_tokens == want_tokens, f"{context}: tokens differ\n got  {got_tokens}\n want {want_tokens}"
        err = (got_logits - want_logits).abs().max().item()
        assert err <= FP32_ATOL, f"{context}: logits differ by {err:.3g}"
        return
    for step, (a, b) in enumerate(zip(got_tokens, want_tokens)):
        assert a == b or within_top_k(a, got_logits[step], b, want_logits[step]), (
            f"{context}: step {step} tokens {a} and {b} are not in each other's top 5")


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_cached_decode_matches_full_forward(model, prompts, outputs, model_dtype, kv_cache):
    for prompt, out in zip(prompts, outputs[kv_cache]):
        context = f"{model.config.name}/{kv_cache}/{model_dtype} prompt len {len(prompt)}"
        assert len(out.token_ids) == NEW_TOKENS, context
        assert_not_constant(out.token_ids, context)
        cached = logits_of(out)
        assert cached.argmax(-1).tolist() == out.token_ids, context  # greedy: each token is its logits' argmax
        with torch.no_grad():
            full = model(torch.tensor([prompt + out.token_ids[:-1]], device=model.embed.weight.device))
        full = full[0, len(prompt) - 1:].float().cpu()
        assert_same_greedy_steps(out.token_ids, cached, full.argmax(-1).tolist(), full, model_dtype, context)


def test_paged_equals_contiguous(prompts, outputs, model_dtype):
    for prompt, paged, contiguous in zip(prompts, outputs["paged"], outputs["contiguous"]):
        context = f"paged vs contiguous, {model_dtype}, prompt len {len(prompt)}"
        # two runs feed their own tokens back: past a first difference their inputs differ, so compare up to it
        step = first_difference(paged.token_ids, contiguous.token_ids)
        end = NEW_TOKENS if step is None else step + 1
        assert_same_greedy_steps(paged.token_ids[:end], logits_of(paged)[:end], contiguous.token_ids[:end],
                                 logits_of(contiguous)[:end], model_dtype, context)


def allocated_device_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


@pytest.mark.parametrize("kv_cache", LAYOUTS)
def test_allocated_cache_bytes_equal_analytic(model, device, kv_cache):
    max_batch = 8
    before = allocated_device_bytes(device)
    engine = engine_for(model, kv_cache, max_batch=max_batch)
    grown = allocated_device_bytes(device) - before
    if kv_cache == "contiguous":
        assert engine.cache_bytes_allocated == zoo.cache_bytes(model, seq_len=MAX_SEQ_LEN, batch=max_batch) > 0
    else:  # one block of every group and one state slot cost BLOCK_SIZE tokens; the pool is whole blocks and slots
        pool, managers = engine.pool, engine.block_managers
        block_bytes = [pool.block_bytes(group) for group in range(len(managers))]
        assert sum(block_bytes) + pool.state_slot_bytes == zoo.cache_bytes(model, seq_len=BLOCK_SIZE) > 0
        assert engine.cache_bytes_allocated == (sum(m.num_blocks * b for m, b in zip(managers, block_bytes))
                                                + max_batch * pool.state_slot_bytes)
    if device.type == "cuda":  # the cache really is on the device, once (graph_bytes: the spare row and inputs)
        allocated = engine.cache_bytes_allocated
        assert allocated <= grown <= allocated + engine.graph_bytes + ENGINE_SLACK_BYTES, (grown, allocated,
                                                                                         engine.graph_bytes)
