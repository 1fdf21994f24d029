"""`zoo serve`: an OpenAI-compatible HTTP server over one Engine (FastAPI; run by uvicorn). Routes: POST
/v1/completions, POST /v1/chat/completions (both streamed as server-sent events when asked), GET /v1/models,
GET /health, GET /metrics (Prometheus text, vLLM's names), and vLLM's tokenizer routes (GET /tokenizer_info, POST
/tokenize, POST /detokenize) for clients such as lm-evaluation-harness that count tokens remotely.

One engine thread (harness/serve/loop.py) runs every request; handlers only parse, hand over and relay. A client
that disconnects has its requests aborted before the next engine step; a full waiting queue answers 429; a body
over the size limit 413; an unknown model 404; anything malformed 400 with an OpenAI-style error body naming the
field; with an API key, a request without it 401. A request still running after the timeout is aborted (504, or an
error event on a stream).
"""
import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from harness.engine import Engine
from harness.serve.loop import EngineLoop, Token
from harness.serve.prometheus import ServerMetrics
from harness.serve.protocol import APIError, check_model, chat_job, completion_job, parse_body
from harness.serve import tokenizer_routes
from harness.serve.run import Run
from zoo import ByteTokenizer, checks


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20  # a prompt of up to ~1 MB of text
    request_timeout: float = 600.0  # seconds a request may run before it is aborted
    max_waiting: int = 512  # requests waiting for the engine before new ones get 429

    def __post_init__(self):
        checks.integer("max_body_bytes", self.max_body_bytes, minimum=1024)
        checks.real("request_timeout", self.request_timeout, minimum=0, open_min=True)
        checks.integer("max_waiting", self.max_waiting, minimum=1)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def prompt_logprobs(model, ids: list[int], top: int) -> list[Token]:
    """Each prompt token's log-probability under the model given the tokens before it (the first has none), with
    the `top` most likely alternatives: one uncached forward, on the engine's thread."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids], device=device))[0].float(), dim=-1)
    scored = [Token(ids[0])]
    for position in range(1, len(ids)):
        row = logprobs[position - 1]
        best = torch.topk(row, top) if top else None
        scored.append(Token(ids[position], float(row[ids[position]]),
                            () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))))
    return scored


def create_app(engine: Engine, settings: ServeSettings) -> FastAPI:
    tokenizer = ByteTokenizer()
    vocab = engine.model.config.vocab_size
    eos = tokenizer.eos_id if tokenizer.eos_id < vocab else None
    metrics = ServerMetrics(settings.model_name)
    loop = EngineLoop(engine, metrics, settings.max_waiting)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        loop.stop()

    app = FastAPI(title="archzoo", lifespan=lifespan)
    app.state.loop = loop

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        try:
            if settings.api_key and request.url.path.startswith("/v1/"):
                if request.headers.get("authorization") != f"Bearer {settings.api_key}":
                    raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", None,
                                   "authentication_error")
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
                raise APIError(413, f"request body of {length} bytes is over the limit of "
                                    f"{settings.max_body_bytes:,} bytes", None)
        except APIError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return await call_next(request)

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise APIError(413, f"request body of {len(raw):,} bytes is over the limit of "
                                f"{settings.max_body_bytes:,} bytes")
        body = parse_body(raw)
        check_model(body, settings.model_name)
        return body

    async def serve(request: Request, job) -> object:
        if loop.full():
            raise APIError(429, f"the server is at its limit of {settings.max_waiting} waiting requests; retry later",
                           None, "rate_limit_error")
        scores = None
        if job.echo:
            top = job.logprobs or 0
            futures = [loop.call(lambda ids=ids: prompt_logprobs(engine.model, ids, top)) for ids in job.prompts]
            scores = [await asyncio.wrap_future(f) for f in futures]
        run = Run(job, loop, settings.model_name, scores)
        await run.start()
        deadline = time.monotonic() + settings.request_timeout
        if job.stream:
            return StreamingResponse(stream(run, deadline), media_type="text/event-stream")
        while not run.done:
            if not await run.next_item(0.25):
                if await request.is_disconnected():
                    run.abort()
                    raise APIError(499, "client closed the request")
                if time.monotonic() > deadline:
                    run.abort()
                    raise APIError(504, f"request ran past the {settings.request_timeout:g} s timeout")
        failed = next((c for c in run.choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"the engine failed this request: {failed.error}", None, "server_error")
        return JSONResponse(run.response())

    async def stream(run: Run, deadline: float):
        try:
            if run.job.kind == "chat":
                for choice in run.choices:
                    head = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}
                    yield sse({**run.head(True), "choices": [head]})
            pending = {c.index for c in run.choices}
            while pending:
                if not await run.next_item(0.25) and time.monotonic() > deadline:
                    run.abort()
                    yield sse(APIError(504, f"request ran past the {settings.request_timeout:g} s timeout").body())
                    break
                for choice in run.choices:
                    if choice.index not in pending:
                        continue
                    text, tokens = run.delta(choice)
                    finished = choice.finish_reason is not None
                    if text or tokens or finished:
                        yield sse(run.chunk(choice, text, tokens, choice.finish_reason if finished else None))
                    if finished:
                        pending.discard(choice.index)
            if run.job.include_usage:
                yield sse({**run.head(True), "choices": [], "usage": run.usage()})
            yield sse("[DONE]")
        finally:  # a disconnect cancels this generator: its requests end before the engine's next step
            run.abort()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        return await serve(request, completion_job(body, tokenizer.encode, vocab, eos))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        return await serve(request, chat_job(body, tokenizer.encode, vocab, eos))

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return tokenizer_routes.tokenizer_info(tokenizer, engine.max_seq_len)

    @app.post("/tokenize")
    async def post_tokenize(request: Request):
        body = parse_body(await request.body())
        return tokenizer_routes.tokenize(body, tokenizer, engine.max_seq_len)

    @app.post("/detokenize")
    async def post_detokenize(request: Request):
        return tokenizer_routes.detokenize(parse_body(await request.body()), vocab)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "archzoo", "max_model_len": engine.max_seq_len}]}

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok" if loop.thread.is_alive() else "engine loop stopped",
                                 status_code=200 if loop.thread.is_alive() else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    return app
