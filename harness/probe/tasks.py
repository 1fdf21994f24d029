"""The probe suite's tasks by name: baseline settings, MAD-Lab's difficulty changes, and one entry point.

Baselines mirror MAD-Lab's task configs (Poli et al. 2024); parity and the word problems come from the state-tracking
papers cited in ``state_tracking.py``. Parity trains on "parity" and is tested on "parity" and "parity-long".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from .copying import CompressionSetting, SelectiveCopySetting, make_compression, make_selective_copy
from .fuzzy_recall import FuzzyRecallSetting, make_fuzzy_recall
from .memorization import MemorizationSetting, make_memorization
from .recall import RecallSetting, make_recall
from .state_tracking import ParitySetting, WordProblemSetting, make_parity, make_word_problem

_MAKERS = {
    RecallSetting: make_recall,
    FuzzyRecallSetting: make_fuzzy_recall,
    SelectiveCopySetting: make_selective_copy,
    CompressionSetting: make_compression,
    MemorizationSetting: make_memorization,
    ParitySetting: make_parity,
    WordProblemSetting: make_word_problem,
}

BASELINES: Dict[str, Any] = {
    "in-context-recall": RecallSetting(vocab_size=16, seq_len=128),
    "fuzzy-in-context-recall": FuzzyRecallSetting(vocab_size=16, seq_len=128, max_key_span=3, max_value_span=3),
    "noisy-in-context-recall": RecallSetting(vocab_size=32, seq_len=128, noise_vocab_size=16, frac_noise=0.2),
    "selective-copying": SelectiveCopySetting(vocab_size=16, seq_len=256, num_tokens_to_copy=16),
    "compression": CompressionSetting(vocab_size=16, seq_len=32),
    "memorization": MemorizationSetting(num_keys=256, seq_len=32),
    "parity": ParitySetting(min_len=3, max_len=40),
    "parity-long": ParitySetting(min_len=40, max_len=256),
    "s5": WordProblemSetting("S5", min_len=2, max_len=20),
    "a5": WordProblemSetting("A5", min_len=2, max_len=20),
}

# MAD-Lab's training-set sizes; its test sets are 1,280 examples throughout.
NUM_TRAIN_EXAMPLES = {"memorization": 256}
DEFAULT_NUM_TRAIN_EXAMPLES = 12_800
NUM_TEST_EXAMPLES = 1_280

_FEWER_EXAMPLES = (6400, 3200, 1600, 800)
# MAD-Lab's changes: each varies one field of the baseline (or the training-set size) to make the task harder.
CHANGES: Dict[str, Dict[str, Tuple]] = {
    "in-context-recall": {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024),
                          "num_train_examples": _FEWER_EXAMPLES},
    "fuzzy-in-context-recall": {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024),
                                "num_train_examples": _FEWER_EXAMPLES},
    # MAD-Lab's vocabulary sizes here include the 16 noise ids
    "noisy-in-context-recall": {"vocab_size": (48, 80, 144), "seq_len": (256, 512, 1024),
                                "num_train_examples": _FEWER_EXAMPLES, "frac_noise": (0.4, 0.6, 0.8)},
    "selective-copying": {"vocab_size": (32, 64, 128), "seq_len": (512, 1024), "num_train_examples": _FEWER_EXAMPLES,
                          "num_tokens_to_copy": (32, 64, 96)},
    "compression": {"vocab_size": (32, 64, 128), "seq_len": (64, 128, 256), "num_train_examples": _FEWER_EXAMPLES},
    # MAD-Lab grows the vocabulary (512 .. 8192, i.e. 255 .. 4095 keys); here the key count grows directly
    "memorization": {"num_keys": (512, 1024, 2048, 4096)},
}


@dataclass(frozen=True)
class Variant:
    task: str
    change: str  # "baseline" or "field=value"
    setting: Any
    num_train_examples: int
    num_test_examples: int = NUM_TEST_EXAMPLES


def variants(task: str) -> List[Variant]:
    """The baseline of a MAD-Lab task followed by each of its changes, every setting validated."""
    if task not in CHANGES:
        raise ValueError(f"task={task!r}: MAD-Lab changes exist only for {sorted(CHANGES)}")
    base = BASELINES[task].validate()
    num_train = NUM_TRAIN_EXAMPLES.get(task, DEFAULT_NUM_TRAIN_EXAMPLES)
    out = [Variant(task, "baseline", base, num_train)]
    for field, values in CHANGES[task].items():
        for value in values:
            if field == "num_train_examples":
                out.append(Variant(task, f"{field}={value}", base, value))
            else:
                out.append(Variant(task, f"{field}={value}", dataclasses.replace(base, **{field: value}).validate(),
                                   num_train))
    return out


def make_examples(setting, num_examples: int, seed: int, *, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) for any probe setting: LongTensors of shape [num_examples, setting.width], labels -100 where
    not scored. ``split`` is "train" or "test"; what each labels is in the task's module docstring."""
    maker = _MAKERS.get(type(setting))
    if maker is None:
        raise ValueError(f"setting={setting!r}: not a probe setting; expected one of "
                         f"{[cls.__name__ for cls in _MAKERS]}")
    return maker(setting, num_examples, seed, split)


__all__ = ["BASELINES", "CHANGES", "DEFAULT_NUM_TRAIN_EXAMPLES", "NUM_TEST_EXAMPLES", "NUM_TRAIN_EXAMPLES",
           "Variant", "make_examples", "variants"]
