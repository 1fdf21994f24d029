"""The generation engine: request queue, continuous batching, prefill + batched decode, per-request metrics."""
import threading
import time
from collections import deque
from collections.abc import Iterator

import torch

import zoo
from harness.engine.beam_search import BeamOutput, BeamSearch, BeamSearchParams
from harness.engine.block_manager import BlockManager
from harness.engine.cache_pool import CachePool, size_cache
from harness.engine.checks import (check_options, check_pool, check_scored, check_speculative, resolve_graph_mode,
                                   scored_retention, sized_by)
from harness.engine.decode_stats import DecodeStats
from harness.engine.model_runner import ModelRunner, prefill_batches
from harness.engine.sampling import SamplingParams, sample_token
from harness.engine.scheduler import Scheduler
from harness.engine.sequence import RequestOutput, Sequence, Status, TokenEvent
from harness.engine.speculative import SpeculativeConfig, SpeculativeDecoder
from kernels import greedy_rows
from zoo import checks
from zoo.tokenizer import ByteTokenizer


class Exclusive:
    """Refuses a second caller while one is inside: the engine is not thread-safe, and says so instead of
    corrupting its queues and caches."""

    def __init__(self):
        self.lock = threading.Lock()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            raise RuntimeError("Engine is not thread-safe: another call (step, generate, add_request or abort) is "
                               "already running on this engine; serialise calls or use one engine per thread")

    def __exit__(self, *exc):
        self.lock.release()


def check_arrival(arrival) -> float:
    """A request's arrival: a finite time.perf_counter() value, not after now."""
    arrival = checks.real("arrival (a time.perf_counter() value)", arrival)
    now = time.perf_counter()
    if arrival > now:
        raise ValueError(f"arrival={arrival!r} is {arrival - now:.6g} s in the future (time.perf_counter() is now "
                         f"{now!r}): a request cannot arrive after it is added; pass a time at or before now")
    return arrival


class Engine:
    def __init__(self, model, max_batch: int = 8, max_seq_len: int | None = None, kv_cache: str = "contiguous",
                 block_size: int = 16, num_blocks: int | None = None, cache_budget_bytes: int | None = None,
                 compile: bool = False, admission: str = "reserve", max_num_batched_tokens: int | None = None,
                 prefix_caching: bool = False, speculative: SpeculativeConfig | None = None,
                 quantize: "zoo.QuantizeConfig | None" = None, kv_dtype: str = "auto",
                 cuda_graphs: "bool | str | None" = None):
        """kv_cache: "contiguous" ([slots, kv_heads, max_seq_len, head_dim] per layer) or "paged" (block pool).

        num_blocks / cache_budget_bytes size the paged pool (default: room for max_batch full-length sequences;
        num_blocks is per cache group, i.e. per distinct retention policy in the model);
        for the contiguous layout a budget caps max_batch at the rows that fit.
        compile: torch.compile the decode step (fixed shapes; each new batch size compiles once).
        admission (paged only): "reserve" admits a request when its worst case fits, so none is preempted;
        "optimistic" admits on what its prompt needs now and preempts the newest running request (recomputed
        later, same tokens) when the pool runs out, as vLLM does.
        max_num_batched_tokens (vLLM's name): None prefills each admitted prompt whole in the step that admits it.
        A token budget turns on chunked prefill (Sarathi-Serve): each step, the running decodes take one token each
        and chunks of waiting prompts fill the rest, a long prompt continuing from its cache over several steps, so
        a long prompt never stalls the decodes for longer than one budget's worth of work.
        prefix_caching (paged only; vLLM's automatic prefix caching): a prompt's leading full blocks that another
        request already computed are shared instead of recomputed, and finished requests' blocks stay cached until
        the pool needs them (LRU). Shareable: full-attention, latent and cross-layer caches, and window blocks the
        next query still sees (a prefill then writes and caches a window's whole prompt, so a prefix longer than the
        window is found too). A model with a recurrent state cannot resume from a block boundary (its state there
        is not kept), so prefix caching is off for it, and `prefix_caching_off` says why.
        speculative: speculative decoding (harness.SpeculativeConfig: a draft model or prompt lookup, k): each
        decode step the proposer offers k tokens per request and the target verifies them in one forward, keeping
        the target's distribution exactly (greedy: its argmax tokens); `speculative_stats` has the acceptance.
        quantize: run a weight-quantized copy of the model (zoo.QuantizeConfig, round to nearest; for AWQ, which
        needs calibration text, pass zoo.quantize(model, config, calibration) as the model instead).
        kv_dtype: "auto" (the model's dtype), "int8" or "fp8" (float8 e4m3): per-token caches (keys, values, MLA
        latents) stored one byte an element with a scale per token and KV head, about half the bytes of bf16;
        recurrent state keeps its declared dtype.
        cuda_graphs: capture the decode step in a CUDA graph per batch-size bucket (1, 2, 4, 8, 16, 32, ... up to
        max_batch) on its first use, pad each batch to its bucket and replay (harness/engine/decode_graphs.py), so a
        step costs its kernels, not their launches. None: on for a CUDA model where the engine allows it (else off, and
        `cuda_graphs_off` says why); True: on, or a ValueError saying why not; False: off. "static": the same padded
        step on the same buffers, run eagerly on any device (what the CPU tests check of capture's needs).
        Prefill, chunked prefill and speculative verification run eagerly; compile=True keeps graphs off.
        On a CPU the runner moves the model's weights into 2 MiB pages, each tensor in place (kernels/cpu_memory.py),
        and the caches are allocated there; `runner.huge_pages_off` says why not where it does not.
        """
        max_batch, max_seq_len, block_size, num_blocks, cache_budget_bytes, max_num_batched_tokens = check_options(
            model, max_batch, max_seq_len, kv_cache, block_size, num_blocks, cache_budget_bytes, compile, admission,
            max_num_batched_tokens, prefix_caching, kv_dtype, quantize)
        lookahead = check_speculative(speculative, model, compile, kv_cache, max_seq_len)
        check_scored(model, max_seq_len, max_num_batched_tokens, speculative, kv_dtype)
        graph_mode, self.graphs_off_reason = resolve_graph_mode(cuda_graphs, model, compile, speculative)
        if quantize is not None:
            model = zoo.quantize(model, quantize)
        param = next(model.parameters())
        self.model, self.device, self.dtype = model.eval(), param.device, param.dtype
        self.max_seq_len, self.kv_cache = max_seq_len, kv_cache
        specs = model.cache_specs()
        self.max_num_batched_tokens = max_num_batched_tokens
        states = [i for i, spec in enumerate(specs) if spec.kind == "state"]
        scored = scored_retention(model)
        self.prefix_caching_off = "" if not prefix_caching else (
            f"recurrent state in layers {states} is not kept at block boundaries, so a request cannot resume from a "
            f"cached prefix" if states else f"the model keeps tokens by score ({scored}): a sequence's blocks hold "
            f"what its own attention kept, so none is shared" if scored else "")
        prefix_caching = prefix_caching and not states and not scored
        # most tokens a step feeds one sequence on top of its cache: a whole prompt's rest after a prefix hit
        step_tokens = max(max_num_batched_tokens or (max_seq_len if prefix_caching else 1), lookahead + 1)
        # a verification caches up to k proposed tokens past the kept ones before it rolls back
        self.lookahead, cache_len = lookahead, max_seq_len + lookahead
        lower = sized_by(kv_cache, num_blocks, cache_budget_bytes, lookahead)  # the options a refusal names
        max_batch, num_blocks = size_cache(specs, self.dtype, kv_cache, max_batch, cache_len, block_size,
                                           num_blocks, cache_budget_bytes, step_tokens, kv_dtype)
        self.max_batch, self.kv_dtype = max_batch, kv_dtype
        # every allocation these sizes decide, priced and checked against the memory limit before any is made
        self.footprint = check_pool(specs, self.dtype, self.device, kv_cache, max_batch, cache_len, block_size,
                                    num_blocks, kv_dtype, graph_mode is not None, speculative, lower)
        self.pool = CachePool(specs, kv_cache, max_batch, cache_len, block_size, num_blocks, self.dtype, self.device,
                              kv_dtype, spares=graph_mode is not None)
        # one block manager per cache group (paged layout only)
        self.block_managers = [BlockManager(n, block_size, group.retention, admission, step_tokens=step_tokens,
                                            prefix_caching=prefix_caching)
                               for n, group in zip(num_blocks, self.pool.groups)]
        self.scheduler = Scheduler(max_batch, self.block_managers, prefix_caching, decode_tokens=lookahead + 1)
        self.runner = ModelRunner(model, self.pool, self.block_managers, self.device, cache_len, compile, graph_mode)
        self.speculator = None if speculative is None else SpeculativeDecoder(
            speculative, self.runner, kv_cache, max_batch, cache_len, block_size)
        self.tokenizer = ByteTokenizer()
        self.requests_added = 0  # request ids are 0, 1, 2, ... in order of arrival
        self.unfinished: dict[int, Sequence] = {}  # waiting or running, by request id
        self.undelivered: deque[TokenEvent] = deque()  # a step's events a closed stream() did not yield yet
        self.decode_stats = DecodeStats()
        self.exclusive = Exclusive()

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: "str | list[int]", params: SamplingParams | None = None,
                    arrival: float | None = None) -> int:
        """Validate and queue one request; a bad one raises here and leaves the queue as it was. Returns its id.
        arrival: its time.perf_counter() arrival, from which TTFT and E2E count (default: now); a load generator
        passes the scheduled time, so the lag before it got round to adding the request counts as waiting. A time
        in the future is refused: its TTFT and E2E would come out negative."""
        with self.exclusive:
            seq = self.make_sequence(prompt, params)
            if arrival is not None:
                seq.arrival = check_arrival(arrival)
            return self.queue(seq).request_id

    def queue(self, seq: Sequence) -> Sequence:
        seq.request_id = self.requests_added
        self.requests_added += 1
        self.unfinished[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def make_sequence(self, prompt, params: SamplingParams | None) -> Sequence:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a harness.SamplingParams, got {type(params).__name__}")
        vocab = self.model.config.vocab_size
        raw = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if isinstance(raw, (list, tuple, range, torch.Tensor)) and len(raw) > self.max_seq_len:
            self.check_length(len(raw), params)  # before every id of a huge prompt is read
        ids = checks.token_ids("prompt", raw, vocab)
        checks.in_vocabulary("stop_token_ids", params.stop_token_ids, vocab, " (they could never fire)")
        self.check_length(len(ids), params)
        generator = None
        if not params.greedy:
            generator = torch.Generator(self.device)
            generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        seq = Sequence(-1, ids, params, generator, lookahead=self.lookahead)  # its id is given when it is queued
        for manager in self.block_managers:
            needed = manager.peak_blocks(seq.max_length)
            if needed > manager.num_blocks:
                raise ValueError(f"request needs {needed} cache blocks of {manager.block_size} tokens; "
                                 f"the pool holds {manager.num_blocks}")
        return seq

    def check_length(self, prompt_tokens: int, params: SamplingParams) -> None:
        if prompt_tokens + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {prompt_tokens:,} tokens + max_new_tokens={params.max_new_tokens} exceeds "
                             f"max_seq_len={self.max_seq_len}")

    def admit_prefilled(self) -> list[Sequence]:
        """Admit what fits as if each prompt were already in the cache (its contents left as they are), the last
        prompt token as the first decode input: decode timed at a context without paying for its prefill
        (benchmarks, harness.decode_probe). The tokens are meaningless; the step's costs are the real ones."""
        with self.exclusive:
            seqs = [seq for seq, _ in self.scheduler.schedule(None)]
            for seq in seqs:
                seq.num_cached = len(seq.prompt_ids)
                seq.output_ids.append(seq.prompt_ids[-1])
            return seqs

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs."""
        return self.runner.graphs is not None and self.runner.graphs.mode == "capture"

    @property
    def cuda_graphs_off(self) -> str:
        """Why decode steps do not replay CUDA graphs ("" when they do)."""
        graphs = self.runner.graphs
        return graphs.failure if graphs is not None and graphs.failure else self.graphs_off_reason

    @property
    def graph_bytes(self) -> int:
        """Device bytes the decode graphs hold: their memory pool, static input buffers and the caches' spare slot
        row and blocks for padding; 0 without graphs."""
        graphs = self.runner.graphs
        return 0 if graphs is None else graphs.nbytes + self.pool.spare_bytes

    @property
    def preemptions(self) -> int:
        """Requests preempted so far (optimistic admission), each recomputed when readmitted."""
        return self.scheduler.preemptions

    @property
    def speculative_stats(self):
        """harness.SpeculativeStats of the speculative steps so far (acceptance rate, tokens per target forward,
        draft and target time); None without speculative decoding."""
        return None if self.speculator is None else self.speculator.stats

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prefill tokens found in the prefix cache (vLLM's prefix cache hit rate); 0 when off."""
        scheduler = self.scheduler
        return scheduler.cached_prompt_tokens / scheduler.prompt_tokens if scheduler.prompt_tokens else 0.0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request_id: int) -> RequestOutput | None:
        """End a waiting or running request now; its cache blocks and batch slot are free when this returns.
        Returns its output so far (finish_reason "abort"). A request that already ended returns the output a closed
        stream() left undelivered (its own finish_reason), or None once that output was delivered. Either way no
        later event of it is delivered."""
        with self.exclusive:
            checks.integer("request_id", request_id, minimum=0)
            if request_id >= self.requests_added:
                raise ValueError(f"unknown request_id {request_id}: this engine has issued ids 0 to "
                                 f"{self.requests_added - 1}" if self.requests_added else
                                 f"unknown request_id {request_id}: this engine has no requests yet")
            seq = self.unfinished.pop(request_id, None)
            if seq is None:
                return next(iter(self.take_undelivered({request_id})), None)
            self.scheduler.abort(seq, "abort")
            self.take_undelivered({request_id})  # its output below holds every token those events carried
            return RequestOutput.of(seq)

    def take_finished(self) -> list[RequestOutput]:
        """The outputs of requests that ended in a step whose events a closed stream() did not all yield, oldest
        first, taken off the engine with their requests' other undelivered events ([] when none wait). A consumer
        that stops streaming collects them here without running another step."""
        with self.exclusive:
            ended = {event.request_id for event in self.undelivered if event.finished is not None}
            return self.take_undelivered(ended)

    def take_undelivered(self, request_ids: set[int]) -> list[RequestOutput]:
        """Drop these requests' undelivered events (their outputs are handed over another way); returns the
        outputs among them."""
        taken = [event for event in self.undelivered if event.request_id in request_ids]
        self.undelivered = deque(event for event in self.undelivered if event.request_id not in request_ids)
        return [event.finished for event in taken if event.finished is not None]

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit what fits, prefill it, then one decode token for every running request. Returns the requests
        that ended in this step, failed ones included (finish_reason "error"), after any a closed stream() left
        undelivered."""
        return [event.finished for event in self.step_tokens() if event.finished is not None]

    def step_tokens(self) -> list[TokenEvent]:
        """One step, as events: each request's new token, with its output on the event that ends it. Events a
        closed stream() left undelivered come first."""
        with self.exclusive:
            events = [*self.undelivered, *self.run_step()]  # a failing step leaves the queue as it was
            self.undelivered.clear()
            return events

    def stream(self) -> Iterator[TokenEvent]:
        """Step until every queued request has ended and every event is delivered, yielding each token as it is
        produced. Between events a caller may add_request (joins the next step) or abort (ends it before the next
        step). A step's events wait on the engine until yielded, so a consumer that stops early (break, close)
        loses none: the next stream(), step() or step_tokens() delivers them first, and take_finished() (or
        abort(request_id)) hands over the outputs among them without another step."""
        while (event := self.next_event()) is not None:
            yield event

    def next_event(self) -> TokenEvent | None:
        """The oldest undelivered event, taken off the queue; steps while the queue is empty and requests are
        unfinished (a step may end none of them). None when both are done."""
        with self.exclusive:
            while not self.undelivered and self.has_unfinished():
                self.undelivered.extend(self.run_step())
            return self.undelivered.popleft() if self.undelivered else None

    def run_step(self) -> list[TokenEvent]:
        """Prefill what the scheduler gives this step (whole prompts, or chunks under a token budget), then one
        decode token for every request whose prefill is done. A request that raises while it is prefilled or
        sampled ends alone with finish_reason "error"; the batched decode forward cannot tell whose row broke it, so
        its failure ends that step's batch."""
        events: list[TokenEvent] = []
        for chunks in prefill_batches(self.scheduler.make_room(self.scheduler.schedule(self.max_num_batched_tokens))):
            self.prefill(chunks, events)
        self.scheduler.make_room()
        running = [seq for seq in self.scheduler.running if seq.prefilled]
        if running and self.speculator is not None:
            self.speculative_step(running, events)
        elif running:
            start = time.perf_counter()
            try:
                logits = self.runner.decode(running)
            except Exception as error:  # noqa: BLE001
                for seq in running:
                    self.fail(seq, error, events)
                return events
            kv_bytes = sum(self.pool.read_bytes(s.num_cached) for s in running)
            self.emit(running, logits, events)
            self.decode_stats.record(time.perf_counter() - start, len(running), kv_bytes)
        return events

    def prefill(self, chunks: list[tuple[Sequence, int]], events: list[TokenEvent]) -> None:
        """One forward of prefill work; a request whose prompt is now all in the cache gets its first token (a
        preempted one already has it: the next decode feeds it). If a batched forward raises, one row's failure cannot
        be told from another's: each request is prefilled again alone, and only those that fail alone end."""
        first_token = [not seq.output_ids for seq, _ in chunks]
        try:
            logits = self.runner.prefill(chunks)
        except Exception as error:  # noqa: BLE001 - any failure ends its requests only
            if len(chunks) > 1:  # every row starts from nothing (prefill_batches), so a retry starts clean
                for chunk in chunks:
                    self.prefill([chunk], events)
            else:
                self.fail(chunks[0][0], error, events)
            return
        done = [(seq, row) for (seq, _), row, first in zip(chunks, logits, first_token) if first and seq.prefilled]
        if done:
            self.emit([seq for seq, _ in done], torch.stack([row for _, row in done]), events)

    def speculative_step(self, running: list[Sequence], events: list[TokenEvent]) -> None:
        """Proposals verified by one target forward: each request gains its accepted tokens and the target's own,
        stamped at once; then every cache keeps what the requests still running accepted."""
        start = time.perf_counter()
        try:
            verdicts = self.speculator.step(running)
        except Exception as error:  # noqa: BLE001 - the batched forward cannot tell whose row broke it
            for seq in running:
                self.fail(seq, error, events)
            return
        now, emitted = time.perf_counter(), 0
        for seq, (tokens, rows, error) in zip(running, verdicts):
            if error is not None:
                self.fail(seq, error, events)
            for token, row in zip(tokens, rows):
                events.append(self.append_token(seq, token, now, row))
                emitted += 1
                if events[-1].finished is not None:
                    break
        self.speculator.keep([seq for seq in running if seq.status is Status.RUNNING])
        kv_bytes = sum(self.pool.read_bytes(s.num_cached) for s in running)
        self.decode_stats.record(time.perf_counter() - start, emitted, kv_bytes)

    def emit(self, seqs: list[Sequence], logits: torch.Tensor, events: list[TokenEvent]) -> None:
        """Sample one token per sequence from logits [B, vocab]; finish the sequences that are done."""
        tokens, finite = greedy_rows(logits)  # every greedy row's token without a penalty, in one call
        now = time.perf_counter()
        for seq, row, token, ok in zip(seqs, logits, tokens, finite):
            try:
                if not ok:
                    raise FloatingPointError("the model produced non-finite logits for this request")
                if not seq.params.greedy or seq.params.repetition_penalty != 1.0:
                    token = sample_token(row, seq.params, seq.all_ids, seq.generator)
                events.append(self.append_token(seq, token, now, row))
            except Exception as error:  # noqa: BLE001 - a failing request must not take the batch with it
                self.fail(seq, error, events)

    def append_token(self, seq: Sequence, token: int, now: float, logits: torch.Tensor) -> TokenEvent:
        seq.token_times.append(now)
        seq.output_ids.append(token)
        if seq.params.return_logits:
            seq.logits.append(logits.float().cpu())
        if token in seq.params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.params.max_new_tokens:
            reason = "length"
        else:
            return TokenEvent(seq.request_id, token)
        return TokenEvent(seq.request_id, token, self.finish(seq, reason))

    def finish(self, seq: Sequence, reason: str) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self.unfinished.pop(seq.request_id, None)
        return RequestOutput.of(seq)

    def fail(self, seq: Sequence, error: Exception, events: list[TokenEvent]) -> None:
        seq.error = f"{type(error).__name__}: {error}"
        events.append(TokenEvent(seq.request_id, None, self.finish(seq, "error")))

    def generate(self, prompts, params: "SamplingParams | list[SamplingParams] | None" = None) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in prompt order (a failed one has
        finish_reason "error"). All prompts are validated before any work. Refused while requests queued with
        add_request are unfinished, whose outputs it would otherwise swallow: drain those with step() or stream()."""
        with self.exclusive:
            if self.has_unfinished():
                raise RuntimeError(f"generate() needs an idle engine: {len(self.unfinished)} request(s) queued with "
                                   f"add_request are unfinished; drain them with step() or stream(), or abort them")
            if isinstance(prompts, str):
                prompts = [prompts]  # one text is one prompt, not a list of one-character prompts
            if not isinstance(prompts, (list, tuple)):
                raise ValueError(f"prompts must be a list of prompts (texts or token id lists), got {type(prompts).__name__}")
            params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
            seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]
            for seq in seqs:
                self.queue(seq)
            done: dict[int, RequestOutput] = {}
            while self.has_unfinished():
                for event in self.run_step():
                    if event.finished is not None:
                        done[event.request_id] = event.finished
            return [done[s.request_id] for s in seqs]

    def beam_search(self, prompt: "str | list[int]", params: BeamSearchParams | None = None) -> list[BeamOutput]:
        """Beam search for one prompt, as transformers' generate(num_beams=...) scores it: the best
        num_return_sequences hypotheses, best first. The engine must be idle (the beams take its slots), paged, with
        a slot per beam and room in the pool for every beam's worst case; all checked before any work."""
        params = BeamSearchParams() if params is None else params
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a harness.BeamSearchParams, got {type(params).__name__}")
        with self.exclusive:
            if self.has_unfinished():
                raise RuntimeError(f"beam_search() needs an idle engine: {len(self.unfinished)} request(s) are "
                                   f"unfinished; drain them with step() or stream(), or abort them")
            if self.kv_cache != "paged":
                raise ValueError("beam_search needs kv_cache='paged': beams share blocks by reference")
            if self.speculator is not None:
                raise ValueError("beam_search on an engine with speculative decoding: beams are scored on the "
                                 "target's own distribution token by token; build the engine without speculative")
            if params.num_beams > self.max_batch:
                raise ValueError(f"num_beams={params.num_beams} needs a batch slot per beam; this engine has "
                                 f"max_batch={self.max_batch}")
            seq = self.make_sequence(prompt, SamplingParams(max_new_tokens=params.max_new_tokens,
                                                            stop_token_ids=params.stop_token_ids))
            for manager in self.block_managers:
                needed = params.num_beams * manager.peak_blocks(seq.max_length)
                if needed > manager.num_blocks:
                    raise ValueError(f"{params.num_beams} beams may need {needed} cache blocks of "
                                     f"{manager.block_size} tokens; the pool holds {manager.num_blocks}")
            return BeamSearch(self, seq.prompt_ids, params).run()

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
