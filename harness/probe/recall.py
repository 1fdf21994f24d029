"""In-context recall and noisy in-context recall (MAD-Lab; Poli et al. 2024, "Mechanistic Design and Scaling of
Hybrid Architectures"). One setting covers both: noisy recall is recall with ``frac_noise > 0``, as in MAD-Lab.

Vocabulary (ids in this order): keys ``0 .. num_keys - 1``, values ``num_keys .. kv_vocab - 1``, noise
``kv_vocab .. kv_vocab + noise_vocab_size - 1``, and, in single-query mode only, the query marker ``vocab_size - 1``.
``kv_vocab`` is what is left of ``vocab_size`` after the noise ids and the marker; keys take its lower half.

Sequence: ``seq_len // 2 - 1`` two-token context slots, then (single-query only) the marker, then the query pair
``k v``. In each example every key stands for one value drawn uniformly (with replacement) from the value ids. A
context slot holds a key drawn uniformly with its value, or, with probability ``frac_noise``, two noise tokens drawn
uniformly from the noise ids; one slot drawn uniformly is never noise, so some key is always presented. The query
key is drawn uniformly from the distinct keys presented in the context. The model sees every token but the last,
so the width is ``seq_len - 1`` (multi-query) or ``seq_len`` (single-query), as in MAD-Lab.

Labels (``labels[t]`` scores the prediction made at input position ``t``):

* ``split="train"``: the next token at every position (MAD-Lab trains on the shifted sequence);
* ``split="test"``: the query's value at the query key (the last position); with ``multi_query`` also the value
  at every context key that was presented in an earlier context slot (MAD-Lab's multi-query probe).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from .common import IGNORE_INDEX, check_request, generator, ignored, require_bool, require_fraction, require_int


@dataclass(frozen=True)
class RecallSetting:
    vocab_size: int = 16
    seq_len: int = 128
    multi_query: bool = True
    noise_vocab_size: int = 0
    frac_noise: float = 0.0

    def validate(self) -> "RecallSetting":
        require_int("vocab_size", self.vocab_size, 1)
        require_int("seq_len", self.seq_len, 4)
        if self.seq_len % 2:
            raise ValueError(f"seq_len={self.seq_len}: must be even (the sequence is made of two-token slots)")
        require_int("noise_vocab_size", self.noise_vocab_size, 0)
        require_bool("multi_query", self.multi_query)
        require_fraction("frac_noise", self.frac_noise)
        if self.frac_noise > 0 and self.noise_vocab_size == 0:
            raise ValueError(f"frac_noise={self.frac_noise} needs noise_vocab_size >= 1 (it is 0)")
        if self.kv_vocab < 2:
            raise ValueError(f"vocab_size={self.vocab_size} too small: after {self.noise_vocab_size} noise ids and "
                             f"{self.num_markers} marker it leaves {self.kv_vocab} ids; keys and values need >= 2")
        return self

    @property
    def num_markers(self) -> int:
        return 0 if self.multi_query else 1

    @property
    def kv_vocab(self) -> int:
        return self.vocab_size - self.num_markers - self.noise_vocab_size

    @property
    def num_keys(self) -> int:
        return self.kv_vocab // 2

    @property
    def marker(self) -> int:
        return self.vocab_size - 1

    @property
    def num_slots(self) -> int:
        """Context slots before the query."""
        return self.seq_len // 2 - 1

    @property
    def width(self) -> int:
        return self.seq_len - 1 + self.num_markers


def _earlier_duplicates(codes: torch.Tensor) -> torch.Tensor:
    """[n, m] bool: True where the same code occurs at an earlier position of the row."""
    ordered, order = torch.sort(codes, dim=1, stable=True)
    dup = torch.zeros_like(codes, dtype=torch.bool)
    dup[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    # the stable sort keeps equal codes in position order, so each group's first member stays False
    return torch.zeros_like(dup).scatter_(1, order, dup)


def make_recall(setting: RecallSetting, num_examples: int, seed: int, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, setting.width]."""
    s = setting.validate()
    check_request(num_examples, split)
    n, C, K, kv = num_examples, s.num_slots, s.num_keys, s.kv_vocab
    g = generator(seed)

    value_of = torch.randint(K, kv, (n, K), generator=g)
    keys = torch.randint(0, K, (n, C), generator=g)
    values = value_of.gather(1, keys)
    noise = torch.rand(n, C, generator=g) < s.frac_noise
    noise[torch.arange(n), torch.randint(0, C, (n,), generator=g)] = False
    slots = torch.stack([keys, values], dim=2)
    if s.frac_noise > 0:
        noise_tokens = torch.randint(kv, kv + s.noise_vocab_size, (n, C, 2), generator=g)
        slots = torch.where(noise.unsqueeze(2), noise_tokens, slots)

    presented = torch.zeros(n, K, dtype=torch.long).scatter_add_(1, keys, (~noise).long()) > 0
    query = torch.rand(n, K, generator=g).masked_fill(~presented, -1.0).argmax(dim=1, keepdim=True)
    answer = value_of.gather(1, query)

    marker = torch.full((n, s.num_markers), s.marker, dtype=torch.long)
    full = torch.cat([slots.reshape(n, 2 * C), marker, query, answer], dim=1)
    inputs = full[:, :-1]
    if split == "train":
        return inputs, full[:, 1:].clone()

    labels = ignored(n, s.width)
    labels[:, -1] = answer.squeeze(1)
    if s.multi_query:
        # noise slots get codes no key can have, so they never count as a presentation
        codes = torch.where(noise, K + torch.arange(C).expand(n, C), keys)
        labels[:, 0:2 * C:2] = torch.where(_earlier_duplicates(codes), values, IGNORE_INDEX)
    return inputs, labels


__all__ = ["RecallSetting", "make_recall"]
