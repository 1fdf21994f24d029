"""Which proposed tokens a verification keeps: speculative sampling's acceptance rule (Leviathan et al. 2023; Chen
et al. 2023), under which the emitted tokens are distributed exactly as sampling from the target alone.

For each proposed token x_i, in order: accept it with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
emit a token drawn from norm(max(0, p_i - q_i)) instead, and stop; if every proposal passes, emit a bonus token drawn
from p at the position after the last one. p and q are the target's and the draft's distributions after the same
repetition penalty, temperature, top-k and top-p (harness.engine.sampling.token_distribution) given the same history; a
proposer without a model (prompt lookup) is a q that puts all its mass on its token. Greedy: keep proposals while
each equals the target's argmax, then emit the argmax.
"""
import torch

from harness.engine.sampling import SamplingParams, processed_logits, sample_token, token_distribution


def verify(target_logits: torch.Tensor, proposed: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           history: list[int], generator: torch.Generator | None) -> list[int]:
    """target_logits [>= len(proposed) + 1, V]: the target's logits at the position before each proposed token and
    after the last; draft_probs [len(proposed), V] the draft's distributions each was drawn from (None: proposed
    deterministically). Returns the tokens to emit: the accepted prefix of `proposed` and one more from the target."""
    emitted: list[int] = []
    for i, token in enumerate(proposed):
        if params.greedy:
            best = int(processed_logits(target_logits[i], params, history + emitted).argmax())
            if best != token:
                return emitted + [best]
        else:
            p = token_distribution(target_logits[i], params, history + emitted)
            q = None if draft_probs is None else draft_probs[i].to(p)
            q_token = 1.0 if q is None else float(q[token])
            u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
            if u * q_token >= float(p[token]):  # rejected: u >= p / q
                return emitted + [int(torch.multinomial(residual(p, q, token), 1, generator=generator))]
        emitted.append(token)
    return emitted + [sample_token(target_logits[len(proposed)], params, history + emitted, generator)]


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): where the target wants more than the draft offered (q None: all of the draft's mass on
    `token`). p equal to q leaves nothing; a rejection then cannot happen, but rounding is answered with p."""
    left = p.clone().index_fill_(0, torch.tensor([token], device=p.device), 0.0) if q is None else (p - q).clamp_min(0)
    total = left.sum()
    return left / total if total > 0 else p
