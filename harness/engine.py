"""The generation engine: request queue, continuous batching, prefill + batched decode, per-request metrics."""
import itertools
import time
from dataclasses import dataclass, field

import torch

from harness.block_manager import BlockManager, peak_blocks
from harness.cache_pool import LAYOUTS, CachePool, cache_groups
from harness.model_runner import ModelRunner
from harness.sampling import SamplingParams, sample_token
from harness.scheduler import Scheduler
from harness.sequence import RequestOutput, Sequence
from zoo.tokenizer import ByteTokenizer


@dataclass
class DecodeStats:
    """What every decode step cost, for throughput and MBU."""

    seconds: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    kv_bytes: list[int] = field(default_factory=list)  # analytic cache bytes the step had to read (zoo.cache_read_bytes)

    @property
    def tokens_per_second(self) -> float:
        return sum(self.batch_sizes) / sum(self.seconds) if self.seconds else 0.0


def size_cache(specs, dtype, kv_cache: str, max_batch: int, max_seq_len: int, block_size: int,
               num_blocks: int | None, budget: int | None) -> tuple[int, list[int]]:
    """(max_batch, blocks per cache group) the cache can serve; a budget that cannot hold one full-length request
    is an error. A paged budget is split between groups in proportion to what one request needs of each."""
    element_size = torch.empty((), dtype=dtype).element_size()
    if kv_cache == "contiguous":
        per_row = sum(spec.bytes(max_seq_len, dtype) for spec in specs)
        if budget is not None:
            if budget < per_row:
                raise ValueError(f"cache budget {budget} B is too small for one request: one contiguous row of "
                                 f"max_seq_len={max_seq_len} needs {per_row} B")
            max_batch = min(max_batch, budget // per_row)
        return max_batch, []
    groups = cache_groups(specs)
    needs = [peak_blocks(max_seq_len, block_size, g.window) for g in groups]
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return max_batch, [num_blocks] * len(groups)
    if budget is None:
        return max_batch, [max_batch * need for need in needs]
    block_bytes = [element_size * block_size * g.token_elements for g in groups]
    per_request = sum(need * b for need, b in zip(needs, block_bytes))
    state_bytes = sum(spec.state_bytes(dtype) for spec in specs)
    if state_bytes:
        # every batch slot holds a state row: as many slots as fit beside one request's blocks
        slots = (budget - per_request) // state_bytes
        if slots < 1:
            raise ValueError(f"cache budget {budget} B is too small for one request: its state needs {state_bytes} B "
                             f"and its {block_size}-token blocks {per_request} B")
        max_batch = min(max_batch, slots)
        budget -= max_batch * state_bytes
    if not groups:
        return max_batch, []
    blocks = [budget * need // per_request for need in needs]
    if any(n < need for n, need in zip(blocks, needs)):
        raise ValueError(f"cache budget {budget} B is too small for one request: one of max_seq_len={max_seq_len} "
                         f"needs {per_request} B of {block_size}-token blocks")
    return max_batch, blocks


class Engine:
    def __init__(self, model, max_batch: int = 8, max_seq_len: int | None = None, kv_cache: str = "contiguous",
                 block_size: int = 16, num_blocks: int | None = None, cache_budget_bytes: int | None = None,
                 compile: bool = False):
        """kv_cache: "contiguous" ([slots, kv_heads, max_seq_len, head_dim] per layer) or "paged" (block pool).

        num_blocks / cache_budget_bytes size the paged pool (default: room for max_batch full-length sequences;
        num_blocks is per cache group, i.e. per distinct sliding window in the model);
        for the contiguous layout a budget caps max_batch at the rows that fit.
        compile: torch.compile the decode step (fixed shapes; each new batch size compiles once).
        """
        config = model.config
        if not config.causal:  # each position sees later ones: a new token would change every cached key
            raise ValueError(f"{config.name!r} is a masked diffusion LM (non-causal); the engine decodes causal models "
                             f"one token at a time; use harness.DiffusionSampler")
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if kv_cache not in LAYOUTS:
            raise ValueError(f"unknown kv_cache {kv_cache!r}; allowed: {', '.join(LAYOUTS)}")
        if not 1 <= max_seq_len <= config.max_seq_len:
            raise ValueError(f"max_seq_len must be in [1, {config.max_seq_len}] (the model's max_seq_len), got {max_seq_len}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {block_size}")
        param = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), param.device, param.dtype
        self.max_seq_len, self.kv_cache = max_seq_len, kv_cache
        specs = model.cache_specs()
        max_batch, num_blocks = size_cache(specs, self.dtype, kv_cache, max_batch, max_seq_len, block_size,
                                           num_blocks, cache_budget_bytes)
        self.max_batch = max_batch
        self.pool = CachePool(specs, kv_cache, max_batch, max_seq_len, block_size, num_blocks, self.dtype, self.device)
        # one block manager per cache group (paged layout only)
        self.block_managers = [BlockManager(n, block_size, group.window) for n, group in zip(num_blocks, self.pool.groups)]
        self.scheduler = Scheduler(max_batch, self.block_managers)
        self.runner = ModelRunner(model, self.pool, self.block_managers, self.device, max_seq_len, compile)
        self.tokenizer = ByteTokenizer()
        self.ids = itertools.count()
        self.decode_stats = DecodeStats()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: "str | list[int]", params: SamplingParams | None = None) -> int:
        """Validate and queue one request; a bad one raises here and leaves the queue as it was."""
        seq = self.make_sequence(prompt, params or SamplingParams())
        self.scheduler.add(seq)
        return seq.request_id

    def make_sequence(self, prompt, params: SamplingParams) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of vocabulary: ids must lie in [0, {vocab})")
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} exceeds "
                             f"max_seq_len={self.max_seq_len}")
        generator = None
        if not params.greedy:
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        seq = Sequence(next(self.ids), ids, params, generator)
        for manager in self.block_managers:
            needed = manager.peak_blocks(seq.max_length)
            if needed > manager.num_blocks:
                raise ValueError(f"request needs {needed} cache blocks of {manager.block_size} tokens; "
                                 f"the pool holds {manager.num_blocks}")
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit what fits, prefill it, then one decode token for every running request. Returns finished requests."""
        finished = []
        for seq in self.scheduler.admit():
            self.emit([seq], self.runner.prefill(seq).unsqueeze(0), finished)
        running = list(self.scheduler.running)
        if running:
            start = time.perf_counter()
            logits = self.runner.decode(running)
            kv_bytes = sum(self.pool.read_bytes(s.cached) for s in running)
            self.emit(running, logits, finished)
            self.decode_stats.seconds.append(time.perf_counter() - start)
            self.decode_stats.batch_sizes.append(len(running))
            self.decode_stats.kv_bytes.append(kv_bytes)
        return finished

    def emit(self, seqs: list[Sequence], logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        """Sample one token per sequence from logits [B, vocab]; finish the sequences that are done."""
        tokens = logits.argmax(dim=-1).tolist()  # every greedy row without a penalty, in one call
        now = time.perf_counter()
        for seq, row, token in zip(seqs, logits, tokens):
            if not seq.params.greedy or seq.params.repetition_penalty != 1.0:
                token = sample_token(row, seq.params, seq.all_ids, seq.generator)
            self.append_token(seq, token, now, row, finished)

    def append_token(self, seq: Sequence, token: int, now: float, logits: torch.Tensor, finished: list[RequestOutput]) -> None:
        seq.token_times.append(now)
        seq.output_ids.append(token)
        if seq.params.return_logits:
            seq.logits.append(logits.float().cpu())
        if token in seq.params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            reason = "length"
        else:
            return
        self.scheduler.finish(seq, reason)
        finished.append(RequestOutput.of(seq))

    def generate(self, prompts, params: "SamplingParams | list[SamplingParams] | None" = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. All prompts are validated before any work."""
        if isinstance(prompts, str):
            prompts = [prompts]  # one text is one prompt, not a list of one-character prompts
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            self.scheduler.add(seq)
        done: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                done[out.request_id] = out
        return [done[s.request_id] for s in seqs if s.request_id in done]

    # ---- memory ---------------------------------------------------------------------------------

    @property
    def cache_bytes_allocated(self) -> int:
        return self.pool.nbytes

    def cache_bytes_in_use(self) -> int:
        """Bytes the running requests occupy: whole rows (contiguous) or their blocks (paged), plus state slots."""
        running = self.scheduler.running
        if self.kv_cache == "contiguous":
            return self.pool.nbytes * len(running) // self.max_batch
        blocks = sum(self.pool.block_bytes(g) * sum(manager.held(s) for s in running)
                     for g, manager in enumerate(self.block_managers))
        return blocks + self.pool.state_slot_bytes * len(running)
