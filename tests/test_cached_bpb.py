"""Bits per byte through the engine's cache: equal to the uncached forward's for full attention, and what each
kept key set allows for a cache that keeps less."""
import math

import pytest
import torch
import torch.nn.functional as F

import zoo
from harness.cached_bpb import cached_bits_per_byte
from helpers import random_model  # tests/ is on sys.path under pytest


def uncached_bits(model, windows: torch.Tensor, prefix: int) -> float:
    logits = model(windows)[:, prefix:-1]
    targets = windows[:, prefix + 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1)).item() / math.log(2)


def test_full_attention_through_the_cache_scores_as_the_uncached_forward():
    model = random_model("gqa")
    windows = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    assert cached_bits_per_byte(model, windows, prefix=5) == pytest.approx(uncached_bits(model, windows, 5), rel=1e-5)


def test_a_cache_that_keeps_less_scores_differently():
    model = random_model("gqa")
    windows = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    evicted = zoo.evict(model, policy="h2o", budget=6)
    assert cached_bits_per_byte(evicted, windows) != pytest.approx(uncached_bits(model, windows, 8), rel=1e-3)
    assert uncached_bits(evicted, windows, 8) == pytest.approx(uncached_bits(model, windows, 8), rel=1e-6)


def test_a_prefix_outside_the_window_is_refused():
    with pytest.raises(ValueError, match="prefix must be in"):
        cached_bits_per_byte(random_model("gqa"), torch.zeros(1, 10, dtype=torch.long), prefix=9)
    from harness.cached_bpb import cached_logits
    with pytest.raises(ValueError, match=r"last must be in \[3, 9\]"):
        next(cached_logits(random_model("gqa"), torch.zeros(1, 10, dtype=torch.long), prefix=4, last=10))


def test_answers_through_a_full_cache_are_the_uncached_argmax():
    from harness.cached_bpb import cached_answers

    model = random_model("gqa")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.full((2, 24), -100)
    labels[:, 10::3] = tokens[:, 11::3]  # next-token targets at every third position from 10
    labels[:, 23] = tokens[:, 5]  # and one at the last position, whose prediction has no next token to score
    expected = model(tokens).argmax(-1)[labels >= 0] == labels[labels >= 0]
    assert torch.equal(cached_answers(model, tokens, labels, prefix=4), expected)
    with pytest.raises(ValueError, match="inside the prefill"):
        cached_answers(model, tokens, labels, prefix=12)
