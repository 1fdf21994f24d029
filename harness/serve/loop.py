"""The one thread that runs the engine for the server. Request handlers never touch the engine: they hand it
messages (add a request, abort one, run a function between steps) through a queue, and each request's tokens come
back through the callback it was added with. The thread steps while any request is unfinished and sleeps on the
queue otherwise, so an abort takes effect before the next step, and a failing request (or a failing step) ends only
the requests it touched, never the loop.
"""
import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from harness.engine import Engine
from harness.engine.sampling import SamplingParams
from harness.serve.prometheus import ServerMetrics


@dataclass(frozen=True)
class Token:
    """One new token of a request, with its log-probability and the `top` most likely alternatives (None when the
    request asked for no logprobs): computed from the raw model distribution, as vLLM's logprobs are."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "length" | "stop" | "abort" | "error"
    error: str = ""


Sink = Callable[[object], None]  # receives Token and, last, Finished; called on the loop thread


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> Token:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return Token(token, float(logprobs[token]), alternatives)


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[int, list] = {}  # request id -> [its sink, logprobs wanted, tokens delivered]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="zoo-serve-engine", daemon=True)

    # ---- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=30)

    def full(self) -> bool:
        """Whether the waiting queue is at its bound (the handler answers 429)."""
        return self.metrics.waiting + self.inbox.qsize() >= self.max_waiting

    def add(self, prompt_ids: list[int], params: SamplingParams, sink: Sink,
            logprobs: int | None) -> concurrent.futures.Future:
        """Queue a request; the future gives its id once the engine took it, or the ValueError it refused it with."""
        accepted = concurrent.futures.Future()
        self.inbox.put(("add", prompt_ids, params, sink, logprobs, accepted))
        return accepted

    def abort(self, request_id: int) -> None:
        self.inbox.put(("abort", request_id))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn() on the loop thread between steps (the engine's model is not shared across threads)."""
        done = concurrent.futures.Future()
        self.inbox.put(("call", fn, done))
        return done

    # ---- the loop thread ---------------------------------------------------------------------------

    def run(self) -> None:
        while not self.stopping.is_set():
            self.drain(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self.step()

    def drain(self, block: bool) -> None:
        try:
            message = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                self.handle(message)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, prompt_ids, params, sink, logprobs, accepted = message
            try:
                request_id = self.engine.add_request(prompt_ids, params)
            except ValueError as error:
                accepted.set_exception(error)
                return
            self.sinks[request_id] = [sink, logprobs, 0]
            accepted.set_result(request_id)
        elif kind == "abort":
            request_id = message[1]
            if request_id in self.sinks:
                self.engine.abort(request_id)
                self.sinks.pop(request_id)[0](Finished("abort"))
        elif kind == "call":
            _, fn, done = message
            try:
                done.set_result(fn())
            except Exception as error:  # noqa: BLE001 - handed to the caller, the loop goes on
                done.set_exception(error)
        self.refresh()

    def step(self) -> None:
        try:
            events = self.engine.step_tokens()
        except Exception as error:  # noqa: BLE001 - a step that fails ends its requests, not the server
            for request_id in list(self.sinks):
                self.engine.abort(request_id)
                self.sinks.pop(request_id)[0](Finished("error", f"{type(error).__name__}: {error}"))
            self.refresh()
            return
        for event in events:
            entry = self.sinks.get(event.request_id)
            if entry is None:
                continue
            sink, logprobs, delivered = entry
            if event.token_id is not None:
                sink(self.token(event, logprobs, delivered))
                entry[2] += 1
            if event.finished is not None:
                del self.sinks[event.request_id]
                self.metrics.record(event.finished)
                sink(Finished(event.finished.finish_reason, event.finished.error))
        self.refresh()

    def token(self, event, logprobs: int | None, index: int) -> Token:
        """The event's token; with logprobs, from the logits it was sampled from (the request's index-th: a step may
        give one request two tokens, its prefill's and a decode's)."""
        if logprobs is None:
            return Token(event.token_id)
        seq = event.finished if event.finished is not None else self.engine.unfinished[event.request_id]
        return token_logprobs(seq.logits[index], event.token_id, logprobs)

    def refresh(self) -> None:
        """The engine's figures for GET /metrics, taken here where nothing else touches the engine."""
        engine, m = self.engine, self.metrics
        m.running, m.waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
        m.kv_cache_usage = engine.cache_bytes_in_use() / max(1, engine.cache_bytes_allocated)
        m.preemptions = engine.preemptions
        m.prefix_queries, m.prefix_hits = engine.scheduler.prompt_tokens, engine.scheduler.cached_prompt_tokens
