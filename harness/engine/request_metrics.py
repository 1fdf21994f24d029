"""What one request's latency was: TTFT, the gaps between its tokens, TPOT and end-to-end time."""
from dataclasses import dataclass


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
