"""Diffusion cells of `zoo compare`: a masked diffusion LM through the LLaDA sampler, in the autoregressive rows' schema.

A diffusion cell is (context, batch, steps, cache): `batch` prompts of `context` tokens, new_tokens answer tokens
each, greedy. Its rows say what the autoregressive ones say (first complete block as the TTFT analogue, tokens/s,
cache bytes) plus forward passes per token and, for an approximate cache, how often its tokens agree with the
no-cache sampler's (the speed/quality trade Fast-dLLM makes).
"""
import torch

import zoo
from harness.diffusion import DiffusionSampler

CACHE_MODES = ("none", "prefix", "dual")


def default_steps(new_tokens: int, block_length: int) -> list[int]:
    """steps in {gen_length, gen_length/4, gen_length/16} that are whole multiples of the block count."""
    blocks = new_tokens // block_length
    candidates = {new_tokens // d for d in (1, 4, 16) if new_tokens % d == 0}
    return sorted((s for s in candidates if s >= blocks and s % blocks == 0), reverse=True)


def default_block_length(new_tokens: int) -> int:
    """LLaDA's 32-token blocks where the answer splits into them, else the whole answer as one block."""
    return 32 if new_tokens % 32 == 0 else new_tokens


def prompts_for(cell: dict, vocab: int, seed: int) -> list[list[int]]:
    """`batch` random prompts of `context` ids below `vocab`: autoregressive and diffusion cells of one
    (context, batch) get the same ones."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (cell["context"],), generator=gen).tolist() for _ in range(cell["batch"])]


def measure_diffusion_cell(model, cell: dict, seed: int, reference: dict) -> dict:
    """reference: {(context, batch, steps): the no-cache output}, filled by no-cache cells and reused by cached ones."""
    # prompts never contain the mask id: draw from the vocabulary below it (it is the last id)
    prompts = prompts_for(cell, model.config.mask_token_id, seed)
    sampler_for = lambda cache: DiffusionSampler(model, steps=cell["steps"], block_length=cell["block_length"],  # noqa: E731
                                                 cache=None if cache == "none" else cache)
    out = sampler_for(cell["diffusion_cache"]).generate(prompts, cell["new_tokens"])
    key = (cell["context"], cell["batch"], cell["steps"])
    agreement = None
    if cell["diffusion_cache"] == "none":
        reference[key] = out
    else:
        if key not in reference:  # resumed after its no-cache cell: recompute it (untimed)
            reference[key] = sampler_for("none").generate(prompts, cell["new_tokens"])
        agreement = out.agreement(reference[key])
    generated = sum(map(len, out.token_ids))
    return {
        **cell,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": zoo.parameter_bytes(model),
        "analytic_cache_bytes": out.cache_bytes,
        "measured_cache_bytes": out.cache_bytes_allocated,
        "cache_bytes_per_token": 0,
        "forward_passes": out.forward_passes,
        "forwards_per_token": out.forward_passes / cell["new_tokens"],
        "tokens_per_forward": out.tokens_per_forward,
        "ttft_ms": 1000 * out.first_block_s,  # the first complete block: the earliest tokens a user can read
        "tpot_ms": (1000 * (out.wall_s - out.first_block_s) / (cell["new_tokens"] - cell["block_length"])
                    if cell["new_tokens"] > cell["block_length"] else None),  # per token after the first block
        "itl_p99_ms": None,
        "step_ms_p50": None,
        "decode_tok_s": generated / out.wall_s,
        "output_tok_s": generated / out.wall_s,
        "agreement_vs_no_cache": agreement,
        "mbu": None,
        "wall_s": out.wall_s,
    }
