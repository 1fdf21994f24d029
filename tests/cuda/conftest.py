"""The CUDA-only suites: their device is CUDA where there is one. Elsewhere they skip ("needs CUDA"), unless
ARCHZOO_TEST_DEVICE=cpu, which runs the same tests on CPU (fp32 and fp16, Triton kernels in triton's interpreter)
so that `benchmarks/gpu_check.py --smoke` keeps them from rotting between GPU days."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

DEVICE_ENV = "ARCHZOO_TEST_DEVICE"
TESTS = Path(__file__).resolve().parents[1]
# the kernel suites import their helpers as top-level modules (tests/kernels is on sys.path only while pytest
# collects it), and hf_agreement.py holds the greedy-token rule the benchmarks apply
sys.path.append(str(TESTS / "kernels"))
sys.path.append(str(TESTS.parent / "benchmarks"))


def load_kernel_suite_conftest():
    """tests/kernels/conftest.py under a name of its own: pytest imports every conftest as `conftest`."""
    spec = importlib.util.spec_from_file_location("kernel_suite_conftest", TESTS / "kernels" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNEL_SUITE = load_kernel_suite_conftest()


def chosen_device() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get(DEVICE_ENV) == "cpu":
        return torch.device("cpu")
    return None


@pytest.fixture(scope="session")
def device() -> torch.device:
    chosen = chosen_device()
    if chosen is None:
        pytest.skip(f"needs CUDA ({DEVICE_ENV}=cpu runs these tests on CPU)")
    return chosen


@pytest.fixture(scope="session", autouse=True)
def exact_fp32_convolutions():
    """cuDNN runs fp32 convolutions (Mamba's conv1d, in the full forward and in HF's) in TF32 unless told not to:
    1e-3 relative error, which the fp32 comparisons here would mistake for a wrong cache."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def skip_bf16_off_cuda(dtype: torch.dtype, device: torch.device) -> None:
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("bf16 runs on CUDA only: it is broken in the Triton interpreter, and the CPU smoke stays fp32")


@pytest.fixture(params=[torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def kernel_dtype(request, device) -> torch.dtype:
    skip_bf16_off_cuda(request.param, device)
    return request.param


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model_dtype(request, device) -> torch.dtype:
    skip_bf16_off_cuda(request.param, device)
    return request.param


@pytest.fixture
def paged_cache():
    """The kernel suites' paged-cache builder: shuffled blocks, NaN wherever no sequence owns a slot."""
    return KERNEL_SUITE.build_paged_cache
