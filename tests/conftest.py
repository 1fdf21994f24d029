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


@pytest.fixture(scope="session")
def share_machine_measurements():
    """share(patch): compare's measurements of the machine (measure_rates, ~2.3 s a run on 2 cores: a read sweep to
    1 GiB, a matmul, the GEMVs; the read rate it takes again after the cells for its disturbance line, ~0.7 s; and a
    CPU cell's read sweeps before and after its steps, ~0.25 s each, over a 1 GiB buffer held for the run) made for
    real once a session (the rates per device, dtype, preset and seed) and handed to every later compare run patched
    with `patch`."""
    measured = {}

    def share(patch: pytest.MonkeyPatch) -> None:
        from harness import compare, roofline
        real_rates, real_read_rate = compare.measure_rates, roofline.measure_read_rate
        real_sweep = compare.cell_read_rates

        def read_gauge(settings):  # a stand-in for the run's buffer (None on CUDA), not 1 GiB held for a session
            return None if compare.is_cuda(settings.device) else torch.empty(0)

        def cell_read_rates(buffer, step_bytes):
            if buffer is not None and "sweep" not in measured:
                measured["sweep"] = real_sweep(roofline.read_buffer(), step_bytes)  # later cells: the same sizes
            return None if buffer is None else measured["sweep"]

        def measure_rates(settings):
            key = (settings.device, settings.dtype, settings.preset, settings.seed)  # what measure_rates builds from
            if key not in measured:
                measured[key] = real_rates(settings)
            return measured[key]

        def measure_read_rate(*args, **kwargs):
            if "read rate" not in measured:
                measured["read rate"] = real_read_rate(*args, **kwargs)
            return measured["read rate"]

        patch.setattr(compare, "measure_rates", measure_rates)
        patch.setattr(compare, "read_gauge", read_gauge)
        patch.setattr(compare, "cell_read_rates", cell_read_rates)
        patch.setattr(roofline, "measure_read_rate", measure_read_rate)

    return share


@pytest.fixture
def machine_rates_once(monkeypatch, share_machine_measurements):
    """share_machine_measurements for a test whose compare rows must carry rates but that does not test the
    measurement. test_compare.py's test_rows_have_measured_and_analytic_bytes does not use it: it checks that a run
    measures once and every row carries that measurement, which a shared result would hide."""
    share_machine_measurements(monkeypatch)
