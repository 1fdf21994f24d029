"""One request's state as it moves through the engine, and its output."""
import enum
import time
from dataclasses import dataclass, field

import torch

from harness.engine.request_metrics import RequestMetrics
from harness.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1  # contiguous layout: the cache row this sequence owns
    num_cached: int = 0  # tokens whose keys/values (or state) are in the cache
    preemptions: int = 0  # times its cache was taken back and recomputed (optimistic admission)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was last admitted
    digests: list[bytes] = field(default_factory=list)  # prefix-cache name of each full block (engine/prefix_cache.py)
    lookahead: int = 0  # speculative decoding: proposed tokens a verification may cache beyond the kept ones
    finish_reason: str = ""
    error: str = ""  # why the request failed (finish_reason "error")
    logits: list[torch.Tensor] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list[int]:
        """What a prefill feeds: the prompt, and for a preempted request also its tokens before the newest, which
        the next decode step feeds as usual."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def prefilled(self) -> bool:
        """Its prefill_ids are all in the cache: it decodes from here on (a chunked prefill takes several steps)."""
        return self.num_cached >= len(self.prefill_ids)

    @property
    def max_length(self) -> int:
        """Tokens the cache may have to hold for this request (the last sampled token is never cached; a speculative
        verification may cache `lookahead` proposed tokens past the kept ones before it rolls back)."""
        return len(self.prompt_ids) + self.params.max_new_tokens - 1 + self.lookahead


@dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" | "abort" | "error"
    metrics: RequestMetrics
    logits: list[torch.Tensor]  # filled when SamplingParams.return_logits
    error: str = ""  # the exception that ended the request, when finish_reason is "error"
    preemptions: int = 0  # times it was preempted and recomputed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's num_cached_tokens)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        return cls(seq.request_id, seq.prompt_ids, list(seq.output_ids), seq.finish_reason,
                   RequestMetrics.of(seq.arrival, seq.token_times), seq.logits, seq.error, seq.preemptions,
                   seq.cached_tokens)


@dataclass
class TokenEvent:
    """One request's progress in one engine step: a new token, and its output if the request ended."""

    request_id: int
    token_id: int | None  # None when the request ended without a new token (it failed)
    finished: RequestOutput | None = None
