"""Sampling parameters and the token sampler: repetition penalty -> temperature -> top-k -> top-p."""
from dataclasses import dataclass

import torch

from zoo import checks

# Stop ids a request may name: far more than any tokenizer has end tokens (Llama 3 has 3), few enough that the
# per-token membership test and the vocabulary check stay trivial; range(10**9) is refused by its length at once
MAX_STOP_TOKEN_IDS = 1024


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
        """Types and ranges, checked once here; stop ids are checked against the vocabulary by the engine."""
        stop_token_ids = checks.id_tuple("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        checked = {
            "max_new_tokens": checks.integer("max_new_tokens", self.max_new_tokens, minimum=1),
            "temperature": checks.real("temperature (0 = greedy)", self.temperature, minimum=0),
            "top_k": checks.integer("top_k (0 = off)", self.top_k, minimum=0),
            "top_p": checks.real("top_p", self.top_p, minimum=0, maximum=1, open_min=True),
            "repetition_penalty": checks.real("repetition_penalty (1 = off)", self.repetition_penalty, minimum=0,
                                              open_min=True),
            "seed": checks.optional_integer("seed", self.seed, minimum=0, maximum=2**64 - 1),
            "stop_token_ids": stop_token_ids,
            "return_logits": checks.boolean("return_logits", self.return_logits),
        }
        for name, value in checked.items():  # normalised: numpy ints become ints, ints given as reals become floats
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits: [V]; seen: token ids already in the sequence. Positive logits are divided, negative multiplied;
    an extreme penalty saturates at the dtype's largest finite value instead of overflowing to inf."""
    picked = logits[seen]
    logits = logits.clone()
    limit = torch.finfo(logits.dtype).max
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(-limit, limit)
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
    drop_sorted[..., 0] = False  # the top token always survives, however small p is
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_token(logits: torch.Tensor, params: SamplingParams, history: list[int], generator: torch.Generator | None) -> int:
    """logits: [V] for one sequence; history: prompt and generated ids so far."""
    if params.greedy:
        return int(processed_logits(logits, params, history).argmax())
    return int(torch.multinomial(token_distribution(logits, params, history), 1, generator=generator))


def processed_logits(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The logits after the repetition penalty, as float64 (so settings like a temperature of 1e-300 keep their
    value instead of rounding to 0 or inf); logits that are not finite are an error."""
    logits = logits.double()
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError(f"the model produced {int((~torch.isfinite(logits)).sum())} non-finite logit(s)")
    if params.repetition_penalty != 1.0 and history:
        logits = apply_repetition_penalty(logits, torch.tensor(sorted(set(history)), device=logits.device), params.repetition_penalty)
    return logits


def token_distribution(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """The probabilities [V] (float64) a sampled token is drawn from: repetition penalty, temperature, top-k, top-p
    (speculative decoding applies the same to the draft's and the target's logits). Greedy: one-hot at the argmax.

    Works relative to the largest logit, so no setting overflows: a temperature so small that every other token's
    scaled logit underflows leaves only the top token(s), i.e. greedy."""
    logits = processed_logits(logits, params, history)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    shifted = (logits - logits.max()) / params.temperature  # <= 0, the top token(s) exactly 0: softmax is safe
    shifted = top_p_filter(top_k_filter(shifted, params.top_k), params.top_p)
    return shifted.softmax(-1)
