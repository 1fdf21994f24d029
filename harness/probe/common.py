"""What every probe generator shares: the label sentinel, the split names, seeded generators, argument checks."""
from __future__ import annotations

import torch

from harness.recall.data import IGNORE_INDEX

# "train" scores what a training run fits (every next token, for the recall tasks); "test" scores only the
# probed positions. Tasks whose MAD-Lab generator has no such distinction label the same positions in both.
SPLITS = ("train", "test")


def generator(seed: int) -> torch.Generator:
    """A private CPU generator, so no global RNG is read or advanced."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) % (2 ** 63))
    return g


def require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be True or False")


def require_fraction(name: str, value) -> None:
    """A rate in [0, 1): 1 would leave no room for the tokens the task is about."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name}={value!r}: must be a number in [0, 1)")


def check_request(num_examples, split) -> None:
    require_int("num_examples", num_examples, 0)
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")


def ignored(n: int, width: int) -> torch.Tensor:
    """An all-unscored label tensor, to be filled at the scored positions."""
    return torch.full((n, width), IGNORE_INDEX, dtype=torch.long)


__all__ = ["IGNORE_INDEX", "SPLITS", "generator", "require_int", "require_bool", "require_fraction",
           "check_request", "ignored"]
