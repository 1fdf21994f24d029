"""The one rule that decides whether a kernel call runs Triton, the compiled CPU kernel, or the PyTorch reference."""

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


def use_cpu_kernel(*tensors: torch.Tensor) -> bool:
    """True when the tensors are all on the CPU, Triton is not forced, and the compiled CPU kernels built
    (kernels/cpu_decode.py; ARCHZOO_CPU_KERNELS=0 turns them off, so the references run)."""
    if os.environ.get(FORCE_TRITON_ENV) == "1" or not tensors or any(t.device.type != "cpu" for t in tensors):
        return False
    from .cpu_decode import cpu_kernels_available  # imported here: it compiles the kernel on first use

    return cpu_kernels_available()
