"""The chat template for archzoo's byte-level models: the messages as plain text, each under its role's header, then
the assistant's header for the model to continue. With a byte tokenizer there are no special role tokens to learn,
so the template is text a model trained on chat transcripts would see:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

(each message's content followed by a newline; the last line is the open assistant header).
"""
CHAT_ROLES = ("system", "user", "assistant")


def render_chat(messages: list[dict]) -> str:
    """messages: [{"role": one of CHAT_ROLES, "content": str}, ...], already checked."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
