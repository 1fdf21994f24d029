"""Helpers the suites share: random models whose greedy continuations vary, prompts, and output comparisons."""
import torch
from torch import nn

import zoo
from harness import SamplingParams
from zoo.ffn.experts import ExpertLinear
from zoo.ffn.router import Router


@torch.no_grad()
def spread_weights(model: nn.Module, seed: int = 0, gain: float = 2.0) -> nn.Module:
    """Re-initialise linear and embedding weights at a larger scale.

    The default init (std 0.02, tied head) makes a random model repeat its last input token forever,
    so greedy tests could not tell a right cache from a wrong one. Unit-variance embeddings and
    gain/sqrt(fan_in) projections give continuations that change every step.
    """
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
        elif isinstance(module, (nn.Linear, ExpertLinear, Router)):  # an MoE's router and stacked experts too
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * gain * module.in_features**-0.5)
    return model.eval()


def random_model(arch: str, seed: int = 0, **overrides) -> nn.Module:
    """A "tiny" preset model of `arch` (fp32, untied head) with weights that make greedy decoding non-trivial."""
    overrides.setdefault("tie_embeddings", False)
    torch.manual_seed(seed)
    return spread_weights(zoo.build(arch, preset="tiny", **overrides), seed=seed)


def make_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, return_logits=True, **kwargs)


def assert_same_output(got, want, atol: float = 1e-4, context: str = "") -> None:
    """Same greedy tokens and logits within atol (logits are compared step by step)."""
    assert got.token_ids == want.token_ids, f"{context}: tokens differ\n got  {got.token_ids}\n want {want.token_ids}"
    assert len(got.logits) == len(want.logits) == len(want.token_ids), context
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        err = (a - b).abs().max().item()
        assert err <= atol, f"{context}: logits differ at step {step} by {err:.3g}"


def assert_not_constant(token_ids, context: str = "") -> None:
    """Guard: a run whose output is one repeated token cannot distinguish a right cache from a wrong one."""
    assert len(set(token_ids)) > 1, f"{context}: degenerate continuation {token_ids}; the test would prove nothing"


@torch.no_grad()
def coupled_model(arch: str, seed: int, mixing: float = 4.0, vocab_size: int = 64, **overrides) -> nn.Module:
    """A "tiny" model whose embedding and head are the same for every arch and seed, so its greedy continuation is
    largely a fixed token -> token map that its layers (weights scaled by `mixing`) bend by context: two such models
    of any architectures agree on some tokens and not others, which is what speculative decoding's tests need (a
    draft that always or never agrees would skip the rollback to a middle token)."""
    torch.manual_seed(seed)
    model = zoo.build(arch, preset="tiny", tie_embeddings=False, vocab_size=vocab_size, **overrides)
    shared = torch.Generator().manual_seed(1234)
    model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=shared))
    model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=shared) * 0.2)
    for block in model.blocks:
        for weight in block.parameters():
            if weight.dim() >= 2:
                weight.mul_(mixing)
    return model.eval()
