"""Copy recall (harness/copy_recall.py) against models whose answer is known without the code under test: a model
that copies from one span back pays nothing on the second copy, one that copies from a byte too far back pays
dearly, and a uniform one pays log2(vocab) a byte."""
import math

import pytest
import torch
from torch import nn

from harness.copy_recall import copy_bpb

VOCAB, SPAN = 16, 12


class Copier(nn.Module):
    """Logits certain of the token `back` positions back in its input (SPAN - 1: the next one of a repeated span)."""

    def __init__(self, back: int = SPAN - 1):
        super().__init__()
        self.back = back
        self.anchor = nn.Parameter(torch.zeros(()))  # a device and dtype for copy_bpb to read

    def forward(self, x):
        logits = torch.zeros(*x.shape, VOCAB)
        logits[:, self.back:] = 60 * nn.functional.one_hot(x[:, : x.shape[1] - self.back], VOCAB).float()
        return logits


class Uniform(Copier):
    def forward(self, x):
        return torch.zeros(*x.shape, VOCAB) + self.anchor


def spans(count: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, SPAN), generator=torch.Generator().manual_seed(0))


def test_a_model_that_copies_pays_nothing_and_a_uniform_one_pays_the_whole_alphabet():
    assert copy_bpb(Copier(), spans()) < 1e-6
    assert copy_bpb(Copier(back=SPAN), spans()) > 10  # confidently wrong: the byte before the one repeated
    assert copy_bpb(Uniform(), spans(), batch_size=2) == pytest.approx(math.log2(VOCAB), rel=1e-6)


def test_a_span_too_short_to_copy_is_refused():
    with pytest.raises(ValueError, match=r"spans must be \[N, L\] with L >= 2.*got \[3, 1\]"):
        copy_bpb(Uniform(), torch.zeros(3, 1, dtype=torch.long))
