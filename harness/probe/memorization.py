"""Memorization (MAD-Lab; Poli et al. 2024): facts fixed across all examples, learnt in the weights.

Vocabulary: keys ``0 .. num_keys - 1``, values ``num_keys .. 2 * num_keys - 1``, the insert token ``2 * num_keys``.
The key -> value map is a random one-to-one pairing (as MAD-Lab's) drawn once from ``map_seed`` alone, so every
example of every seed and split asks about the same facts. An example is ``seq_len // 2`` pairs ``key insert`` with
keys drawn uniformly (with replacement); the value never appears in the input, and each insert token is labelled
with the value of the key before it, in both splits (MAD-Lab's train and test sets differ only in their draws).

MAD-Lab sizes the map by its vocabulary (vocab 256 gives 127 keys); here the key count is the setting, 256 keys
at baseline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from .common import check_request, generator, ignored, require_int

DEFAULT_MAP_SEED = 12345


@dataclass(frozen=True)
class MemorizationSetting:
    num_keys: int = 256
    seq_len: int = 32
    map_seed: int = DEFAULT_MAP_SEED

    def validate(self) -> "MemorizationSetting":
        require_int("num_keys", self.num_keys, 1)
        require_int("seq_len", self.seq_len, 2)
        if self.seq_len % 2:
            raise ValueError(f"seq_len={self.seq_len}: must be even (the sequence is made of key-insert pairs)")
        require_int("map_seed", self.map_seed, 0)
        return self

    @property
    def vocab_size(self) -> int:
        return 2 * self.num_keys + 1

    @property
    def insert_token(self) -> int:
        return 2 * self.num_keys

    @property
    def width(self) -> int:
        return self.seq_len


def memorization_map(setting: MemorizationSetting) -> torch.Tensor:
    """[num_keys] LongTensor: entry k is the value id of key k."""
    s = setting.validate()
    return s.num_keys + torch.randperm(s.num_keys, generator=generator(s.map_seed))


def make_memorization(setting: MemorizationSetting, num_examples: int, seed: int,
                      split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, seq_len]."""
    s = setting.validate()
    check_request(num_examples, split)
    n, P = num_examples, s.seq_len // 2
    keys = torch.randint(0, s.num_keys, (n, P), generator=generator(seed))
    inputs = torch.full((n, s.seq_len), s.insert_token, dtype=torch.long)
    inputs[:, 0::2] = keys
    labels = ignored(n, s.seq_len)
    labels[:, 1::2] = memorization_map(s)[keys]
    return inputs, labels


__all__ = ["DEFAULT_MAP_SEED", "MemorizationSetting", "memorization_map", "make_memorization"]
