"""KV-cache eviction by importance as a lever on any model with softmax attention: `zoo.evict(model, policy="h2o",
budget=256)` is a copy whose attention layers keep at most `budget` tokens per sequence, the first `sinks`, the
newest `window` and the rest by score (cache/eviction.py). The weights are the same; only what the engine's cache
keeps changes, so an uncached forward of the copy equals the original's."""
import copy
import dataclasses
from dataclasses import dataclass

from attention import Attention
from cache.retention import SCORES, Retention
from zoo import checks
from zoo.model import DecoderLM

SCHEDULES = ("uniform", "pyramid")


def pyramid_budgets(budget: int, n_layers: int, beta: int = 20) -> list[int]:
    """PyramidKV's per-layer budgets (Cai et al. 2024, its beta 20): an arithmetic sequence from 2·budget −
    budget/beta at the first layer down to budget/beta at the last, so the layers' mean is `budget` (rounded; each
    at least 1)."""
    if n_layers == 1:
        return [budget]
    low = budget / beta
    high = 2 * budget - low
    return [max(1, round(high - i * (high - low) / (n_layers - 1))) for i in range(n_layers)]


@dataclass(frozen=True)
class EvictionConfig:
    """policy: the score, "h2o", "tova" or "snapkv". budget: tokens a sequence keeps in each attention layer (the
    layers' mean with schedule "pyramid"), sinks and window included. window: newest tokens always kept (default:
    half the budget for H2O, whose paper splits the budget evenly between heavy hitters and recent tokens; none for
    TOVA, which keeps by attention alone; for SnapKV its observation window, 32 tokens as in its paper, at most a
    quarter of the budget). sinks: first tokens always kept (StreamingLLM's sinks; default none)."""

    policy: str
    budget: int
    window: int | None = None
    sinks: int = 0
    schedule: str = "uniform"

    def __post_init__(self):
        checks.choice("policy", self.policy, SCORES)
        checks.integer("budget (tokens kept per sequence and layer)", self.budget, minimum=1)
        checks.integer("sinks", self.sinks, minimum=0)
        if self.window is not None:
            checks.integer("window", self.window, minimum=0)
        checks.choice("schedule", self.schedule, SCHEDULES)
        if self.sinks + self.recent >= self.budget:
            raise ValueError(f"sinks ({self.sinks}) + window ({self.recent}) leave none of budget={self.budget} to "
                             f"keep by score: give a budget above {self.sinks + self.recent}")

    @property
    def recent(self) -> int:
        if self.window is not None:
            return self.window
        if self.policy == "snapkv":
            return max(1, min(32, self.budget // 4))
        return self.budget // 2 if self.policy == "h2o" else 0

    def retention(self, scored: int) -> Retention:
        """The retention of a layer keeping `scored` tokens by score beside the sinks and the window."""
        return Retention(sinks=self.sinks, window=self.recent or None, score=self.policy, budget=scored)

    def scored_budgets(self, n_layers: int) -> list[int]:
        """Each layer's tokens kept by score: the budget less the sinks and the window, the same in every layer,
        or PyramidKV's taper of it (as PyramidKV tapers what its observation window leaves)."""
        scored = self.budget - self.sinks - self.recent
        return [scored] * n_layers if self.schedule == "uniform" else pyramid_budgets(scored, n_layers)


def evictable(mixer, shared: bool) -> str:
    """Why a layer cannot keep tokens by score ("" when it can): only softmax attention that computes its own keys,
    keeps them all and shares them with no other layer (shared: a later layer reads its cache)."""
    if not isinstance(mixer, Attention):
        kind = mixer.cache_spec().kind
        return (f"{type(mixer).__name__} keeps recurrent state, no per-token keys to score" if kind == "state" else
                f"{type(mixer).__name__} keeps a {kind!r} cache, which scored retention does not hold (softmax "
                f"attention's own keys and values only)")
    if mixer.kv_source is not None or shared:
        return "it shares its cache with another layer (cross-layer attention)"
    if not mixer.retention.keeps_all:
        return f"it already keeps by position ({mixer.retention.describe()})"
    if not mixer.causal:
        return "it is non-causal"
    return ""


def evict(model: DecoderLM, config: EvictionConfig | None = None, **settings) -> DecoderLM:
    """A copy of `model` whose full-attention layers keep tokens by score (the original is untouched); by an
    EvictionConfig or its fields as keywords. Layers that keep no scoreable keys (recurrent state, a window, a
    shared cache) stay as they are; a model with none that can is refused."""
    if config is None:
        config = EvictionConfig(**settings)
    elif settings:
        raise ValueError(f"give an EvictionConfig or its fields as keywords, not both (got {', '.join(settings)} too)")
    mixers = [block.mixer for block in model.blocks]
    sources = {getattr(mixer, "kv_source", None) for mixer in mixers}
    reasons = [evictable(mixer, i in sources) for i, mixer in enumerate(mixers)]
    able = [i for i, reason in enumerate(reasons) if not reason]
    if not able:
        raise ValueError(f"{model.config.name!r} has no layer whose keys can be evicted by score: layer 0: "
                         f"{reasons[0]}; eviction needs full softmax attention (mha, gqa, mqa, or a hybrid's "
                         f"attention layers)")
    evicted = copy.deepcopy(model)
    layers = list(model.config.layers)
    for i, scored in zip(able, config.scored_budgets(len(able))):
        retention = config.retention(scored)
        mixer = evicted.blocks[i].mixer
        mixer.retention, mixer.window, mixer.sinks = retention, retention.window, retention.sinks
        layers[i] = dataclasses.replace(layers[i], params={**layers[i].params, "score": retention.score,
                                                           "budget": retention.budget, "sinks": retention.sinks,
                                                           "window": retention.window})
    evicted.config = dataclasses.replace(model.config, layers=layers)
    return evicted
