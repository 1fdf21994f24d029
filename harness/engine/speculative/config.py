"""What speculative decoding to run: who proposes (a draft model, several, or prompt lookup), how many tokens per step,
and whether the proposals form a tree (several chains from the root) or one chain."""
from dataclasses import dataclass

from torch import nn

from zoo import checks

PROMPT_LOOKUP = "prompt_lookup"
LOOKAHEAD = "lookahead"
# most tokens one step may propose: far above what pays (vLLM's drafts propose a handful, EAGLE's trees about 60),
# and a bound on what every step's verification forward and rollback room are sized for
MAX_SPECULATIVE_TOKENS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """draft: a causal model with the target's vocabulary (any registry architecture, e.g. a trained tiny gqa or
    mamba), or "prompt_lookup": the tokens that followed the latest earlier occurrence of the context's last n-gram
    (no model; Saxena 2023, vLLM's ngram proposer), or "lookahead": the target's own Jacobi iteration and an n-gram
    pool (no model; Fu et al. 2024; harness/engine/speculative/lookahead.py), whose branches are the window and up
    to branches - 1 pool continuations.
    num_speculative_tokens: k, the tokens proposed per step (vLLM's name); the target verifies k + 1 positions in one
    forward. Fixed: every step of every request proposes k (fewer only where the request has fewer left to make,
    or prompt lookup finds a shorter continuation).
    prompt_lookup_max / prompt_lookup_min: the n-gram lengths tried, longest first (vLLM's names).
    Trees (SpecInfer): draft may be a tuple of models, each proposing its own chain, and branches > 1 gives each
    proposer that many chains (a model's: one from each of its `branches` most likely first tokens, each continued
    as the model samples; prompt lookup's: the continuations of its latest distinct matches). The chains hang from
    the request's newest token as one token tree, which the target verifies in one forward (every node seeing only
    its own path) where its caches allow: every layer attention, with any retention but eviction by score (no
    recurrent state). Elsewhere the engine refuses the tree, unless chain_fallback: then the first
    proposer's first chain is verified alone, and the engine's speculative_stats say why (tree_fallback).
    tree_budget: a tree of at most this many proposed tokens whose shape the draft's probabilities choose (EAGLE-2,
    Li et al. 2024): depth by depth, the `branches` likeliest nodes each offer their `branches` likeliest next
    tokens, then the budget's likeliest nodes by path probability stay, up to num_speculative_tokens deep. The
    draft proposes deterministically (each node its token, not a draw), so the rule stays exact when sampling; it
    scores each depth's tree in one forward of its own, so it must be a model that verifies trees too."""

    draft: "nn.Module | str | tuple"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    branches: int = 1
    chain_fallback: bool = False
    tree_budget: int | None = None

    def __post_init__(self):
        checks.integer("num_speculative_tokens (k)", self.num_speculative_tokens, minimum=1,
                       maximum=MAX_SPECULATIVE_TOKENS)
        checks.integer(f"branches (chains per proposer; with k={self.num_speculative_tokens} at most "
                       f"{MAX_SPECULATIVE_TOKENS} proposed tokens a step)", self.branches, minimum=1,
                       maximum=MAX_SPECULATIVE_TOKENS // self.num_speculative_tokens)
        if self.tree_budget is not None:
            checks.integer("tree_budget (proposed tokens a step)", self.tree_budget, minimum=1,
                           maximum=MAX_SPECULATIVE_TOKENS)
            if isinstance(self.draft, (str, tuple, list)):
                raise ValueError(f"tree_budget grows a tree from one draft model's probabilities, not from "
                                 f"{self.draft if isinstance(self.draft, str) else 'several drafts'!r}")
            if self.draft_lookahead > MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"tree_budget: k={self.num_speculative_tokens} depths of branches={self.branches}^2 "
                                 f"candidates are {self.draft_lookahead} draft tokens a step, more than "
                                 f"{MAX_SPECULATIVE_TOKENS}")
        if isinstance(self.draft, list):
            object.__setattr__(self, "draft", tuple(self.draft))  # frozen: set once, here
        if isinstance(self.draft, tuple):
            if not self.draft:
                raise ValueError("draft is an empty tuple: give at least one draft model")
            for draft in self.draft:
                self.check_model(draft)
            if self.width > MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"{len(self.draft)} drafts x branches={self.branches} x k="
                                 f"{self.num_speculative_tokens} propose {self.width} tokens a step, more than "
                                 f"{MAX_SPECULATIVE_TOKENS}")
        elif isinstance(self.draft, str):
            checks.choice("draft (a model, or a proposer without one)", self.draft, (PROMPT_LOOKUP, LOOKAHEAD))
            checks.integer("prompt_lookup_min", self.prompt_lookup_min, minimum=1)
            checks.integer(f"prompt_lookup_max (prompt_lookup_min={self.prompt_lookup_min} at least)",
                           self.prompt_lookup_max, minimum=self.prompt_lookup_min)
        else:
            self.check_model(self.draft)

    @staticmethod
    def check_model(draft) -> None:
        if not isinstance(draft, nn.Module) or not hasattr(draft, "config"):
            raise ValueError(f"draft must be a zoo model (zoo.build / zoo.load), a tuple of them, "
                             f"{PROMPT_LOOKUP!r} or {LOOKAHEAD!r}, got {type(draft).__name__}")

    @property
    def drafts(self) -> tuple:
        """The proposers: each model, or the prompt lookup string."""
        return self.draft if isinstance(self.draft, tuple) else (self.draft,)

    @property
    def chains(self) -> int:
        """Chains a step proposes per request: one per draft and branch."""
        return len(self.drafts) * self.branches

    @property
    def tree(self) -> bool:
        """The proposals form a token tree: several chains, or a budget's tree."""
        return self.tree_budget is not None or self.chains > 1

    @property
    def width(self) -> int:
        """Tokens a step proposes per request at most (a tree's nodes below its root)."""
        if self.tree_budget is not None:
            return self.tree_budget
        return self.chains * self.num_speculative_tokens

    @property
    def draft_lookahead(self) -> int:
        """Tokens a draft model writes past a request's newest token in one step: its chain, or the candidates of
        every depth of a budget's tree (branches^2 a depth)."""
        if self.tree_budget is not None:
            return self.num_speculative_tokens * self.branches**2
        return self.num_speculative_tokens

    def draft_cache_len(self, cache_len: int) -> int:
        """Rows a draft's cache needs per sequence beside a target whose cache holds cache_len (max_seq_len and the
        target's lookahead, which is width here): more where the draft writes more than the target a step."""
        return cache_len + max(0, self.draft_lookahead - self.width)

    def check_target(self, target: nn.Module) -> None:
        """Each draft can propose for this target: same vocabulary, decodes left to right, on the same device."""
        for draft in self.drafts:
            if not isinstance(draft, str):
                self.check_draft(draft, target)

    @staticmethod
    def check_draft(model: nn.Module, target: nn.Module) -> None:
        draft, config = model.config, target.config
        if not draft.causal:
            raise ValueError(f"the draft {draft.name!r} is a masked diffusion LM, which cannot propose tokens left to "
                             f"right; use a causal architecture or {PROMPT_LOOKUP!r}")
        if draft.vocab_size != config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.vocab_size} ids) differs from the target's "
                             f"({config.vocab_size}): a proposed id must mean the same token to both")
        draft_device, target_device = next(model.parameters()).device, next(target.parameters()).device
        if draft_device != target_device:
            raise ValueError(f"the draft is on {draft_device} and the target on {target_device}: put both on one device")
