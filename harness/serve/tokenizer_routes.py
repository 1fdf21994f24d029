"""vLLM's tokenizer endpoints (GET /tokenizer_info, POST /tokenize, POST /detokenize), which lm-evaluation-harness's
"remote" tokenizer backend uses, so a client without the model's tokenizer (archzoo's is bytes) counts and aligns
tokens as the server does. Text is UTF-8 bytes, except the special tokens' names, which map to their ids as a
Hugging Face tokenizer maps its special tokens found in text."""
import re

from harness.serve.protocol import APIError, bad
from harness.serve.run import SPECIAL_NAMES
from zoo import ByteTokenizer

SPECIAL_IDS = {name: token_id for token_id, name in SPECIAL_NAMES.items()}
SPECIALS = re.compile("(" + "|".join(map(re.escape, SPECIAL_IDS)) + ")")


def encode(text: str, tokenizer: ByteTokenizer) -> list[int]:
    ids = []
    for piece in SPECIALS.split(text):
        ids += [SPECIAL_IDS[piece]] if piece in SPECIAL_IDS else tokenizer.encode(piece)
    return ids


def tokenizer_info(tokenizer: ByteTokenizer, max_model_len: int) -> dict:
    return {"tokenizer_class": "ByteTokenizer (UTF-8 bytes)", "bos_token": SPECIAL_NAMES[tokenizer.bos_id],
            "eos_token": SPECIAL_NAMES[tokenizer.eos_id], "pad_token": None, "model_max_length": max_model_len}


def tokenize(body: dict, tokenizer: ByteTokenizer, max_model_len: int) -> dict:
    text = body.get("prompt")
    if not isinstance(text, str):
        raise bad("prompt", f"must be a string, got {text!r:.80}")
    special = body.get("add_special_tokens", False)
    if not isinstance(special, bool):
        raise bad("add_special_tokens", f"must be true or false, got {special!r}")
    ids = ([tokenizer.bos_id] if special else []) + encode(text, tokenizer)
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}


def detokenize(body: dict, vocab_size: int) -> dict:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", f"must be a list of token ids, got {tokens!r:.80}")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise APIError(400, f"tokens: ids must be in [0, {vocab_size - 1}]", "tokens")
    data, text = bytearray(), []
    for t in tokens:  # bytes run together into text; a special id is its name
        if t < 256:
            data.append(t)
            continue
        text.append(data.decode("utf-8", errors="replace"))
        data = bytearray()
        text.append(SPECIAL_NAMES.get(t, f"<|{t}|>"))
    text.append(data.decode("utf-8", errors="replace"))
    return {"prompt": "".join(text)}
