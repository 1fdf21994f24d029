"""The pass-key examples (harness/passkey.py): where the key is, what the labels mark, what the filler holds."""
import math

import numpy as np
import pytest
import torch

from harness.passkey import (DIGITS, FILLER_DIGIT, IGNORE_INDEX, NEEDLE, QUESTION, TAGS, PasskeyTraining, answered,
                             overhead, passkey_examples, train_passkey)

TEXT = np.frombuffer(b"def f(x):\n    return x + 12 * 3  # 45 more lines of 6789 code\n" * 40, dtype=np.uint8)


def find(row: bytes, part: bytes) -> list[int]:
    return [i for i in range(len(row) - len(part) + 1) if row[i:i + len(part)] == part]


def test_the_labels_are_the_key_written_once_in_the_needle():
    inputs, labels, _ = passkey_examples(TEXT, 20, 200, seed=3)
    assert inputs.shape == labels.shape == (20, 200)
    for row, label in zip(inputs.tolist(), labels.tolist()):
        marked = [t for t, y in enumerate(label) if y != IGNORE_INDEX]
        assert marked == list(range(200 - 2 * DIGITS + 1, 200, 2))  # the answer's tags, after the question
        assert [row[t] for t in marked] == list(TAGS)
        key = bytes(label[t] for t in marked)
        assert key.isdigit() and len(set(key)) == DIGITS
        written = bytes(b for pair in zip(TAGS, key) for b in pair)
        text = bytes(row)
        assert find(text, NEEDLE % written) and text.endswith(QUESTION + written[:-1])
        assert len(find(text, written[:-1])) == 2  # in the needle and in the answer, nowhere else


def test_the_filler_is_the_text_with_its_digits_masked():
    inputs, _, depths = passkey_examples(TEXT, 5, 300, seed=0, depths=np.zeros(5))
    filler = 300 - overhead()
    needle = len(NEEDLE % bytes(2 * DIGITS))
    for row in inputs.tolist():
        text = bytes(row[needle:needle + filler])  # depth 0: the needle first, then the filler
        assert not any(chr(b).isdigit() for b in text) and FILLER_DIGIT in text
        masked = bytes(b if not chr(b).isdigit() else FILLER_DIGIT for b in bytes(TEXT))
        assert text in masked


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_needle_sits_at_its_depth(depth):
    inputs, _, _ = passkey_examples(TEXT, 3, 250, seed=1, depths=np.full(3, depth))
    filler = 250 - overhead()
    for row in inputs.tolist():
        assert find(bytes(row), b" The pass key is ")[0] == round(depth * filler)


def test_bad_lengths_and_depths_are_refused():
    with pytest.raises(ValueError, match="length 90 leaves"):
        passkey_examples(TEXT, 2, overhead(), seed=0)
    with pytest.raises(ValueError, match="depths must be 2 shares"):
        passkey_examples(TEXT, 2, 200, seed=0, depths=np.array([0.5, 1.5]))


def test_answered_needs_every_digit():
    hits = torch.tensor([True] * DIGITS + [True] * (DIGITS - 1) + [False])
    assert answered(hits).tolist() == [True, False]


def test_training_learns_the_digits_prior_within_a_few_steps():
    reports = []
    train_passkey(PasskeyTraining(stages=(96,), min_steps=60, batch_size=16, learned_loss=10.0), TEXT,
                  progress=lambda *report: reports.append(report))
    (length, steps, loss), = reports
    assert (length, steps) == (96, 60)
    assert loss < math.log(256) - 2  # its last 50 steps: from a uniform guess over bytes toward one over digits


def test_a_stage_that_does_not_learn_stops_the_training():
    with pytest.raises(RuntimeError, match="did not learn length 96 in 5 steps"):
        train_passkey(PasskeyTraining(stages=(96, 112), min_steps=5, max_steps=5, batch_size=4), TEXT,
                      progress=lambda *report: None)
