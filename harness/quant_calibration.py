"""What AWQ (zoo.quantize, method "awq") is calibrated on when the quantized model is for generation.

- Activations: windows of the training split of the model's corpus (never the validation windows it is scored on).
- Score: a decoder is used by running it, so of AWQ's candidate scales only those that reproduce as much of the
  unquantized model's greedy output as plain rounding does qualify: greedy continuations of training-split prompts,
  the share of positions where a candidate's token equals the unquantized model's. Teacher-forced measures alone
  (KL, top-token agreement on text) do not settle this: on the tiny trained gqa model, AWQ's one-alpha candidates
  reproduce 29% to 39% of the greedy tokens, not in the order of their KL, and their order on training-split prompts
  largely carries over to held-out ones (rank correlation 0.66 over all 24 candidates).
"""
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zoo
from harness.engine import Engine
from harness.engine.sampling import SamplingParams
from harness.train.corpus import load_corpus, training_batch


@dataclass(frozen=True)
class Calibration:
    windows: int = 64  # training-split windows whose activations AWQ's scales come from
    context: int = 256  # bytes per window
    prompts: int = 256  # training-split prompts the greedy score runs
    prompt_len: int = 64
    new_tokens: int = 192  # greedy tokens per prompt
    seed: int = 0


def greedy_tokens(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`model`'s greedy continuation of each prompt (prompts of one length), all in one engine batch."""
    engine = Engine(model, max_batch=len(prompts), max_seq_len=len(prompts[0]) + new_tokens)
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))]


def greedy_agreement(model, prompts: list[list[int]], new_tokens: int) -> Callable:
    """A score for zoo.quantize: the share of greedy tokens a candidate model produces equal, position by position,
    to `model`'s own on the same prompts (its run is made once, here)."""
    reference = greedy_tokens(model, prompts, new_tokens)

    def score(candidate) -> float:
        got = greedy_tokens(candidate, prompts, new_tokens)
        return sum(a == b for x, y in zip(reference, got) for a, b in zip(x, y)) / (len(prompts) * new_tokens)

    return score


def awq_quantize(model, config: zoo.QuantizeConfig, corpus: str | Path | None = None,
                 calibration: Calibration = Calibration(), device: str = "cpu"):
    """zoo.quantize with AWQ calibrated on the training split of `corpus` (None: the standard library) and judged by
    greedy_agreement on training-split prompts drawn apart from the windows (another step of the seed)."""
    text = load_corpus(Path(corpus) if corpus else None)
    windows = training_batch(text, calibration.seed, 0, calibration.windows, calibration.context).to(device)
    prompts = training_batch(text, calibration.seed, 1, calibration.prompts, calibration.prompt_len).tolist()
    return zoo.quantize(model, config, windows, score=greedy_agreement(model, prompts, calibration.new_tokens))
