"""The HF oracles on the device, fp32, with the parity suites' models (tests/test_hf_parity.py, test_mamba.py,
test_mamba2.py): Llama for mha / gqa / mqa, Mistral for a sliding window, DeepseekV3 for MLA, Mamba and Mamba-2.
The same weights give logits within LOGITS_ATOL of HF's, and the engine's greedy tokens equal HF's `generate`."""
import pytest
import torch

import test_hf_parity as attention_suite
import test_mamba as mamba_suite
import test_mamba2 as mamba2_suite
import zoo
from harness import Engine, SamplingParams
from helpers import assert_not_constant

NEW_TOKENS = 64
# the suites hold 1e-4 on CPU; a GPU's attention and matmul kernels sum in other orders
LOGITS_ATOL = 1e-3


def llama(case: str):
    return attention_suite.random_llama(seed=len(case), **attention_suite.CASES[case]), attention_suite.prompt_ids()


def family(case: str):
    return attention_suite.random_family(case, seed=len(case)), attention_suite.prompt_ids()


def mamba2(case: str):
    mamba2_suite.skip_unless_hf_oracle(case)
    return mamba2_suite.hf_mamba2(seed=len(case), **mamba2_suite.HF_CASES[case]), mamba2_suite.prompt_ids()


# name: () -> (HF model in fp32 on the CPU, prompt token ids)
ORACLES = {
    "mha": lambda: llama("mha"),
    "gqa": lambda: llama("gqa"),
    "mqa": lambda: llama("mqa"),
    "swa": lambda: family("mistral_window"),
    "mla": lambda: family("mla_interleave"),
    "mla-q-lora": lambda: family("mla_q_lora_no_interleave"),
    "mamba": lambda: (mamba_suite.random_hf_mamba(), mamba_suite.prompt_ids()),
    "mamba2": lambda: mamba2("groups1"),
    "mamba2-groups2": lambda: mamba2("groups2_tied_bias"),
}


@pytest.fixture(scope="module", params=ORACLES)
def oracle(request, device):
    """(HF model, the zoo model converted from it, prompt), both models on the device."""
    hf, prompt = ORACLES[request.param]()
    model = zoo.from_hf(hf).eval()
    return hf.to(device), model.to(device), prompt


@pytest.fixture(scope="module")
def hf_continuation(oracle) -> list[int]:
    hf, _, prompt = oracle
    prompt_ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():  # no EOS id: a default one would end generation early
        generated = hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return generated[0, len(prompt):].tolist()


def test_logits_match(oracle):
    hf, model, prompt = oracle
    tokens = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        want, got = hf(tokens).logits, model(tokens)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits differ from HF by {err:.3g}"
    assert want.std() > 0.5  # spread weights: the comparison means something


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_greedy_equals_generate(oracle, hf_continuation, kv_cache):
    _, model, prompt = oracle
    assert_not_constant(hf_continuation, "HF continuation")
    engine = Engine(model, max_batch=2, max_seq_len=len(prompt) + NEW_TOKENS, kv_cache=kv_cache, block_size=8)
    got = engine.generate([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0].token_ids
    assert got == hf_continuation, (f"{kv_cache}: first difference at step "
                                    f"{next(i for i, (a, b) in enumerate(zip(got, hf_continuation)) if a != b)}")
