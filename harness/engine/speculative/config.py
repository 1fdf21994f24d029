"""What speculative decoding to run: who proposes (a draft model, or prompt lookup) and how many tokens per step."""
from dataclasses import dataclass

from torch import nn

from zoo import checks

PROMPT_LOOKUP = "prompt_lookup"
# most tokens one step may propose: far above what pays (vLLM's drafts propose a handful, EAGLE's trees about 60),
# and a bound on what every step's verification forward and rollback room are sized for
MAX_SPECULATIVE_TOKENS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """draft: a causal model with the target's vocabulary (any registry architecture, e.g. a trained tiny gqa or
    mamba), or "prompt_lookup": the tokens that followed the latest earlier occurrence of the context's last n-gram
    (no model; Saxena 2023, vLLM's ngram proposer).
    num_speculative_tokens: k, the tokens proposed per step (vLLM's name); the target verifies k + 1 positions in one
    forward. Fixed: every step of every request proposes k (fewer only where the request has fewer left to make,
    or prompt lookup finds a shorter continuation).
    prompt_lookup_max / prompt_lookup_min: the n-gram lengths tried, longest first (vLLM's names)."""

    draft: "nn.Module | str"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self):
        checks.integer("num_speculative_tokens (k)", self.num_speculative_tokens, minimum=1,
                       maximum=MAX_SPECULATIVE_TOKENS)
        if isinstance(self.draft, str):
            checks.choice("draft (a model, or the proposer without one)", self.draft, (PROMPT_LOOKUP,))
            checks.integer("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
            checks.integer(f"prompt_lookup_max (prompt_lookup_min={self.prompt_lookup_min} at least)",
                           self.prompt_lookup_max, minimum=self.prompt_lookup_min)
        elif not isinstance(self.draft, nn.Module) or not hasattr(self.draft, "config"):
            raise ValueError(f"draft must be a zoo model (zoo.build / zoo.load) or {PROMPT_LOOKUP!r}, got "
                             f"{type(self.draft).__name__}")

    def check_target(self, target: nn.Module) -> None:
        """The draft can propose for this target: same vocabulary, decodes left to right, on the same device."""
        if isinstance(self.draft, str):
            return
        draft, config = self.draft.config, target.config
        if not draft.causal:
            raise ValueError(f"the draft {draft.name!r} is a masked diffusion LM, which cannot propose tokens left to "
                             f"right; use a causal architecture or {PROMPT_LOOKUP!r}")
        if draft.vocab_size != config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size} ids) differs from the target's "
                             f"({config.vocab_size}): a proposed id must mean the same token to both")
        draft_device, target_device = next(self.draft.parameters()).device, next(target.parameters()).device
        if draft_device != target_device:
            raise ValueError(f"the draft is on {draft_device} and the target on {target_device}: put both on one device")
