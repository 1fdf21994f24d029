"""The one rule that decides whether a kernel call runs Triton, the compiled CPU kernel, or the PyTorch reference."""

import functools
import os

import torch

from . import cpu_decode  # its kernels build at their first use, not at import

FORCE_TRITON_ENV = "ARCHZOO_FORCE_TRITON"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """True when triton imports and the tensors are all on CUDA (or ARCHZOO_FORCE_TRITON=1). None stands for an
    optional tensor a call leaves out (an MLA latent write has no values) and is not looked at.

    The env var exists so tests can run the Triton path on CPU under TRITON_INTERPRET=1.
    """
    forced = triton_forced()
    tensors = [t for t in tensors if t is not None]
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    # triton is checked last so CPU-only calls never import it
    return (forced or on_cuda) and triton_available()


def use_cpu_kernel(*tensors: torch.Tensor | None) -> bool:
    """True when the tensors are all on the CPU, Triton is not forced, and the compiled CPU kernels built
    (kernels/cpu_decode.py; ARCHZOO_CPU_KERNELS=0 turns them off, so the references run). None is skipped, as in
    use_triton."""
    on_cpu = False
    for t in tensors:  # a plain loop and is_cpu: called for every GEMV of an eager step, ~1 µs here against ~6
        if t is not None:
            if not t.is_cpu:
                return False
            on_cpu = True
    return on_cpu and not triton_forced() and cpu_decode.cpu_kernels_available()


def triton_forced() -> bool:
    return os.environ.get(FORCE_TRITON_ENV) == "1"


def jit_kernels(namespace: dict, *kernels) -> tuple:
    """triton.jit the kernel functions of one module, first binding `tl` (triton.language) among its globals, which
    the kernel bodies read. Called on first use, not at import: triton reads TRITON_INTERPRET both when it is
    imported (its own tl.max/tl.sum are jitted then) and when triton.jit runs, and CPU-only runs never import it."""
    import triton
    import triton.language

    namespace["tl"] = triton.language
    return tuple(triton.jit(kernel) for kernel in kernels)
