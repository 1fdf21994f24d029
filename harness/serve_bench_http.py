"""`zoo serve-bench --url`: the same workloads, arrivals and metrics as the in-process bench (harness/serve_bench.py),
sent to any OpenAI-compatible server as streaming completions, the way `vllm bench serve` sends them: token-id
prompts, max_tokens = the drawn output length, temperature 0, ignore_eos, stream_options.include_usage. A token's
time is the arrival of the server-sent event that carries it, so TTFT and ITL include HTTP, queueing and the
server's own streaming; with archzoo's `zoo serve` on the other end, the difference from the in-process figures is
the HTTP overhead."""
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from harness.engine.request_metrics import RequestMetrics


@dataclass
class HTTPOutput:
    """What serving_metrics reads of a request served over HTTP (harness.RequestOutput's fields of that name)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # one entry per token counted (ids where the server sends them)
    finish_reason: str = "error"
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics.of(0.0, []))
    error: str = ""


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model GET /v1/models lists: the name the requests ask for."""
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ValueError(f"no OpenAI-compatible server answers GET {url}/v1/models: {error}") from None


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                     arrival: float) -> HTTPOutput:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    out, times = HTTPOutput(prompt), []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk.get("choices") or ():
                    tokens = choice.get("token_ids") or ([None] if choice.get("text") else [])
                    now = time.perf_counter()
                    times += [now] * len(tokens)
                    out.token_ids += tokens
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as error:
        out.error, out.finish_reason = f"{type(error).__name__}: {error}", "error"
    out.metrics = RequestMetrics.of(arrival, times)
    return out


async def run_cell(url: str, model: str, requests, arrivals: list[float] | None, concurrency: int | None):
    """Open loop (each request sent at its scheduled time) or closed loop (`concurrency` in flight); returns the
    outputs and the run's duration."""
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=max(len(requests), 1))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if concurrency is None:
            async def scheduled(request, at: float):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                return await stream_one(client, url, model, request.prompt, request.output_len, start + at)
            outputs = await asyncio.gather(*(scheduled(r, at) for r, at in zip(requests, arrivals)))
        else:
            gate = asyncio.Semaphore(concurrency)

            async def gated(request):
                async with gate:
                    return await stream_one(client, url, model, request.prompt, request.output_len,
                                            time.perf_counter())
            outputs = await asyncio.gather(*(gated(r) for r in requests))
        return list(outputs), time.perf_counter() - start
