"""What the benchmarks run against transformers: the greedy-token check (vLLM's rule for model tests) and the
timed greedy generations on each side."""
import time

import torch

import harness

TOP_K = 5  # vLLM's model tests compare greedy runs by their top-5 logprobs
# generate() runs without an EOS id, as archzoo's engine does: with Llama's default (2) it would stop there, and
# min_new_tokens would mask token 2 out of the scores (a vocab-512 model picked it at step 29, and the check failed)


def time_hf(hf, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds for transformers' greedy generate of exactly new_tokens per prompt."""
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                    do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def time_zoo(engine, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds for the engine's greedy generate of new_tokens per prompt."""
    start = time.perf_counter()
    engine.generate(prompts.tolist(), harness.SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    return time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first step at which two greedy runs pick different tokens; None where they agree throughout."""
    return next((step for step, (x, y) in enumerate(zip(a, b)) if x != y), None)


def within_top_k(token_a: int, logits_a: torch.Tensor, token_b: int, logits_b: torch.Tensor, k: int = TOP_K) -> bool:
    """vLLM's rule at a step where two greedy runs differ: each side's token is among the other side's top k."""
    return token_b in logits_a.topk(k).indices.tolist() and token_a in logits_b.topk(k).indices.tolist()


def agreement(hf, engine, prompts: torch.Tensor, new_tokens: int) -> str:
    """vLLM's rule for model tests: greedy tokens identical, or at the first step where a row diverges each
    side's token is in the other's top 5 (rows are not compared past that step: their inputs differ)."""
    with torch.inference_mode():
        hf_out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    ours = engine.generate(prompts.tolist(), harness.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, return_logits=True))
    hf_tokens = hf_out.sequences[:, prompts.shape[1]:].tolist()
    if any(len(row) != new_tokens for row in hf_tokens):
        raise RuntimeError(f"transformers generated {len(hf_tokens[0])} tokens, not {new_tokens}")
    diverged = []
    for row, out in enumerate(ours):
        step = first_difference(hf_tokens[row], out.token_ids)
        if step is None:
            continue
        if not within_top_k(out.token_ids[step], out.logits[step].to(hf_out.scores[step].device),
                            hf_tokens[row][step], hf_out.scores[step][row]):
            return f"FAIL: row {row} step {step} outside top-5"
        diverged.append(step)
    if not diverged:
        return f"identical ({new_tokens}/{new_tokens})"
    return f"{len(ours) - len(diverged)}/{len(ours)} rows identical; others diverge at step >= {min(diverged)} within top-5"
