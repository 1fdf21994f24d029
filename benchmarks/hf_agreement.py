"""What the benchmarks run against transformers: the greedy-token check (vLLM's rule for model tests) and the
timed greedy generations on each side."""
import time

import torch

import harness


def time_hf(hf, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds for transformers' greedy generate of exactly new_tokens per prompt."""
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def time_zoo(engine, prompts: torch.Tensor, new_tokens: int) -> float:
    """Seconds for the engine's greedy generate of new_tokens per prompt."""
    start = time.perf_counter()
    engine.generate(prompts.tolist(), harness.SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    return time.perf_counter() - start


def agreement(hf, engine, prompts: torch.Tensor, new_tokens: int) -> str:
    """vLLM's rule for model tests: greedy tokens identical, or at the first step where a row diverges each
    side's token is in the other's top 5 (rows are not compared past that step: their inputs differ)."""
    with torch.inference_mode():
        hf_out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    ours = engine.generate(prompts.tolist(), harness.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, return_logits=True))
    hf_tokens = hf_out.sequences[:, prompts.shape[1]:]
    diverged = []
    for row, out in enumerate(ours):
        mismatch = [i for i, (a, b) in enumerate(zip(hf_tokens[row].tolist(), out.token_ids)) if a != b]
        if not mismatch:
            continue
        step = mismatch[0]
        ours_top5 = out.logits[step].topk(5).indices.tolist()
        hf_top5 = hf_out.scores[step][row].topk(5).indices.tolist()
        if int(hf_tokens[row, step]) not in ours_top5 or out.token_ids[step] not in hf_top5:
            return f"FAIL: row {row} step {step} outside top-5"
        diverged.append(step)
    if not diverged:
        return f"identical ({new_tokens}/{new_tokens})"
    return f"{len(ours) - len(diverged)}/{len(ours)} rows identical; others diverge at step >= {min(diverged)} within top-5"
