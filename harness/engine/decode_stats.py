"""What an engine's decode steps cost: the figures throughput and MBU are computed from."""
from collections import deque
from dataclasses import dataclass, field

STATS_WINDOW = 4096  # decode steps whose figures are kept one by one (for medians); totals cover every step


@dataclass
class DecodeStats:
    """What decode steps cost, for throughput and MBU: totals over every step, and the newest STATS_WINDOW
    steps one by one, so a long-running engine's memory stays flat."""

    steps: int = 0
    total_seconds: float = 0.0
    total_tokens: int = 0
    seconds: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))
    kv_bytes: deque = field(default_factory=lambda: deque(maxlen=STATS_WINDOW))  # analytic cache bytes read (zoo.cache_read_bytes)

    def record(self, seconds: float, batch_size: int, kv_bytes: int) -> None:
        self.steps += 1
        self.total_seconds += seconds
        self.total_tokens += batch_size
        self.seconds.append(seconds)
        self.batch_sizes.append(batch_size)
        self.kv_bytes.append(kv_bytes)

    @property
    def tokens_per_second(self) -> float:
        return self.total_tokens / self.total_seconds if self.total_seconds else 0.0
