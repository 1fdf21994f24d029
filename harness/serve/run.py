"""One API request in flight: its choices (a prompt x n each, one engine request apiece), the text they have made,
stop strings, logprobs, and the OpenAI response or stream chunks they turn into. Lives on the server's event loop;
the engine loop feeds it (choice index, Token | Finished) items through an asyncio queue."""
import asyncio
import time
import uuid
from dataclasses import dataclass, field

from harness.serve.loop import EngineLoop, Finished, Token
from harness.serve.protocol import APIError, Job
from zoo import ByteTokenizer

TOKENIZER = ByteTokenizer()

SPECIAL_NAMES = {256: "<|bos|>", 257: "<|eos|>", 258: "<|mask|>"}  # zoo.ByteTokenizer's special ids


def token_text(token_id: int) -> str:
    """A token as the logprobs name it: an ASCII byte as itself, any other byte as OpenAI writes a partial
    character ("bytes:\\xNN"), a special or unused id by name."""
    if token_id < 128:
        return chr(token_id)
    if token_id < 256:
        return f"bytes:\\x{token_id:02x}"
    return SPECIAL_NAMES.get(token_id, f"<|{token_id}|>")


def token_bytes(token_id: int) -> list[int]:
    return [token_id] if token_id < 256 else []


def complete_text(ids: list[int]) -> str:
    """The bytes among ids as text, leaving out a trailing character whose bytes have not all arrived (so a stream
    never sends half of one); special ids are dropped, as zoo.ByteTokenizer.decode drops them."""
    data = bytes(i for i in ids if i < 256)
    for cut in range(min(3, len(data)), 0, -1):  # a UTF-8 character is at most 4 bytes: look back up to 3
        lead = data[-cut]
        need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
        if need:
            if cut < need:
                data = data[:-cut]
            break
    return data.decode("utf-8", errors="replace")


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    request_id: int | None = None
    tokens: list[Token] = field(default_factory=list)
    text: str = ""  # the text so far, cut at a stop string once one appears
    sent: int = 0  # characters of text already streamed
    tokens_sent: int = 0  # tokens whose logprobs were already streamed
    finish_reason: str | None = None
    error: str = ""

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


class Run:
    def __init__(self, job: Job, loop: EngineLoop, model_name: str, prompt_tokens: list[list[Token]] | None = None):
        self.job, self.loop, self.model_name = job, loop, model_name
        self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices = [Choice(p * job.n + c, ids) for p, ids in enumerate(job.prompts) for c in range(job.n)]
        self.prompt_scores = prompt_tokens  # echo: each prompt's tokens with their logprobs
        self.items: asyncio.Queue = asyncio.Queue()
        self.holdback = max((len(s) for s in job.stop), default=1) - 1  # a stop string may be arriving

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def start(self) -> None:
        """Hand every choice to the engine; a refusal (too long for the model, say) aborts the others and is a 400."""
        if self.job.max_tokens == 0:  # the prompt scored, nothing generated
            for choice in self.choices:
                choice.finish_reason = "length"
            return
        aio = asyncio.get_running_loop()
        futures = []
        for choice in self.choices:
            def sink(item, index=choice.index):
                aio.call_soon_threadsafe(self.items.put_nowait, (index, item))
            futures.append(self.loop.add(choice.prompt_ids, self.job.params(choice.index % self.job.n), sink,
                                         self.job.logprobs))
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        refused = next((r for r in results if isinstance(r, Exception)), None)
        for choice, result in zip(self.choices, results):
            if not isinstance(result, Exception):
                choice.request_id = result
        if refused is not None:
            self.abort()
            raise APIError(400, str(refused), "prompt" if self.job.kind == "completion" else "messages")

    def abort(self) -> None:
        """End every unfinished choice (a disconnect, a timeout, a refusal): the engine frees them before its next
        step."""
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                if choice.request_id is not None:
                    self.loop.abort(choice.request_id)

    async def next_item(self, timeout: float) -> bool:
        """Take one item off the queue into its choice; False when none came within `timeout` seconds."""
        try:
            index, item = await asyncio.wait_for(self.items.get(), timeout)
        except asyncio.TimeoutError:
            return False
        self.consume(self.choices[index], item)
        return True

    def consume(self, choice: Choice, item) -> None:
        if choice.finish_reason is not None:  # ended here already (a stop string): the engine's late news
            return
        if isinstance(item, Finished):
            choice.finish_reason, choice.error = item.reason, item.error
            choice.text = TOKENIZER.decode(choice.token_ids)  # the whole text now, a broken last character included
            return
        choice.tokens.append(item)
        text = complete_text(choice.token_ids)
        cut = min((i for i in (text.find(s) for s in self.job.stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it and the engine request ends now
            choice.text, choice.finish_reason = text[:cut], "stop"
            self.loop.abort(choice.request_id)
        else:
            choice.text = text

    def delta(self, choice: Choice) -> tuple[str, list[Token]]:
        """Text not yet streamed, less what could still turn out to be the start of a stop string, and the tokens
        not yet streamed."""
        end = len(choice.text) if choice.finish_reason is not None else max(choice.sent,
                                                                             len(choice.text) - self.holdback)
        piece, choice.sent = choice.text[choice.sent:end], end
        tokens, choice.tokens_sent = choice.tokens[choice.tokens_sent:], len(choice.tokens)
        return piece, tokens

    # ---- the response ------------------------------------------------------------------------------

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in self.job.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def head(self, chunk: bool) -> dict:
        kind = {("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk",
                ("completion", False): "text_completion", ("completion", True): "text_completion"}
        return {"id": self.id, "object": kind[self.job.kind, chunk], "created": self.created, "model": self.model_name}

    def response(self) -> dict:
        choices = []
        for choice in self.choices:
            prompt = self.job.prompts[choice.index // self.job.n]
            if self.job.kind == "chat":
                entry = {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                         "logprobs": self.chat_logprobs(choice.tokens), "finish_reason": choice.finish_reason}
            else:
                text = (complete_text(prompt) if self.job.echo else "") + choice.text
                entry = {"index": choice.index, "text": text, "logprobs": self.completion_logprobs(choice),
                         "finish_reason": choice.finish_reason}
            if self.job.return_token_ids:
                entry.update(token_ids=choice.token_ids, prompt_token_ids=prompt)
            choices.append(entry)
        return {**self.head(False), "choices": choices, "usage": self.usage()}

    def chunk(self, choice: Choice, text: str, tokens: list[Token], finish: str | None) -> dict:
        if self.job.kind == "chat":
            entry = {"index": choice.index, "delta": {"content": text} if text else {},
                     "logprobs": self.chat_logprobs(tokens), "finish_reason": finish}
        else:
            entry = {"index": choice.index, "text": text, "logprobs": self.completion_logprobs(choice, tokens),
                     "finish_reason": finish}
        if self.job.return_token_ids:
            entry["token_ids"] = [t.token_id for t in tokens]
        return {**self.head(True), "choices": [entry]}

    def completion_logprobs(self, choice: Choice, tokens: list[Token] | None = None) -> dict | None:
        if self.job.logprobs is None:
            return None
        if tokens is None:
            tokens = choice.tokens
            if self.job.echo:
                tokens = self.prompt_scores[choice.index // self.job.n] + tokens
        offsets, text = [], ""
        for token in tokens:
            offsets.append(len(text))
            text += token_text(token.token_id)
        return {"tokens": [token_text(t.token_id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None else
                                 {token_text(i): lp for i, lp in ((t.token_id, t.logprob), *t.top)} for t in tokens],
                "text_offset": offsets}

    def chat_logprobs(self, tokens: list[Token]) -> dict | None:
        if self.job.logprobs is None:
            return None
        return {"content": [{"token": token_text(t.token_id), "logprob": t.logprob, "bytes": token_bytes(t.token_id),
                             "top_logprobs": [{"token": token_text(i), "logprob": lp, "bytes": token_bytes(i)}
                                              for i, lp in t.top]} for t in tokens]}
