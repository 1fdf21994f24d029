"""Which positions an attention layer keeps and which keys each query sees: one frozen policy that every consumer
(cache bytes, masks, both cache layouts, the block manager, cache grouping, the decode kernels) asks.

The keys a query at position q sees are always "the first `sinks` positions, plus every `dilation`-th position of
one span ending at q":

    all           span from 0                                 (full causal attention)
    window W      span of the newest W keys, q included       (Mistral's sliding window)
    sinks S+W     the first S positions + the newest W        (StreamingLLM, Xiao et al. 2023)
    chunk C       span from the start of q's own C-aligned chunk (Llama 4's chunked local attention)
    window W, r   q, q - r, ..., q - (W-1)r: W keys over a span of (W-1)r + 1 (dilated sliding window, as in
                  Longformer's dilated windows, Beltagy et al. 2020)

so a kernel needs only `sinks`, the stride (`dilation`) and each sequence's first visible span position
(`span_starts`), never the kind of policy.

Scored retention keeps by importance instead of position (cache/eviction.py): a sequence holds at most
`sinks + window + budget` tokens, the first `sinks` and the newest `window` always, the other `budget` chosen by a
score its layer accumulates from its attention weights (`score`: "h2o", the attention each key has received,
Zhang et al. 2023; "tova", the newest query's, Oren et al. 2024; "snapkv", the prompt's last `window` queries'
votes, pooled, Li et al. 2024). A prefill attends over its whole prompt and then
keeps that many; a decode query sees what is held plus itself, after which the lowest-scored unprotected token
leaves. Held rows are packed at the front of a sequence's buffer or blocks (a freed row takes the next new token),
so a kernel reads the first `tokens_held` rows as it reads a ring's, and no position question applies.

Held is not visible: the cache must hold every position a later query will see, which with dilation is the whole
span ((W-1)r + 1 positions) though a query sees only W of them. `span_start`, `tokens_held`, `dropped`,
`capacity`, `rows`, `row` and `peak_blocks` answer for what is held (cache bytes, the ring buffer, block freeing);
`visible`, `span_starts`, `keys_seen`, `visible_capacity` and `causal_pairs` for what a query sees (masks, kernels,
attention FLOPs).
"""
from dataclasses import dataclass

import torch

# Scores that pick a scored retention's kept tokens: H2O's accumulated attention, TOVA's newest-query attention,
# SnapKV's observation-window votes over the prompt
SCORES = ("h2o", "tova", "snapkv")


@dataclass(frozen=True)
class Retention:
    sinks: int = 0
    window: int | None = None
    chunk: int | None = None
    dilation: int = 1
    score: str | None = None  # scored retention: which attention-derived score picks the kept tokens
    budget: int | None = None  # scored retention: tokens kept by score beside the sinks and the recent window

    def __post_init__(self):
        if self.score is not None or self.budget is not None:
            self.check_scored()
            return
        for name in ("window", "chunk", "dilation"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"retention {name} must be an integer >= 1 or None, got {value!r}")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise ValueError(f"retention sinks must be an integer >= 0, got {self.sinks!r}")
        if self.sinks and self.window is None:
            raise ValueError(f"sink tokens ({self.sinks}) are kept beside a window of newest keys: give window too")
        if self.chunk is not None and (self.window is not None or self.sinks):
            raise ValueError(f"chunked attention (chunk={self.chunk}) takes no window or sinks, got "
                             f"window={self.window}, sinks={self.sinks}")
        if self.dilation is None or (self.dilation > 1 and (self.window is None or self.sinks)):
            raise ValueError(f"dilation (every r-th key, got r={self.dilation!r}) spaces a sliding window's keys: give "
                             f"window and no sinks or chunk (got window={self.window}, sinks={self.sinks}, "
                             f"chunk={self.chunk})")

    def check_scored(self) -> None:
        if self.score is None:
            raise ValueError(f"a budget ({self.budget!r}) keeps tokens by score: give score, one of "
                             f"{', '.join(SCORES)}")
        if self.score not in SCORES:
            raise ValueError(f"unknown retention score {self.score!r}; allowed: {', '.join(SCORES)}")
        if not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
            raise ValueError(f"scored retention ({self.score}) keeps `budget` tokens by score beside the sinks and the "
                             f"recent window: give an integer >= 1, got budget={self.budget!r}")
        if not isinstance(self.sinks, int) or isinstance(self.sinks, bool) or self.sinks < 0:
            raise ValueError(f"retention sinks must be an integer >= 0, got {self.sinks!r}")
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window < 1):
            raise ValueError(f"retention window must be an integer >= 1 or None, got {self.window!r}")
        if self.chunk is not None or self.dilation != 1:
            raise ValueError(f"scored retention ({self.score}) keeps sinks, a recent window and scored tokens: give no "
                             f"chunk or dilation (got chunk={self.chunk}, dilation={self.dilation})")
        if self.score == "snapkv" and self.window is None:
            raise ValueError("snapkv votes with the prompt's last `window` queries (its observation window, always "
                             "kept): give window >= 1")

    @property
    def scored(self) -> bool:
        return self.score is not None

    @property
    def recent(self) -> int:
        """Scored retention: the newest tokens always kept (the window; 0 without one)."""
        return self.window or 0

    @property
    def keeps_all(self) -> bool:
        return self.window is None and self.chunk is None and not self.scored

    @property
    def span(self) -> int | None:
        """Positions the span of one query covers: the chunk, or the window's (W-1)·r + 1; None: unbounded."""
        if self.chunk is not None:
            return self.chunk
        return None if self.window is None or self.scored else (self.window - 1) * self.dilation + 1

    @property
    def capacity(self) -> int | None:
        """Most positions the cache holds for one sequence after a step; None: unbounded."""
        if self.scored:
            return self.sinks + self.recent + self.budget
        return self.span if self.chunk is not None or self.span is None else self.sinks + self.span

    @property
    def visible_capacity(self) -> int | None:
        """Most keys any query sees (sinks + W, the chunk); None: unbounded. Below capacity with dilation."""
        if self.scored:
            return self.capacity + 1  # what is held, and the new token before one leaves
        if self.chunk is not None:
            return self.chunk
        return None if self.window is None else self.sinks + self.window

    @property
    def all_visible_up_to(self) -> int | None:
        """Longest prefill in which every query sees every earlier key (plain causal attention); None: any. A scored
        prefill attends over its whole prompt and evicts after."""
        if self.scored:
            return None
        return self.capacity if self.dilation == 1 else 1

    def describe(self) -> str:
        if self.scored:
            kept = [f"{self.sinks} sinks"] * bool(self.sinks) + [f"window {self.window}"] * bool(self.window)
            return " + ".join(kept + [f"{self.score} budget {self.budget}"])
        if self.chunk is not None:
            return f"chunk {self.chunk}"
        if self.window is None:
            return "all"
        if self.dilation > 1:
            return f"window {self.window} dilation {self.dilation}"
        return f"window {self.window}" if not self.sinks else f"{self.sinks} sinks + window {self.window}"

    # ---- one sequence of n tokens ------------------------------------------------------------------------

    def span_start(self, length: int) -> int:
        """First position of the span the newest query (at length - 1) covers: the cache holds it and what follows."""
        if self.scored:
            raise ValueError(f"{self.describe()} keeps tokens by score: it has no positional span")
        if self.chunk is not None:
            return max(0, length - 1) // self.chunk * self.chunk
        return 0 if self.window is None else max(0, length - self.span)

    def tokens_held(self, length: int) -> int:
        """Positions the cache of a `length`-token sequence must hold for its newest and later queries (0 for none)."""
        if length <= 0:
            return 0
        if self.scored:
            return min(length, self.capacity)
        start = self.span_start(length)
        return min(self.sinks, start) + length - start

    def keys_seen(self, length: int) -> int:
        """Keys the newest query of a `length`-token sequence sees (tokens_held without dilation; a scored decode
        query sees one more, itself, before a token leaves)."""
        if length <= 0:
            return 0
        if self.scored:
            return min(length, self.capacity + 1)
        start = self.span_start(length)
        return min(self.sinks, start) + (length - 1 - start) // self.dilation + 1

    def dropped(self, length: int) -> tuple[int, int]:
        """[lo, hi): positions no query at or after length - 1 will see again (they may leave the cache)."""
        start = self.span_start(length)
        return min(self.sinks, start), start

    def rows(self, max_len: int) -> int:
        """Rows of a contiguous buffer for sequences of up to `max_len` tokens: a ring when fewer than max_len (a
        scored buffer has a spare row, where a decode step's new token waits while its scores pick who leaves)."""
        if self.scored:
            return min(max_len, self.capacity + 1)
        return max_len if self.capacity is None else min(max_len, self.capacity)

    def row(self, positions):
        """Ring-buffer row of each position (int or tensor). The rows a sequence of n tokens still needs are then
        exactly rows 0 .. tokens_held(n) - 1, so a one-query decode reads the first tokens_held rows, unordered."""
        if self.chunk is not None:
            return positions % self.chunk
        if self.window is None:
            return positions
        if not self.sinks:
            return positions % self.span
        recent = (positions - self.sinks) % self.span + self.sinks
        if isinstance(positions, torch.Tensor):
            return torch.where(positions < self.sinks, positions, recent)
        return positions if positions < self.sinks else recent

    def peak_blocks(self, max_length: int, block_size: int, step_tokens: int = 1) -> int:
        """Most `block_size`-token blocks a sequence of up to `max_length` tokens holds at once when a step feeds it
        up to `step_tokens` new tokens on top of its cache (a chunked prefill): the sink blocks, plus the keys the
        step's first query still sees and the step's own, a span of at most W (or C) + step_tokens - 1 keys, which
        touches at most (span - 1) // block_size + 2 blocks. W here is the span held: (W-1)·r + 1 with dilation."""
        whole = -(-max_length // block_size)
        if self.keeps_all:
            return whole
        if self.scored:  # packed rows: those held, and the step's new ones before its evictions
            return -(-min(max_length, self.capacity + step_tokens) // block_size)
        if self.chunk is not None and self.chunk % block_size == 0 and step_tokens == 1:
            span_blocks = self.chunk // block_size  # chunks start on block boundaries
        else:
            span_blocks = (self.span + step_tokens - 2) // block_size + 2
        return min(whole, -(-self.sinks // block_size) + span_blocks)

    def dead_blocks(self, length: int, block_size: int) -> range:
        """Logical blocks lying wholly inside the dropped positions of a `length`-token sequence: they can be freed."""
        lo, hi = self.dropped(length)
        return range(-(-lo // block_size), max(-(-lo // block_size), hi // block_size))

    def causal_pairs(self, tokens: int) -> int:
        """(query, key) pairs a causal prefill of `tokens` tokens computes: the sum of keys_seen(q + 1)."""
        if self.scored:
            return tokens * (tokens + 1) // 2
        if self.chunk is not None:
            full, rest = divmod(tokens, self.chunk)
            return full * self.chunk * (self.chunk + 1) // 2 + rest * (rest + 1) // 2
        if self.dilation > 1:  # query q sees min(W, q // r + 1) keys: each count 1..W for r queries, then W
            growing = min(tokens, self.window * self.dilation)
            whole, rest = divmod(growing, self.dilation)
            return (self.dilation * whole * (whole + 1) // 2 + rest * (whole + 1)
                    + (tokens - growing) * self.window)
        cap = self.capacity
        if cap is None or tokens <= cap:
            return tokens * (tokens + 1) // 2
        return cap * (cap + 1) // 2 + (tokens - cap) * cap

    # ---- tensors: a batch of sequences ---------------------------------------------------------------------

    def visible(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """Broadcast mask: key p is visible from query q (causal, p >= 0 marks a real key, then the policy)."""
        keys, queries = key_positions, query_positions
        visible = (keys <= queries) & (keys >= 0)
        if self.scored:  # a scored prefill's queries see the whole prompt; what later queries see is the layer's
            return visible
        if self.chunk is not None:
            return visible & (torch.div(keys, self.chunk, rounding_mode="floor")
                              == torch.div(queries, self.chunk, rounding_mode="floor"))
        if self.window is not None:
            recent = keys > queries - self.span
            if self.dilation > 1:
                recent = recent & ((queries - keys) % self.dilation == 0)
            return visible & (recent | (keys < self.sinks) if self.sinks else recent)
        return visible

    def held(self, key_positions: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """Broadcast mask: key p must stay in the cache for query q and later ones (visible, but the whole span)."""
        if self.dilation == 1:
            return self.visible(key_positions, query_positions)
        return (key_positions <= query_positions) & (key_positions > query_positions - self.span)

    def held_starts(self, lengths: torch.Tensor) -> torch.Tensor:
        """span_start of each sequence, as int64 [B]."""
        lengths = lengths.long()
        if self.chunk is not None:
            return torch.div((lengths - 1).clamp_min(0), self.chunk, rounding_mode="floor") * self.chunk
        if self.window is not None:
            return (lengths - self.span).clamp_min(0)
        return torch.zeros_like(lengths)

    def span_starts(self, lengths: torch.Tensor) -> torch.Tensor:
        """Each sequence's first visible span position, as int32 [B] (what the decode kernels read): span_start, or
        with dilation the first position of the span on the newest query's stride."""
        starts = self.held_starts(lengths)
        if self.dilation > 1:
            starts = starts + (lengths.long() - 1 - starts) % self.dilation
        return starts.to(torch.int32)

    def rows_held(self, lengths: torch.Tensor) -> torch.Tensor:
        """tokens_held of each sequence (the live rows of its ring buffer)."""
        if self.keeps_all:
            return lengths
        if self.scored:
            return lengths.clamp(max=self.capacity)
        starts = self.held_starts(lengths).to(lengths.dtype)
        return starts.clamp(max=self.sinks) + lengths - starts


FULL = Retention()
