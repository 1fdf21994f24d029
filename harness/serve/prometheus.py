"""GET /metrics in Prometheus' text format, under vLLM's metric names so dashboards and `vllm bench`-style scrapers
read archzoo as they read vLLM: running and waiting requests, KV-cache usage, preemptions, prefix-cache queries and
hits, and histograms of time to first token, inter-token latency and end-to-end latency."""
import bisect
from dataclasses import dataclass, field

# seconds; vLLM's TTFT buckets, which also cover ITL and E2E at CPU speeds
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)


@dataclass
class Histogram:
    name: str
    help: str
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def lines(self, labels: str) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip([*map(str, BUCKETS), "+Inf"], self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        out += [f"{self.name}_sum{{{labels}}} {self.total}", f"{self.name}_count{{{labels}}} {cumulative}"]
        return out


@dataclass
class ServerMetrics:
    """Filled by the engine loop (its thread alone writes); read as text by GET /metrics."""

    model: str
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of the cache the running requests hold
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, found
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."))
    itl: Histogram = field(default_factory=lambda: Histogram(
        "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."))
    e2e: Histogram = field(default_factory=lambda: Histogram(
        "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds."))

    def record(self, output) -> None:
        """A finished request's latencies (harness.RequestOutput)."""
        if output.token_ids:
            self.ttft.observe(output.metrics.ttft)
            self.e2e.observe(output.metrics.e2e)
            for gap in output.metrics.itl:
                self.itl.observe(gap)

    def text(self) -> str:
        labels = f'model_name="{self.model}"'
        gauges = [("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   self.running),
                  ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.waiting),
                  ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   self.kv_cache_usage),
                  ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.", self.preemptions),
                  ("vllm:prefix_cache_queries_total", "counter", "Prefix-cache queries, in prompt tokens.",
                   self.prefix_queries),
                  ("vllm:prefix_cache_hits_total", "counter", "Prefix-cache hits, in prompt tokens.", self.prefix_hits)]
        lines = []
        for name, kind, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
        for histogram in (self.ttft, self.itl, self.e2e):
            lines += histogram.lines(labels)
        return "\n".join(lines) + "\n"
