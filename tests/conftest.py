"""Suite-wide setup: the Triton interpreter without CUDA, the checkout on sys.path, one torch thread. The helpers
the suites share are in tests/helpers.py."""
import os
import pathlib
import sys

import pytest
import torch

# Without CUDA, Triton kernels run in triton's interpreter; triton reads this when first imported, and
# importing the library (torch.compile's config, say) may import triton, so it is set before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Let plain `pytest` (not only `python -m pytest`) import the top-level packages from the checkout.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# The suites run tiny models: one intra-op thread is faster than two, and far faster when the
# 2-core machine is busy (idle OpenMP workers spin against other processes).
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def local_ray():
    """A local 2-CPU Ray instance for one test module (the Ray paths of zoo recall, probe and compare)."""
    ray = pytest.importorskip("ray")  # the test extra installs it; a machine without it runs the rest
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


MACHINE_RATES: dict = {}  # compare.measure_rates' results this session, by what they were measured on


@pytest.fixture
def machine_rates_once(monkeypatch):
    """compare.measure_rates (~2.5 s: a read sweep to 1 GiB, a matmul, GEMVs) measured for real once a session per
    device, dtype, preset and seed, for tests whose rows must carry rates but that do not test the measurement.
    tests/test_compare.py does not use it: it checks a run measures once, which a shared result would hide."""
    from harness import compare
    real = compare.measure_rates

    def once(settings):
        key = (settings.device, settings.dtype, settings.preset, settings.seed)  # what measure_rates builds from
        if key not in MACHINE_RATES:
            MACHINE_RATES[key] = real(settings)
        return MACHINE_RATES[key]

    monkeypatch.setattr(compare, "measure_rates", once)
