"""Latency metrics per request, aggregates named as vLLM prints them, and memory-bandwidth utilisation."""
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestMetrics:
    ttft: float  # seconds from arrival to the first token; NaN for a request that ended without one
    itl: list[float]  # seconds between consecutive tokens
    tpot: float  # (e2e - ttft) / (n_out - 1); 0 for a one-token output
    e2e: float

    @classmethod
    def of(cls, arrival: float, token_times: list[float]) -> "RequestMetrics":
        if not token_times:  # aborted or failed before its first token
            return cls(float("nan"), [], 0.0, float("nan"))
        ttft = token_times[0] - arrival
        e2e = token_times[-1] - arrival
        itl = [b - a for a, b in zip(token_times, token_times[1:])]
        tpot = (e2e - ttft) / (len(token_times) - 1) if len(token_times) > 1 else 0.0
        return cls(ttft, itl, tpot, e2e)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(outputs, duration: float) -> dict[str, float]:
    """Aggregate metrics over finished requests, keyed by vLLM's benchmark names (times in ms); a request that
    ended without a token has no latencies to add."""
    answered = [o for o in outputs if o.token_ids]
    series = {
        "TTFT": [o.metrics.ttft for o in answered],
        "TPOT": [o.metrics.tpot for o in outputs if len(o.token_ids) > 1],
        "ITL": [gap for o in outputs for gap in o.metrics.itl],
        "E2EL": [o.metrics.e2e for o in answered],
    }
    summary = {}
    for name, values in series.items():
        values = values or [0.0]
        summary[f"Mean {name} (ms)"] = 1000 * statistics.fmean(values)
        summary[f"Median {name} (ms)"] = 1000 * statistics.median(values)
        summary[f"P99 {name} (ms)"] = 1000 * percentile(values, 99)
    summary["Output token throughput (tok/s)"] = sum(len(o.token_ids) for o in outputs) / duration
    summary["Request throughput (req/s)"] = len(outputs) / duration
    return summary


def measure_copy_bandwidth(device: str | torch.device = "cpu", nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Peak memory bandwidth in bytes/s: best of `repeats` large copies, counting bytes read + written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def mbu(weight_bytes: int, kv_bytes_per_step: float, step_seconds: float, peak_bandwidth: float) -> float:
    """Model bandwidth utilisation (Databricks): bytes one decode step must read (weights + KV) / step time / peak."""
    return (weight_bytes + kv_bytes_per_step) / step_seconds / peak_bandwidth
