"""State tracking: parity and the S5 / A5 word problems.

Parity (the setup of Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues":
train on lengths up to 40, test on 40 to 256). Tokens ``0`` and ``1`` drawn uniformly, pad ``2``; each example's
length is uniform in ``min_len .. max_len`` and it is right-padded to ``max_len``. ``split="train"`` labels every
real position ``t`` with the running parity (number of ones in tokens ``0 .. t``, mod 2), a dense signal like the
other tasks' training targets; ``split="test"`` labels only the last real position with the parity of the whole
string, the usual length-generalisation score.

Word problems (Merrill et al. 2024, "The Illusion of State in State-Space Models"). Token ``i`` is the i-th element
of the group: S5's ids index the 120 permutations of ``(0, 1, 2, 3, 4)`` in lexicographic order (the order of
``itertools.permutations``), A5's ids the 60 even ones in that same order; pad is the group's order. Elements are
drawn uniformly; lengths are uniform in ``min_len .. max_len``, right-padded. A permutation ``p`` maps ``i`` to
``p[i]``, and the prefix is applied left to right: position ``t`` is labelled, in both splits, with the id of
``q`` where ``q[i] = g_t[... g_1[g_0[i]] ...]``. Parity is the same problem for the two-element group.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Tuple

import torch

from .common import IGNORE_INDEX, check_request, generator, require_int

GROUPS = ("S5", "A5")


def _check_lengths(min_len, max_len) -> None:
    require_int("min_len", min_len, 1)
    require_int("max_len", max_len, 1)
    if min_len > max_len:
        raise ValueError(f"min_len={min_len} > max_len={max_len}: must be min_len <= max_len")


def _lengths(g: torch.Generator, n: int, min_len: int, max_len: int) -> torch.Tensor:
    """[n, 1] lengths, uniform in min_len .. max_len."""
    return torch.randint(min_len, max_len + 1, (n, 1), generator=g)


@dataclass(frozen=True)
class ParitySetting:
    min_len: int = 3
    max_len: int = 40

    def validate(self) -> "ParitySetting":
        _check_lengths(self.min_len, self.max_len)
        return self

    @property
    def pad(self) -> int:
        return 2

    @property
    def width(self) -> int:
        return self.max_len


def make_parity(setting: ParitySetting, num_examples: int, seed: int,
                split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, max_len]."""
    s = setting.validate()
    check_request(num_examples, split)
    g = generator(seed)
    length = _lengths(g, num_examples, s.min_len, s.max_len)
    bits = torch.randint(0, 2, (num_examples, s.max_len), generator=g)
    position = torch.arange(s.max_len)
    real = position < length
    scored = real if split == "train" else position == length - 1
    return torch.where(real, bits, s.pad), torch.where(scored, bits.cumsum(dim=1) % 2, IGNORE_INDEX)


def group_elements(group: str) -> List[Tuple[int, ...]]:
    """The group's permutations in id order (see the module docstring)."""
    if group not in GROUPS:
        raise ValueError(f"group={group!r}: must be one of {GROUPS}")
    perms = list(itertools.permutations(range(5)))
    if group == "A5":
        perms = [p for p in perms if sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2 == 0]
    return perms


def composition_table(group: str) -> torch.Tensor:
    """[order, order] LongTensor: entry (a, b) is the id of "apply a, then b"."""
    perms = group_elements(group)
    ids = {p: i for i, p in enumerate(perms)}
    return torch.tensor([[ids[tuple(b[a[i]] for i in range(5))] for b in perms] for a in perms], dtype=torch.long)


@dataclass(frozen=True)
class WordProblemSetting:
    group: str = "S5"
    min_len: int = 2
    max_len: int = 20

    def validate(self) -> "WordProblemSetting":
        if self.group not in GROUPS:
            raise ValueError(f"group={self.group!r}: must be one of {GROUPS}")
        _check_lengths(self.min_len, self.max_len)
        return self

    @property
    def order(self) -> int:
        return 120 if self.group == "S5" else 60

    @property
    def pad(self) -> int:
        return self.order

    @property
    def vocab_size(self) -> int:
        return self.order + 1

    @property
    def width(self) -> int:
        return self.max_len


def make_word_problem(setting: WordProblemSetting, num_examples: int, seed: int,
                      split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, max_len]."""
    s = setting.validate()
    check_request(num_examples, split)
    g = generator(seed)
    real = torch.arange(s.max_len) < _lengths(g, num_examples, s.min_len, s.max_len)
    elements = torch.randint(0, s.order, (num_examples, s.max_len), generator=g)
    table = composition_table(s.group)
    prefix = torch.empty_like(elements)
    state = elements[:, 0]
    prefix[:, 0] = state
    for t in range(1, s.max_len):
        state = table[state, elements[:, t]]
        prefix[:, t] = state
    return torch.where(real, elements, s.pad), torch.where(real, prefix, IGNORE_INDEX)


__all__ = ["GROUPS", "ParitySetting", "make_parity", "group_elements", "composition_table", "WordProblemSetting",
           "make_word_problem"]
