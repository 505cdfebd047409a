"""OpenAI's chat completions API on the completions path: a conversation becomes one prompt.

The conversation is rendered with the checkpoint's own chat template where it has one
(`services.common.chat_template`: each message's role and its text), and encoded
without the tokenizer's added special tokens, as `transformers`' `apply_chat_template`
does. Without one (the embedded default, a cost-model preset) `render` writes every
message as `<|role|>`, a newline, its text and a newline, then opens the reply with
`<|assistant|>` and a newline. The endpoint picker renders request bodies the same way
(`prompt_ids`), so the prefix blocks it hashes for placement are the blocks the prefill
worker caches.

Served: `messages` (roles system, developer, user, assistant; content a string or a
list of text parts), `max_completion_tokens` (or the older `max_tokens`; default: the
server's limit), `stream` with `stream_options.include_usage`, sampling and stop
sequences as on the completions path. Tools, structured output and log probabilities
are refused naming the parameter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvrs.errors import InvalidArgument
from services.common.openai_protocol import (
    CompletionRequest,
    Usage,
    check_model_and_fields,
    generation_options,
)
from services.common.tokenizer import TextCodec, byte_level_codec

ROLES = ("system", "developer", "user", "assistant")
ENDPOINT = "/v1/chat/completions"

_UNSUPPORTED_IF_SET: dict[str, str] = {
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "logit_bias": "logit bias is not supported",
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "parallel_tool_calls": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "response_format": "structured output is not supported",
}
_KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "n",
        "seed",
        "top_k",
        "stop",
        "user",
        "presence_penalty",
        "frequency_penalty",
        *_UNSUPPORTED_IF_SET,
    }
)


def turns(messages: Any, field: str = "messages") -> list[dict[str, str]]:
    """The conversation as role and text content per message, or InvalidArgument naming
    the first field that is not one."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(field, "must be a non-empty list of messages")
    checked = []
    for index, message in enumerate(messages):
        where = f"{field}[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidArgument(where, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(
                f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}"
            )
        checked.append({"role": role, "content": _text(message.get("content"), f"{where}.content")})
    return checked


def render(messages: Any, field: str = "messages") -> str:
    """The prompt text of a conversation in the fixed template (the module docstring)."""
    parts = [f"<|{turn['role']}|>\n{turn['content']}\n" for turn in turns(messages, field)]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def prompt_ids(messages: Any, codec: TextCodec | None = None, field: str = "messages") -> list[int]:
    """The prompt of a conversation as the model sees it: its own chat template where
    `codec` has one, else the fixed one."""
    codec = codec or byte_level_codec()
    if codec.chat_template is None:
        return codec.encode(render(messages, field))
    text = codec.chat_template.render(turns(messages, field), field)
    return codec.encode(text, special_tokens=False)


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidArgument(f"{field}[{index}]", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(field, "must be a string or a non-empty list of text parts")


def parse_chat_request(
    body: Any,
    served_model: str,
    max_tokens_limit: int,
    codec: TextCodec | None = None,
    aliases: Sequence[str] = (),
) -> CompletionRequest:
    """The request in `body` (decoded JSON) as one prompt, or InvalidArgument / NotFound
    naming the field (`codec` and `aliases` as in protocol.parse_completion_request)."""
    model = check_model_and_fields(body, served_model, _KNOWN_FIELDS, ENDPOINT, aliases)
    if "messages" not in body:
        raise InvalidArgument("messages", "is required")
    prompt = prompt_ids(body["messages"], codec)
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(field)
    return CompletionRequest(
        model,
        (tuple(prompt),),
        *generation_options(
            body,
            field,
            max_tokens_limit if max_tokens is None else max_tokens,
            max_tokens_limit,
            _UNSUPPORTED_IF_SET,
        ),
    )


def completion_body(
    request_id: str,
    model: str,
    texts: list[str],
    finish_reasons: list[str],
    usage: Usage,
    created_unix_s: int | None = None,
) -> dict[str, Any]:
    """The JSON of a non-streamed chat completion (one choice)."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()) if created_unix_s is None else created_unix_s,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": reason,
            }
            for index, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
        ],
        "usage": usage.as_dict(),
    }


def chunk_body(
    request_id: str,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    created_unix_s: int,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk; the first of a choice also names the assistant role."""
    delta: dict[str, str] = {"role": "assistant"} if first else {}
    if text or not finish_reason:
        delta["content"] = text
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created_unix_s,
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        ],
    }
