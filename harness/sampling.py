"""Sampling parameters and the token sampler: repetition penalty -> temperature -> top-k -> top-p."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off; applied after top-k
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in prompt or output (CTRL/HF rule)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    return_logits: bool = False  # keep the logits each token was sampled from (tests, oracles)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits: [V]; seen: token ids already in the sequence. Positive logits are divided, negative multiplied."""
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches p, the token that crosses p included."""
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_token(logits: torch.Tensor, params: SamplingParams, history: list[int], generator: torch.Generator | None) -> int:
    """logits: [V] for one sequence; history: prompt and generated ids so far."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and history:
        logits = apply_repetition_penalty(logits, torch.tensor(sorted(set(history)), device=logits.device), params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    logits = top_p_filter(top_k_filter(logits / params.temperature, params.top_k), params.top_p)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
