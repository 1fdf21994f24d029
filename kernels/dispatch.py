"""The one rule that decides whether a kernel call runs Triton or the PyTorch reference."""

import functools
import os

import torch

FORCE_TRITON_ENV = "ARCHZOO_FORCE_TRITON"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when triton imports and the tensors are all on CUDA (or ARCHZOO_FORCE_TRITON=1).

    The env var exists so tests can run the Triton path on CPU under TRITON_INTERPRET=1.
    """
    forced = os.environ.get(FORCE_TRITON_ENV) == "1"
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    # triton is checked last so CPU-only calls never import it
    return (forced or on_cuda) and triton_available()
