"""Scored retention's two questions, asked of a batch of sequences' held keys: how each key's score changes after a
step's queries attended to it, and which keys stay once a sequence holds more than its retention's capacity.

Scores (per sequence: every head keeps the same tokens, so a head's attention counts toward the sequence's score):
- "h2o" (Zhang et al. 2023, heavy hitters): the attention a key has received from every query since it arrived,
  summed over heads and queries; a key keeps its score while it stays.
- "tova" (Oren et al. 2024, token omission via attention): the newest query's attention to each key, averaged
  over heads in the paper (summed here: the same order), replaced every step.
- "snapkv" (Li et al. 2024): each prompt key's votes from the prompt's last `window` queries (its observation
  window), summed over heads and those queries, then max-pooled over SNAP_POOL neighbouring positions so a
  selected key keeps its neighbours. The paper then lets decode append; under a fixed budget a decode token enters
  with no votes, so once it leaves the recent window it is the first to go (the prompt's selection stays, beside a
  window of the newest tokens).

Selection: the first `sinks` positions and the newest `window` are always kept; of the others, the `budget`
highest-scored stay. Ties leave the older token out first, so the selection is a function of scores and positions
(attention/reference.py's kept_by_score answers the same in plain Python, for the tests).
"""
import torch

from cache.retention import Retention


def attention_weights(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax weights in float32, [B, H, T, L]: q [B, H, T, D] over k [B, KVH, L, D] (each KV head read by its
    group of query heads), visible [B, T, L]; a query with no visible key weighs nothing."""
    b, heads, t, d = q.shape
    # each KV head's query group as rows of one product: no copy of the keys per query head, nor in float32
    grouped = q.reshape(b, k.shape[1], heads // k.shape[1] * t, d)
    return softmax_weights(torch.matmul(grouped, k.transpose(-1, -2)).view(b, heads, t, -1) * scale, visible)


def softmax_weights(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """logits [B, H, T, L] (any float dtype), visible [B, T, L] -> softmax weights in float32, 0 where unseen."""
    logits = logits.float().masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


SNAP_POOL = 7  # SnapKV's pooling kernel (its reference implementation uses 5 or 7, max or average pooling)


def snap_votes(weights: torch.Tensor, in_window: torch.Tensor) -> torch.Tensor:
    """SnapKV's score of each prompt key [B, L]: the weights [B, H, T, L] of the queries in the observation window
    (in_window [B, T]), summed over heads and those queries, max-pooled over SNAP_POOL neighbouring keys."""
    votes = (weights * in_window[:, None, :, None]).sum(dim=(1, 2))
    return torch.nn.functional.max_pool1d(votes[:, None], SNAP_POOL, stride=1, padding=SNAP_POOL // 2)[:, 0]


def updated_scores(retention: Retention, scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each key's score [B, L] after the queries whose weights [B, H, T, L] are given, the newest last along T (TOVA
    reads only that one). A key the step adds starts from a score of 0; SnapKV's scores are the prompt's votes,
    which decode leaves as they are."""
    if retention.score == "h2o":
        return scores + weights.sum(dim=(1, 2))
    if retention.score == "snapkv":
        return scores
    return weights[:, :, -1].sum(dim=1)


def protected(retention: Retention, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: held keys no score can evict, the sinks and the newest `window` (positions -1: empty rows)."""
    newest = lengths.long()[:, None] - retention.recent
    return (positions >= 0) & ((positions < retention.sinks) | (positions >= newest))


def keep_mask(retention: Retention, scores: torch.Tensor, positions: torch.Tensor,
              lengths: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: the held keys (positions >= 0) each sequence keeps once it is `lengths` long: all of them while
    they fit its capacity, else the protected ones and the best-scored others, `capacity` in all."""
    held = positions >= 0
    safe = protected(retention, positions, lengths)
    room = (retention.capacity - safe.sum(dim=1, keepdim=True)).clamp_min(0)  # scored places left
    candidate = held & ~safe
    # rank candidates best first: score descending, the newer first among equal scores (two stable sorts)
    by_position = torch.sort(torch.where(candidate, positions, -1), dim=1, descending=True, stable=True).indices
    ranked_scores = torch.where(candidate, scores.float(), float("-inf")).gather(1, by_position)
    order = by_position.gather(1, torch.sort(ranked_scores, dim=1, descending=True, stable=True).indices)
    places = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, places)  # each row's place in its sequence's ranking
    return held & (safe | (candidate & (rank < room)))
