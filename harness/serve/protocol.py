"""The OpenAI API's request bodies, read and checked into what the engine runs: every field by name, every bad value
an APIError that names it and what is allowed (the server answers it as a 4xx with an OpenAI-style error body, never a
500), before any request reaches the engine.

Completions (POST /v1/completions, the fields vLLM's server takes): model, prompt (a string, a list of strings, a
list of token ids, or a list of those), max_tokens (default 16; 0 with echo scores the prompt alone, as
lm-evaluation-harness's loglikelihood asks), temperature, top_p, top_k (vLLM's; 0 or -1 = off), stop (a string or up
to 4), seed (choice i of n draws with seed + i), n, logprobs (0-20 alternatives per token), echo, stream,
stream_options.include_usage, ignore_eos and return_token_ids (vLLM's). Chat (POST /v1/chat/completions): messages
(roles system, user, assistant; string content) through the byte-level template of harness/serve/chat.py,
max_tokens or max_completion_tokens, logprobs (bool) with top_logprobs (0-20), and the sampling fields above.
"""
import json
from dataclasses import dataclass, field

from harness.engine.sampling import SamplingParams
from harness.serve.chat import CHAT_ROLES, render_chat

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)
MAX_CHOICES = 64  # n: each choice is a request in the engine
MAX_PROMPTS = 256  # prompts in one completions request


class APIError(Exception):
    """A request the server refuses: HTTP status, message, the field at fault and OpenAI's error type."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


@dataclass(frozen=True)
class Job:
    """One request as the engine will run it: its prompts (token ids), each run `n` times, and how to report it."""

    kind: str  # "completion" or "chat"
    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: dict  # SamplingParams fields besides max_new_tokens and seed
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None  # alternatives per token; None = no logprobs
    echo: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop_token_ids: tuple[int, ...] = field(default=())

    def params(self, choice: int) -> SamplingParams:
        """The engine's parameters for choice `choice` of a prompt (its seed offset by the choice)."""
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_new_tokens=self.max_tokens, seed=seed, stop_token_ids=self.stop_token_ids,
                              return_logits=self.logprobs is not None, **self.sampling)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise bad("model", f"missing; this server serves {served!r}")
    if model != served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}", "model",
                       "not_found_error")


def integer(body: dict, name: str, default, minimum: int, maximum: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad(name, f"must be {allowed}, got {value}")
    return value


def real(body: dict, name: str, default: float, minimum: float, maximum: float | None = None,
         open_min: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise bad(name, f"must be a number, got {value!r}")
    if value < minimum or (open_min and value == minimum) or (maximum is not None and value > maximum):
        low = f"> {minimum}" if open_min else f">= {minimum}"
        raise bad(name, f"must be {low}" + (f" and <= {maximum}" if maximum is not None else "") + f", got {value}")
    return float(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return value


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of them, got {stop!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return tuple(stops)


def token_list(value, vocab_size: int, name: str) -> list[int]:
    if not value:
        raise bad(name, "an empty prompt has no token to continue")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise bad(name, f"token ids must be integers in [0, {vocab_size - 1}], got {token!r}")
    return list(value)


def prompts(body: dict, encode, vocab_size: int) -> list[list[int]]:
    """The prompt field as token-id lists: a string, a list of ids, or a list of strings or of id lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "missing: give a string, a list of token ids, or a list of either")
    if isinstance(prompt, str):
        return [token_list(encode(prompt), vocab_size, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [token_list(prompt, vocab_size, "prompt")]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        out = []
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                out.append(token_list(encode(item), vocab_size, f"prompt[{i}]"))
            elif isinstance(item, list):
                out.append(token_list(item, vocab_size, f"prompt[{i}]"))
            else:
                raise bad(f"prompt[{i}]", f"must be a string or a list of token ids, got {type(item).__name__}")
        return out
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    raise bad("prompt", f"must be a string, a list of token ids, or a list of either, got {prompt!r:.80}")


def sampling(body: dict) -> dict:
    top_k = integer(body, "top_k", 0, minimum=-1)
    return {"temperature": real(body, "temperature", 1.0, 0.0, 2.0), "top_p": real(body, "top_p", 1.0, 0.0, 1.0,
                                                                                   open_min=True),
            "top_k": max(0, top_k)}  # vLLM's -1 and 0 both mean off


def stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("stream_options", f"must be an object, got {options!r}")
    if not stream:
        raise bad("stream_options", "only allowed with stream: true")
    return boolean(options, "include_usage")


def completion_job(body: dict, encode, vocab_size: int, eos_id: int | None) -> Job:
    prompt_ids = prompts(body, encode, vocab_size)
    echo = boolean(body, "echo")
    max_tokens = integer(body, "max_tokens", 16, minimum=0 if echo else 1)
    stream = boolean(body, "stream")
    if max_tokens == 0 and stream:
        raise bad("max_tokens", "0 (score the prompt alone) cannot stream")
    logprobs = integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    return Job("completion", prompt_ids, integer(body, "n", 1, 1, MAX_CHOICES), max_tokens, sampling(body),
               integer(body, "seed", None, 0, 2**63 - 1), stop_strings(body), logprobs, echo, stream,
               stream_options(body, stream), boolean(body, "return_token_ids"),
               () if boolean(body, "ignore_eos") or eos_id is None else (eos_id,))


def chat_job(body: dict, encode, vocab_size: int, eos_id: int | None) -> Job:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {message!r:.80}")
        if not isinstance(message.get("content"), str):
            raise bad(f"messages[{i}].content", f"must be a string, got {message.get('content')!r:.80}")
    wants_logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not wants_logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    stream = boolean(body, "stream")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = integer({"max_tokens": limit}, "max_tokens", 16, minimum=1)
    prompt = token_list(encode(render_chat(messages)), vocab_size, "messages")
    return Job("chat", [prompt], integer(body, "n", 1, 1, MAX_CHOICES), max_tokens, sampling(body),
               integer(body, "seed", None, 0, 2**63 - 1), stop_strings(body), (top or 0) if wants_logprobs else None,
               False, stream, stream_options(body, stream), boolean(body, "return_token_ids"),
               () if boolean(body, "ignore_eos") or eos_id is None else (eos_id,))
