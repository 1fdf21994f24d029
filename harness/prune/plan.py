"""From importance scores to a PrunePlan that hits a parameter target.

`by` names what is cut, coarse parts first, feed-forward channels last (the fine step that lands on the target):
- "mlp": channels only, the same share of each FFN layer's, its least active ones (Minitron's MLP width);
- "heads+mlp": first KV groups, each attention layer keeping ceil(target share x its KV heads) of its most
  important (at least one), or exactly kv_heads of them when given, and each Gated DeltaNet layer likewise its
  heads (their states with them), then channels;
- "depth+mlp": first whole layers, least block influence first, while the model stays above the target (ShortGPT),
  then channels;
- "embedding": the residual stream's channels only (d_model, in every layer at once), its least active ones;
- "embedding+mlp": embedding channels to the square root of the target share (a block's FFN weights shrink with
  both axes), then channels (Minitron's width pruning over both).
The plan's parameter count is exact (the pruned config built on the meta device, counted as zoo counts), and lands
within TOLERANCE of the target, or the plan is refused with what it could reach.

A decode-time target is a share of the bytes a batch-1 decode step reads (every weight it applies and the cache at
a context): the roofline floor of a memory-bound step, so a share of its time on any machine. It becomes the
largest parameter target whose plan reads no more than that (target_for_decode).
"""
import dataclasses
import math

import torch

import zoo
from harness.prune.importance import Importance, cut_layers
from zoo.model import DecoderLM
from zoo.parameters import parameter_counts
from zoo.pruning import PrunePlan, check_embedding_cut, check_plan, pruned_config, sharing_layers, state_cut_layers

BY = ("mlp", "heads+mlp", "depth+mlp", "embedding", "embedding+mlp")
TOLERANCE = 0.02  # of the target


def parameter_count(model, plan: PrunePlan) -> int:
    """Parameters of the model plan would make, without allocating it."""
    with torch.device("meta"):
        return parameter_counts(DecoderLM(pruned_config(model, plan))).total


def resolve_target(model, target: float) -> int:
    """A count (>= 1) or a share of the model's parameters (0 < target < 1) as a count, checked against what
    channels can reach before any calibration runs."""
    total = parameter_counts(model).total
    if not isinstance(target, (int, float)) or isinstance(target, bool) or not target > 0 or math.isnan(target):
        raise ValueError(f"target must be a parameter count (>= 1) or a share of the model's {total:,} (between 0 "
                         f"and 1), got {target!r}")
    count = round(target * total) if target < 1 else int(target)
    if count >= total:
        raise ValueError(f"target {count:,} parameters is not below the model's {total:,}: nothing to prune")
    return count


def cache_bytes_per_token(model, plan: PrunePlan) -> int:
    """KV-cache bytes a token in the model plan would make, in its parameters' dtype, without allocating it."""
    with torch.device("meta"):
        return zoo.cache_bytes(DecoderLM(pruned_config(model, plan)), 1, dtype=next(model.parameters()).dtype)


def kv_heads_for_cache(model, cache_target: float) -> int:
    """The most KV heads every cuttable attention layer can keep (heads+mlp) with the cache a token at or under
    cache_target: bytes a token (>= 1) or a share of the model's (between 0 and 1); refused where even one KV group
    a layer is over it, or the model's own cache is not."""
    heads, _ = cut_layers(model)
    if not heads:
        raise ValueError("cache_target: this model has no attention layer whose KV heads can be cut")
    full = cache_bytes_per_token(model, PrunePlan(tuple(range(model.config.n_layers))))
    if not isinstance(cache_target, (int, float)) or isinstance(cache_target, bool) or not cache_target > 0:
        raise ValueError(f"cache_target must be bytes a token (>= 1) or a share of the model's {full:,} (between 0 "
                         f"and 1), got {cache_target!r}")
    budget = cache_target * full if cache_target < 1 else cache_target
    if budget >= full:
        raise ValueError(f"cache_target {budget:,.0f} bytes a token is not below the model's {full:,}: nothing to cut")
    layers = tuple(range(model.config.n_layers))
    most = min(model.blocks[i].mixer.n_kv_heads for i in heads)
    fits = [k for k in range(1, most + 1)
            if cache_bytes_per_token(model, PrunePlan(layers, {i: tuple(range(k)) for i in heads})) <= budget]
    if not fits:
        least = cache_bytes_per_token(model, PrunePlan(layers, {i: (0,) for i in heads}))
        raise ValueError(f"cache_target {budget:,.0f} bytes a token is below the {least:,} that one KV group in every "
                         f"cuttable attention layer keeps")
    return max(fits)


def decode_bytes(model, plan: PrunePlan, context: int) -> int:
    """Bytes a batch-1 decode step of the model plan would make reads at `context` cached tokens, in its parameters'
    dtype: its weights (zoo.decode_weight_bytes) and its cache; nothing allocated."""
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        pruned = DecoderLM(pruned_config(model, plan)).to(dtype)
        return zoo.decode_weight_bytes(pruned) + zoo.cache_bytes(pruned, context, dtype=dtype)


def check_decode_target(model, by: str, share: float, context: int, kv_heads: int | None = None) -> None:
    """share is in (0, 1), context >= 1, and (but for depth+mlp, whose least plan depends on which layers go) the
    smallest plan `by` can make reads at most that share; before any calibration."""
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share < 1:
        raise ValueError(f"decode target must be a share of the decode step's bytes, between 0 and 1, got {share!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"decode context must be cached tokens >= 1, got {context!r}")
    check_by(model, by, 1, kv_heads, reachable=False)
    if by != "depth+mlp":
        full = decode_bytes(model, PrunePlan(tuple(range(model.config.n_layers))), context)
        least = decode_bytes(model, least_plan(model, by, kv_heads), context)
        if least > share * full:
            raise ValueError(f"decode target {share:.1%} of {full:,} bytes a step (context {context}) is below the "
                             f"{least / full:.1%} that cutting by {by} can reach")


def target_for_decode(model, importance: Importance, share: float, by: str, context: int,
                      kv_heads: int | None = None) -> int:
    """The largest parameter target (to 0.1% of the model's) whose plan by `by` reads at most `share` of the
    model's decode-step bytes at `context` tokens; refused where no plan does."""
    check_decode_target(model, by, share, context, kv_heads)
    total = parameter_counts(model).total
    budget = share * decode_bytes(model, PrunePlan(tuple(range(model.config.n_layers))), context)

    def fits(target: int) -> bool:
        try:
            return decode_bytes(model, plan_for_target(model, importance, target, by, kv_heads), context) <= budget
        except ValueError:  # below what `by` reaches, or off its tolerance there
            return False

    low, high = 0, total  # fits(low) is taken as true, fits(high) is false (the whole model is over any share < 1)
    while high - low > max(1, total // 1000):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    if low == 0:
        raise ValueError(f"no plan cutting by {by} reads at most {share:.1%} of the decode step's bytes at context "
                         f"{context}")
    return low


def least_plan(model, by: str, kv_heads: int | None = None) -> PrunePlan:
    """The smallest plan `by` can make where its layers all stay: one KV group (or kv_heads) and one Gated DeltaNet
    head a layer with heads, one channel an FFN with mlp, one embedding channel with embedding."""
    heads, ffns = cut_layers(model)
    layers = tuple(range(model.config.n_layers))
    groups = {i: tuple(range(kv_heads or 1)) for i in heads} if by == "heads+mlp" else {}
    states = {i: (0,) for i in state_cut_layers(model.config)} if by == "heads+mlp" else {}
    channels = {i: (0,) for i in ffns} if by.endswith("mlp") else {}
    return PrunePlan(layers, groups, channels, (0,) if by.startswith("embedding") else None, states)


def check_by(model, by: str, target: int, kv_heads: int | None = None, reachable: bool = True) -> None:
    """by is known, the model has channels to cut, kv_heads (with heads+mlp only) is a count every cut attention
    layer has, and (unless not `reachable`: target unchecked) cutting every FFN to one channel (and, with heads,
    every attention layer to one KV group, or kv_heads) reaches the target."""
    if by not in BY:
        raise ValueError(f"unknown pruning axes by={by!r}; allowed: {', '.join(BY)}")
    heads, ffns = cut_layers(model)
    layers = tuple(range(model.config.n_layers))
    if by.startswith("embedding"):
        check_embedding_cut(model.config, list(layers), range(model.config.d_model))
    if kv_heads is not None:
        if by != "heads+mlp":
            raise ValueError(f"kv_heads is a heads+mlp setting, not {by}'s")
        most = min((model.blocks[i].mixer.n_kv_heads for i in heads), default=0)
        if not isinstance(kv_heads, int) or not 1 <= kv_heads <= most:
            raise ValueError(f"kv_heads must be between 1 and {most} (the fewest KV heads of a layer that can lose "
                             f"them), got {kv_heads!r}" if most else "this model has no attention layer whose KV "
                             "heads can be cut")
    if not ffns and by.endswith("mlp"):
        raise ValueError(f"this model has no feed-forward channels to cut (its FFNs: "
                         f"{sorted({model.config.ffn(i).kind for i in range(model.config.n_layers)})}; cuttable: "
                         f"swiglu, gelu), and channels are what lands a plan on its target")
    if by == "depth+mlp" or not reachable:
        return  # depth: layers go while the count stays above the target, so channels only trim the rest
    plan = least_plan(model, by, kv_heads)
    least = parameter_count(model, plan)
    if target < least * (1 - TOLERANCE):
        kept = [f"{kv_heads or 1} KV group(s) per attention layer"] if by == "heads+mlp" else []
        kept += ["one head per Gated DeltaNet layer"] if plan.state_heads else []
        kept += ["one channel per FFN"] if by.endswith("mlp") else []
        kept += ["one embedding channel"] if by.startswith("embedding") else []
        raise ValueError(f"target {target:,} parameters is below the {least:,} that cutting by {by} can reach "
                         f"({', '.join(kept)})")


def plan_for_target(model, importance: Importance, target: int, by: str, kv_heads: int | None = None) -> PrunePlan:
    check_by(model, by, target, kv_heads)
    layers = list(range(model.config.n_layers))
    heads, ffns = cut_layers(model)
    if by == "depth+mlp":
        layers = drop_layers(model, importance, target)
    cut_heads, cut_states = {}, {}
    if by == "heads+mlp":
        share = target / parameter_count(model, PrunePlan(tuple(layers)))
        kept = {i: kv_heads or math.ceil(share * len(importance.kv_heads[i])) for i in heads if i in layers}
        cut_heads = {i: most_important(importance.kv_heads[i], count) for i, count in kept.items()}
        cut_states = {i: most_important(scores, math.ceil(share * len(scores)))
                      for i, scores in importance.state_heads.items() if i in layers}
    plan = PrunePlan(tuple(layers), cut_heads, state_heads=cut_states)
    if by == "embedding":
        plan = fit_embedding(model, importance, target, plan)
    else:
        if by == "embedding+mlp":
            share = math.sqrt(target / parameter_count(model, plan))
            plan = with_embedding(plan, importance, share)
        plan = fit_channels(model, importance, target, plan, [i for i in ffns if i in layers])
    count = parameter_count(model, plan)
    if abs(count - target) > TOLERANCE * target:
        raise ValueError(f"cutting by {by} lands at {count:,} parameters, more than {TOLERANCE:.0%} from the target "
                         f"{target:,}")
    return plan


def most_important(scores: list[float], keep: int) -> tuple[int, ...]:
    """Indices of the `keep` highest scores (at least one), ascending."""
    keep = max(1, min(keep, len(scores)))
    return tuple(sorted(sorted(range(len(scores)), key=lambda j: -scores[j])[:keep]))


def drop_layers(model, importance: Importance, target: int) -> list[int]:
    """Layers kept after dropping the least influential while the count stays at or above target (a layer another
    reads keys from, or that reads another's, stays)."""
    shared = sharing_layers(model.config)
    kept = list(range(model.config.n_layers))
    for layer in sorted((i for i in kept if i not in shared), key=lambda i: importance.layers[i]):
        trial = [i for i in kept if i != layer]
        if not trial or parameter_count(model, PrunePlan(tuple(trial))) < target:
            break
        kept = trial
    return kept


def fit_channels(model, importance: Importance, target: int, plan: PrunePlan, ffns: list[int]) -> PrunePlan:
    """plan with each FFN layer in ffns keeping the same share of its channels, its most active, the share found by
    bisection so the count is the closest to target from above."""
    hidden = {i: len(importance.channels[i]) for i in ffns}

    def with_share(share: float) -> PrunePlan:
        return dataclasses.replace(
            plan, channels={i: most_important(importance.channels[i], round(share * hidden[i])) for i in ffns})

    return with_share(closest_share(model, target, plan, with_share))


def with_embedding(plan: PrunePlan, importance: Importance, share: float) -> PrunePlan:
    """plan keeping that share of the embedding channels, the most active."""
    return dataclasses.replace(
        plan, embedding=most_important(importance.embedding, round(share * len(importance.embedding))))


def fit_embedding(model, importance: Importance, target: int, plan: PrunePlan) -> PrunePlan:
    """plan keeping the share of the embedding channels whose count is the closest to target from above."""
    with_share = lambda share: with_embedding(plan, importance, share)  # noqa: E731
    return with_share(closest_share(model, target, plan, with_share))


def closest_share(model, target: int, plan: PrunePlan, with_share) -> float:
    """The smallest share in (0, 1] (to 2^-30) whose plan, with_share(share), keeps at least target parameters."""
    check_plan(model, plan)
    low, high = 0.0, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        if parameter_count(model, with_share(middle)) >= target:
            high = middle
        else:
            low = middle
    return high
