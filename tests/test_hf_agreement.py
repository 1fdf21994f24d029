"""benchmarks/hf_agreement.py's greedy check against transformers: a continuation that picks Llama's default EOS id
(2) is still compared token for token, as archzoo's engine (which stops at no EOS) generates it."""
import sys

import torch

import harness
from helpers import random_model  # tests/ is on sys.path under pytest
from tests.conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # the benchmarks import each other as scripts run there would
from decode_vs_hf import hf_twin  # noqa: E402
from hf_agreement import agreement  # noqa: E402

NEW_TOKENS = 24


def test_a_continuation_through_the_eos_id_agrees():
    model = random_model("gqa", vocab_size=8)  # 8 tokens: greedy picks token 2 within a few steps
    prompts = torch.randint(0, 8, (2, 12), generator=torch.Generator().manual_seed(0))
    engine = harness.Engine(model, max_batch=2, max_seq_len=64)
    ours = engine.generate(prompts.tolist(), harness.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    assert any(2 in out.token_ids for out in ours)  # the case under test: Llama's default eos_token_id
    assert agreement(hf_twin(model), engine, prompts, NEW_TOKENS) == f"identical ({NEW_TOKENS}/{NEW_TOKENS})"
