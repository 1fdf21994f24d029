"""A benchmark run's guard against a busy machine: the memory read rate measured at its start and at its end, printed
with the verdict (harness/roofline.py's disturbance: more than 15% apart means other work shared the machine, and on
2 cores OpenMP GEMMs then slow 10-100x, so the run's figures are noise)."""
from contextlib import contextmanager

from harness.roofline import disturbance, measure_read_rate


@contextmanager
def watched_run():
    start = measure_read_rate()
    print(f"memory read rate at start: {start / 1e9:.1f} GB/s", flush=True)
    yield
    print(disturbance(start, measure_read_rate()), flush=True)
