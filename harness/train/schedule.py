"""The learning-rate schedule: linear warmup over the first steps, then cosine decay to FINAL_SHARE of the peak.

Progress runs from 0 to 1 over whichever budget ends first: max(step / max_steps, trained seconds / time budget), so
a run stopped by its time budget has decayed its rate by then, as one stopped by its step budget has.
"""
import math

FINAL_SHARE = 0.1  # the rate at the end, as a share of the peak


def progress(step: int, trained_s: float, max_steps: int | None, minutes: float | None) -> float:
    """How far through its budget a run is, in [0, 1]; a budget that is None does not count."""
    by_steps = step / max_steps if max_steps is not None else 0.0
    by_time = trained_s / (60 * minutes) if minutes is not None else 0.0
    return min(1.0, max(by_steps, by_time))


def lr_factor(step: int, done: float, warmup_steps: int) -> float:
    """The rate of step `step` (0-based) as a share of the peak, at progress `done`: the warmup ramp (step + 1) /
    warmup_steps times the cosine from 1 at progress 0 down to FINAL_SHARE at progress 1."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    return warmup * (FINAL_SHARE + (1 - FINAL_SHARE) * 0.5 * (1 + math.cos(math.pi * done)))
