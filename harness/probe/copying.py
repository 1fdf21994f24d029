"""Selective copying and compression (MAD-Lab; Poli et al. 2024). Neither has a train/test difference in MAD-Lab,
so ``split`` is checked but labels the same positions in both.

Selective copying. Vocabulary: content ``0 .. vocab_size - 3``, blank ``vocab_size - 2``, delimiter
``vocab_size - 1``. ``num_tokens_to_copy`` content tokens drawn uniformly (with replacement) are scattered, in order,
among ``seq_len - 2 * num_tokens_to_copy - 1`` blanks; then come the delimiter and ``num_tokens_to_copy`` blanks
(width ``seq_len``). Labels sit on those final blanks only: the i-th of them is labelled with the i-th content token.
Placement follows MAD-Lab: each blank independently goes in front of a content token drawn uniformly, so the last
content token always directly precedes the delimiter.

Compression. MAD-Lab's compression feeds ``seq_len - 1`` uniform content tokens and a compression token to an
encoder, pools the last position and decodes every input token from that one vector. A decoder cannot be given that
bottleneck by data alone, so this variant asks for the same reconstruction after the compression token: vocabulary
content ``0 .. vocab_size - 2``, compression token ``vocab_size - 1``; inputs are the ``m = seq_len - 1`` content
tokens followed by the compression token repeated ``m`` times (width ``2 * m``), and the j-th compression token
(counting from 0) is labelled with content token j. For a recurrent model everything after the first compression
token depends on the content only through its state there, which is MAD-Lab's bottleneck; attention can look back,
so for attention this is a positional copy rather than a compression test.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from .common import check_request, generator, ignored, require_int


@dataclass(frozen=True)
class SelectiveCopySetting:
    vocab_size: int = 16
    seq_len: int = 256
    num_tokens_to_copy: int = 16

    def validate(self) -> "SelectiveCopySetting":
        require_int("vocab_size", self.vocab_size, 3)
        require_int("num_tokens_to_copy", self.num_tokens_to_copy, 1)
        require_int("seq_len", self.seq_len, 1)
        if self.num_blanks < 1:
            raise ValueError(f"seq_len={self.seq_len} too small for num_tokens_to_copy={self.num_tokens_to_copy}: "
                             f"must be > 2 * {self.num_tokens_to_copy} + 1 = {2 * self.num_tokens_to_copy + 1}")
        return self

    @property
    def blank(self) -> int:
        return self.vocab_size - 2

    @property
    def delimiter(self) -> int:
        return self.vocab_size - 1

    @property
    def num_blanks(self) -> int:
        """Blanks among the content, before the delimiter."""
        return self.seq_len - 2 * self.num_tokens_to_copy - 1

    @property
    def width(self) -> int:
        return self.seq_len


def make_selective_copy(setting: SelectiveCopySetting, num_examples: int, seed: int,
                        split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, seq_len]."""
    s = setting.validate()
    check_request(num_examples, split)
    n, N, B = num_examples, s.num_tokens_to_copy, s.num_blanks
    g = generator(seed)
    content = torch.randint(0, s.vocab_size - 2, (n, N), generator=g)
    in_front_of = torch.randint(0, N, (n, B), generator=g)
    blanks_before = torch.zeros(n, N, dtype=torch.long).scatter_add_(1, in_front_of, torch.ones(n, B, dtype=torch.long))
    positions = torch.arange(N) + blanks_before.cumsum(dim=1)

    inputs = torch.full((n, s.seq_len), s.blank, dtype=torch.long)
    inputs.scatter_(1, positions, content)
    inputs[:, N + B] = s.delimiter
    labels = ignored(n, s.seq_len)
    labels[:, N + B + 1:] = content
    return inputs, labels


@dataclass(frozen=True)
class CompressionSetting:
    vocab_size: int = 16
    seq_len: int = 32

    def validate(self) -> "CompressionSetting":
        require_int("vocab_size", self.vocab_size, 2)
        require_int("seq_len", self.seq_len, 2)
        return self

    @property
    def compress_token(self) -> int:
        return self.vocab_size - 1

    @property
    def num_content(self) -> int:
        return self.seq_len - 1

    @property
    def width(self) -> int:
        return 2 * self.num_content


def make_compression(setting: CompressionSetting, num_examples: int, seed: int,
                     split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), LongTensors of shape [num_examples, 2 * (seq_len - 1)]."""
    s = setting.validate()
    check_request(num_examples, split)
    n, m = num_examples, s.num_content
    content = torch.randint(0, s.vocab_size - 1, (n, m), generator=generator(seed))
    inputs = torch.cat([content, torch.full((n, m), s.compress_token, dtype=torch.long)], dim=1)
    labels = ignored(n, s.width)
    labels[:, m:] = content
    return inputs, labels


__all__ = ["SelectiveCopySetting", "make_selective_copy", "CompressionSetting", "make_compression"]
