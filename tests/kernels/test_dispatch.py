"""kernels/dispatch.py: the device rule skips the None a call passes for an optional tensor (an MLA latent write has
no values), wherever it stands among the arguments. On CUDA a None after a CUDA tensor crashed the paged write."""
import pytest
import torch

from kernels import FORCE_TRITON_ENV
from kernels.dispatch import triton_available, use_cpu_kernel, use_triton


@pytest.mark.parametrize("order", ["none-first", "none-last"])
def test_none_is_skipped(monkeypatch, order):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    tensors = (None, torch.zeros(2)) if order == "none-first" else (torch.zeros(2), None)
    assert use_triton(*tensors) is False  # a CPU tensor: the reference or the CPU kernel runs
    assert use_cpu_kernel(*tensors) == use_cpu_kernel(torch.zeros(2))
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    assert use_triton(*tensors) == triton_available()
    assert use_cpu_kernel(*tensors) is False


def test_no_tensors_is_not_cuda(monkeypatch):
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    assert use_triton(None) is False and use_cpu_kernel(None) is False
