"""Fuzzy in-context recall (MAD-Lab; Poli et al. 2024): keys and values are spans of several tokens.

Vocabulary: key tokens ``0 .. num_key_tokens - 1``, value tokens ``num_key_tokens .. kv_vocab - 1``, the pad token
``kv_vocab``, and, in single-query mode only, the query marker ``vocab_size - 1``. ``kv_vocab`` is ``vocab_size``
less the pad and the marker; key tokens take its lower half.

Sequence (``seq_len + 1`` tokens; the model sees all but the last, so the width is ``seq_len``): left padding, then
context items, then (single-query only) the marker, then the query item. An item is a key span of distinct key
tokens followed by a value span of distinct value tokens. Key spans are 1 .. ``max_key_span`` tokens long in the
train split and exactly ``max_key_span`` in the test split (MAD-Lab prompts test keys at the largest size); value
spans are 1 .. ``max_value_span`` tokens in both. Lengths and tokens are uniform. Within an example a key span seen
again (same tokens, same length) carries the value span it had first. Items are appended while the context is
shorter than ``seq_len + 2 - 2 * (max_key_span + max_value_span) - markers`` tokens, which leaves room for the query.
The query repeats an item drawn uniformly from the context. Key and value tokens alternate in runs, so each maximal
run of key tokens is one key span and each maximal run of value tokens one value span.

Labels (``labels[t]`` scores the prediction at input position ``t``, i.e. token ``t + 1``):

* ``split="train"``: every next token, padding included (MAD-Lab trains on the shifted sequence);
* ``split="test"``: the query's value tokens; with ``multi_query`` also the value tokens of every context item whose
  key span appeared in an earlier item.

Differences from MAD-Lab: the query is a context item picked after the context is built (MAD-Lab draws the query
first and plants it at a random place; both give a query presented earlier, of uniform span lengths), the context
budget above is fixed rather than depending on the query's size, and there is no noise option (MAD-Lab's fuzzy
baseline and changes use none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from harness.recall.data import sample_distinct

from .common import IGNORE_INDEX, check_request, generator, require_bool, require_int


@dataclass(frozen=True)
class FuzzyRecallSetting:
    vocab_size: int = 16
    seq_len: int = 128
    max_key_span: int = 3
    max_value_span: int = 3
    multi_query: bool = True

    def validate(self) -> "FuzzyRecallSetting":
        require_int("vocab_size", self.vocab_size, 1)
        require_int("seq_len", self.seq_len, 1)
        require_int("max_key_span", self.max_key_span, 1)
        require_int("max_value_span", self.max_value_span, 1)
        require_bool("multi_query", self.multi_query)
        if self.num_key_tokens < self.max_key_span or self.num_value_tokens < self.max_value_span:
            raise ValueError(
                f"vocab_size={self.vocab_size} too small: spans of distinct tokens need >= {self.max_key_span} key "
                f"and >= {self.max_value_span} value tokens, it leaves {self.num_key_tokens} and "
                f"{self.num_value_tokens}")
        # key spans are compared as base-(num_key_tokens + 1) numbers held in an int64
        if (self.num_key_tokens + 1) ** self.max_key_span >= 2 ** 62:
            raise ValueError(f"max_key_span={self.max_key_span} too large for {self.num_key_tokens} key tokens: "
                             "(key tokens + 1) ** max_key_span must stay below 2**62")
        needed = 2 * self.max_item + self.num_markers
        if self.seq_len < needed:
            raise ValueError(f"seq_len={self.seq_len} too small: must be >= {needed} "
                             f"(room for a context item and the query at the largest spans)")
        return self

    @property
    def num_markers(self) -> int:
        return 0 if self.multi_query else 1

    @property
    def kv_vocab(self) -> int:
        return self.vocab_size - 1 - self.num_markers

    @property
    def num_key_tokens(self) -> int:
        return self.kv_vocab // 2

    @property
    def num_value_tokens(self) -> int:
        return self.kv_vocab - self.num_key_tokens

    @property
    def pad(self) -> int:
        return self.kv_vocab

    @property
    def marker(self) -> int:
        return self.vocab_size - 1

    @property
    def max_item(self) -> int:
        return self.max_key_span + self.max_value_span

    @property
    def context_budget(self) -> int:
        """Items are appended while the context is shorter than this."""
        return self.seq_len + 2 - 2 * self.max_item - self.num_markers

    @property
    def width(self) -> int:
        return self.seq_len


def _first_occurrence(codes: torch.Tensor) -> torch.Tensor:
    """[n, m]: for each position, the earliest position of the row holding the same code."""
    n, m = codes.shape
    ordered, order = torch.sort(codes, dim=1, stable=True)
    starts = torch.ones_like(codes, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # each sorted position points back to its group's start; stable sorting puts the earliest position there
    group_start = torch.where(starts, torch.arange(m).expand(n, m), 0).cummax(dim=1).values
    return torch.empty_like(order).scatter_(1, order, order.gather(1, group_start))


def _spans(key_tok, key_len, val_tok, val_len, width: int):
    """Lay each item out as key tokens then value tokens in a [..., width] grid.

    Returns (tokens, is_key, is_value); grid cells past the item's length are neither.
    """
    j = torch.arange(width)
    is_key = j < key_len.unsqueeze(-1)
    is_value = ~is_key & (j < (key_len + val_len).unsqueeze(-1))
    k_idx = j.clamp(max=key_tok.shape[-1] - 1).expand(*key_tok.shape[:-1], width)
    v_idx = (j - key_len.unsqueeze(-1)).clamp(0, val_tok.shape[-1] - 1)
    tokens = torch.where(is_key, key_tok.gather(-1, k_idx), val_tok.gather(-1, v_idx))
    return tokens, is_key, is_value


def make_fuzzy_recall(setting: FuzzyRecallSetting, num_examples: int, seed: int,
                      split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, setting.seq_len]."""
    s = setting.validate()
    check_request(num_examples, split)
    n, KS, VS, W = num_examples, s.max_key_span, s.max_value_span, s.max_item
    K, budget = s.num_key_tokens, s.context_budget
    # every item is at least two tokens long, so no more than this many can start inside the budget
    m = (budget + 1) // 2
    g = generator(seed)

    if split == "train":
        key_len = torch.randint(1, KS + 1, (n, m), generator=g)
    else:
        key_len = torch.full((n, m), KS, dtype=torch.long)
    key_tok = sample_distinct(g, n * m, KS, 0, K).view(n, m, KS)
    key_tok = torch.where(torch.arange(KS) < key_len.unsqueeze(-1), key_tok, -1)
    codes = ((key_tok + 1) * (K + 1) ** torch.arange(KS)).sum(dim=-1)
    first = _first_occurrence(codes)
    repeated = first != torch.arange(m)

    val_len = torch.randint(1, VS + 1, (n, m), generator=g).gather(1, first)
    val_tok = sample_distinct(g, n * m, VS, K, s.kv_vocab).view(n, m, VS)
    val_tok = val_tok.gather(1, first.unsqueeze(-1).expand(n, m, VS))

    size = key_len + val_len
    start = size.cumsum(dim=1) - size
    used = start < budget
    query = torch.rand(n, m, generator=g).masked_fill(~used, -1.0).argmax(dim=1, keepdim=True)

    tokens, is_key, is_value = _spans(key_tok, key_len, val_tok, val_len, W)
    q_tokens, q_key, q_value = (t.gather(1, query.unsqueeze(-1).expand(n, 1, W)).squeeze(1)
                                for t in (tokens, is_key, is_value))
    context_len = (size * used).sum(dim=1, keepdim=True)
    q_len = (q_key | q_value).sum(dim=1, keepdim=True)
    pad = s.seq_len + 1 - context_len - s.num_markers - q_len

    full = torch.full((n, s.seq_len + 1), s.pad, dtype=torch.long)
    target = torch.full_like(full, IGNORE_INDEX)
    rows = torch.arange(n)
    in_item = (is_key | is_value) & used.unsqueeze(-1)
    pos = pad.unsqueeze(-1) + start.unsqueeze(-1) + torch.arange(W)
    r = rows.view(n, 1, 1).expand(n, m, W)
    full[r[in_item], pos[in_item]] = tokens[in_item]
    probed = is_value & used.unsqueeze(-1) & repeated.unsqueeze(-1) if s.multi_query else torch.zeros_like(in_item)
    target[r[probed], pos[probed]] = tokens[probed]

    tail = pad + context_len
    if s.num_markers:
        full[rows, tail.squeeze(1)] = s.marker
    q_pos = tail + s.num_markers + torch.arange(W)
    q_in = q_key | q_value
    rq = rows.view(n, 1).expand(n, W)
    full[rq[q_in], q_pos[q_in]] = q_tokens[q_in]
    target[rq[q_value], q_pos[q_value]] = q_tokens[q_value]

    inputs = full[:, :-1]
    labels = full[:, 1:] if split == "train" else target[:, 1:]
    return inputs, labels.clone()


__all__ = ["FuzzyRecallSetting", "make_fuzzy_recall"]
