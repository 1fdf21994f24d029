"""Latency aggregates over requests, named as vLLM prints them, and memory-bandwidth utilisation."""
import statistics
import time

import torch


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_series(outputs) -> dict[str, list[float]]:
    """Each latency's values in seconds over the requests, by vLLM's short names; a request that ended without a
    token has none to add, and a one-token output no TPOT."""
    answered = [o for o in outputs if o.token_ids]
    return {
        "ttft": [o.metrics.ttft for o in answered],
        "tpot": [o.metrics.tpot for o in outputs if len(o.token_ids) > 1],
        "itl": [gap for o in outputs for gap in o.metrics.itl],
        "e2el": [o.metrics.e2e for o in answered],
    }


def summarize(outputs, duration: float) -> dict[str, float]:
    """Aggregate metrics over finished requests, keyed by the names vLLM's benchmark prints (times in ms)."""
    summary = {}
    for short, values in latency_series(outputs).items():
        name, values = short.upper(), values or [0.0]
        summary[f"Mean {name} (ms)"] = 1000 * statistics.fmean(values)
        summary[f"Median {name} (ms)"] = 1000 * statistics.median(values)
        summary[f"P99 {name} (ms)"] = 1000 * percentile(values, 99)
    summary["Output token throughput (tok/s)"] = sum(len(o.token_ids) for o in outputs) / duration
    summary["Request throughput (req/s)"] = len(outputs) / duration
    return summary


def serving_metrics(outputs, duration: float, ttft_slo_ms: float | None = None,
                    tpot_slo_ms: float | None = None) -> dict[str, float]:
    """A load run's figures under the field names of vLLM's benchmark_serving results (times in ms): counts,
    throughputs, and mean / median (p50) / p90 / p99 of TTFT, TPOT, ITL and E2EL over the completed requests.
    request_goodput (vLLM's definition, DistServe's idea): completed requests per second that met every SLO given
    (TTFT <= ttft_slo_ms, TPOT <= tpot_slo_ms); with none given it equals request_throughput."""
    completed = [o for o in outputs if o.finish_reason in ("length", "stop")]
    good = [o for o in completed
            if (ttft_slo_ms is None or 1000 * o.metrics.ttft <= ttft_slo_ms)
            and (tpot_slo_ms is None or 1000 * o.metrics.tpot <= tpot_slo_ms)]
    input_tokens = sum(len(o.prompt_ids) for o in completed)
    output_tokens = sum(len(o.token_ids) for o in completed)
    row = {"completed": len(completed), "failed": len(outputs) - len(completed), "total_input_tokens": input_tokens,
           "total_output_tokens": output_tokens, "request_throughput": len(completed) / duration,
           "request_goodput": len(good) / duration, "output_throughput": output_tokens / duration,
           "total_token_throughput": (input_tokens + output_tokens) / duration}
    for name, values in latency_series(completed).items():
        values = [1000 * v for v in values] or [0.0]  # vLLM reports 0 for a latency no request has
        row[f"mean_{name}_ms"] = statistics.fmean(values)
        row[f"median_{name}_ms"] = statistics.median(values)
        row[f"p90_{name}_ms"] = percentile(values, 90)
        row[f"p99_{name}_ms"] = percentile(values, 99)
    return row


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
