"""OpenAI's completions API as plain data: request parsing, response and chunk bodies, errors.

Nothing here touches HTTP or gRPC, so the HTTP adapter and the endpoint picker (which
reads the same request bodies on their way through a gateway) share one parser, and
the translation is tested without a server.

What kvrs serves: `POST /v1/completions` with `prompt` as text, a list of texts, token
ids or a list of token-id lists; `max_tokens`; `stream` (with `stream_options.
include_usage`); sampling with `temperature` (0 to 2; absent = 0, greedy, so that a
request without it is reproducible), `top_p`, `top_k` (vLLM's extension; -1 or 0 =
off) and `seed` (without one, the draws derive from the request id); `stop` (up to four
strings: the text ends before the first one, `finish_reason: "stop"`). Options that
would change the output and that kvrs does not implement (`n` > 1, `best_of` > 1,
`echo`, `logprobs`, `suffix`, penalties, `logit_bias`) are rejected naming the
parameter rather than silently ignored. `user` is accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvrs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvrsError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvrs.sampling import MAX_TOP_K, Sampling
from services.common.tokenizer import TextCodec, byte_level_codec

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "CompletionRequest",
    "RequestAborted",
    "Usage",
    "check_model_and_fields",
    "chunk_body",
    "completion_body",
    "error_body",
    "generation_options",
    "http_error",
    "json_bytes",
    "models_body",
    "parse_completion_request",
    "prompt_token_ids",
    "usage_chunk_body",
]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for `max_tokens` on the completions API."""

FINISH_REASONS = ("stop", "length")

_UNSUPPORTED_IF_SET: dict[str, str] = {
    "echo": "echoing the prompt is not supported",
    "logprobs": "log probabilities are not returned",
    "suffix": "suffixes are not supported",
    "logit_bias": "logit bias is not supported",
}
_ZERO_OR_ABSENT = ("presence_penalty", "frequency_penalty")
_KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "n",
        "best_of",
        "seed",
        "top_k",
        "stop",
        "user",
        *_UNSUPPORTED_IF_SET,
        *_ZERO_OR_ABSENT,
    }
)
MAX_STOP_SEQUENCES = 4
"""OpenAI's limit on `stop`."""
MAX_TEMPERATURE = 2.0
"""OpenAI's range for `temperature` is [0, 2]."""


class RequestAborted(Unavailable):
    """The router's recovery gave the request up: no option could meet its deadline."""


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completions request: one or more prompts as token ids."""

    model: str
    prompts: tuple[tuple[int, ...], ...]
    """Token ids of every prompt, in the order of the request's `prompt` list."""
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    """Streaming only: a last chunk carries the usage (`stream_options.include_usage`)."""
    sampling: Sampling = Sampling()
    """How tokens are drawn; seed 0 = derived from the request id downstream."""
    stop: tuple[str, ...] = ()
    """Stop sequences: a choice's text ends before the first of them."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_token_ids(
    prompt: Any, field: str = "prompt", codec: TextCodec | None = None
) -> list[list[int]]:
    """Every prompt of an OpenAI `prompt` value as token ids (texts cut by the model's
    tokenizer, `codec`; default the byte-level one).

    Accepts a string, a list of strings, a list of token ids or a list of token-id lists;
    InvalidArgument naming `field` (and the position) otherwise.
    """
    codec = codec or byte_level_codec()
    if isinstance(prompt, str):
        return [codec.encode(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidArgument(
            field, "must be a string, a list of strings, a list of token ids or a list of lists"
        )
    if all(_is_int(item) for item in prompt):
        codec.validate(prompt, field)
        return [list(prompt)]
    prompts = []
    for index, item in enumerate(prompt):
        where = f"{field}[{index}]"
        if isinstance(item, str):
            prompts.append(codec.encode(item))
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            codec.validate(item, where)
            prompts.append(list(item))
        else:
            raise InvalidArgument(where, "must be a string or a non-empty list of token ids")
    return prompts


def parse_completion_request(
    body: Any,
    served_model: str,
    max_tokens_limit: int,
    codec: TextCodec | None = None,
    aliases: Sequence[str] = (),
) -> CompletionRequest:
    """The request in `body` (decoded JSON), or InvalidArgument / NotFound naming the field.

    Text prompts are cut by `codec` (the served model's tokenizer); `aliases` are other
    names of the served model a request may use (its checkpoint path)."""
    model = check_model_and_fields(body, served_model, _KNOWN_FIELDS, "/v1/completions", aliases)
    if "prompt" not in body:
        raise InvalidArgument("prompt", "is required")
    prompts = prompt_token_ids(body["prompt"], codec=codec)
    if any(not prompt for prompt in prompts):
        raise InvalidArgument("prompt", "must not be empty")
    max_tokens = body.get("max_tokens")
    return CompletionRequest(
        model,
        tuple(tuple(prompt) for prompt in prompts),
        *generation_options(
            body,
            "max_tokens",
            DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            max_tokens_limit,
            _UNSUPPORTED_IF_SET,
        ),
    )


def check_model_and_fields(
    body: Any,
    served_model: str,
    known: frozenset[str],
    endpoint: str,
    aliases: Sequence[str] = (),
) -> str:
    """The served model `body` names (by its name or an alias; answered by its name);
    InvalidArgument for an unknown field, NotFound for another model."""
    if not isinstance(body, Mapping):
        raise InvalidArgument("body", "must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidArgument(unknown[0], f"is not a parameter of {endpoint}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model", "is required (see GET /v1/models)")
    if model != served_model and model not in aliases:
        raise NotFound(
            f"model {model!r} is not served here; this server serves {served_model!r}",
            field="model",
        )
    return served_model


def generation_options(
    body: Mapping[str, Any],
    max_tokens_field: str,
    max_tokens: Any,
    max_tokens_limit: int,
    unsupported: Mapping[str, str],
) -> tuple[int, bool, bool, Sampling, tuple[str, ...]]:
    """(max tokens, stream, include usage, sampling, stop sequences) of a request, after
    refusing every option kvrs cannot honour (`unsupported`: parameter -> why, when set)."""
    if not _is_int(max_tokens) or not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidArgument(
            max_tokens_field, f"must be an integer in [1, {max_tokens_limit}], got {max_tokens!r}"
        )
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise InvalidArgument("stream", f"must be a boolean, got {stream!r}")
    include_usage = _include_usage(body.get("stream_options"), stream)
    sampling = _sampling(body)
    stop = _stop(body.get("stop"))
    for name, reason in unsupported.items():
        if body.get(name) not in (None, False, "", [], {}):
            raise InvalidArgument(name, reason)
    for name in _ZERO_OR_ABSENT:
        if body.get(name) not in (None, 0, 0.0):
            raise InvalidArgument(name, "only 0 is supported")
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise InvalidArgument(name, "only 1 is supported (one choice per prompt)")
    return max_tokens, stream, include_usage, sampling, stop


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise InvalidArgument("stream_options", "is only allowed with stream: true")
    if not isinstance(options, Mapping):
        raise InvalidArgument("stream_options", "must be an object")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise InvalidArgument("stream_options.include_usage", "must be a boolean")
    return value


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InvalidArgument(name, f"must be a number, got {value!r}")
    return float(value)


def _sampling(body: Mapping[str, Any]) -> Sampling:
    temperature = _number(body, "temperature", 0.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidArgument("temperature", f"must be in [0, 2], got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    if not _is_int(top_k) or not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgument("top_k", f"must be -1 (off) or an integer in [0, {MAX_TOP_K}]")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise InvalidArgument("seed", f"must be an integer, got {seed!r}")
    # Any integer names a 64-bit seed; 0 and none derive it from the request id.
    return Sampling(temperature, top_p, top_k, (seed or 0) % (1 << 64))


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    sequences = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(sequences, list)
        or len(sequences) > MAX_STOP_SEQUENCES
        or not all(isinstance(item, str) and item for item in sequences)
    ):
        raise InvalidArgument(
            "stop", f"must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} of them"
        )
    return tuple(sequences)


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def _choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def completion_body(
    request_id: str,
    model: str,
    texts: Sequence[str],
    finish_reasons: Sequence[str],
    usage: Usage,
    created_unix_s: int | None = None,
) -> dict[str, Any]:
    """The JSON of a non-streamed completion: one choice per prompt."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()) if created_unix_s is None else created_unix_s,
        "model": model,
        "choices": [
            _choice(index, text, reason)
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
) -> dict[str, Any]:
    """One streamed chunk: text of prompt `index`; `finish_reason` set on its last chunk."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created_unix_s,
        "model": model,
        "choices": [_choice(index, text, finish_reason)],
    }


def usage_chunk_body(
    request_id: str,
    model: str,
    usage: Usage,
    created_unix_s: int,
    object_name: str = "text_completion",
) -> dict[str, Any]:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return {
        "id": request_id,
        "object": object_name,
        "created": created_unix_s,
        "model": model,
        "choices": [],
        "usage": usage.as_dict(),
    }


def models_body(model: str, created_unix_s: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created_unix_s, "owned_by": "kvrs"}],
    }


def error_body(
    message: str, error_type: str, param: str | None, code: str | None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


_HTTP_BY_ERROR: tuple[tuple[type[KvrsError], int, str], ...] = (
    (InvalidArgument, 400, "invalid_request_error"),
    (NotFound, 404, "not_found_error"),
    (ResourceExhausted, 429, "rate_limit_error"),
    (FailedPrecondition, 503, "service_unavailable_error"),
    (Unavailable, 503, "service_unavailable_error"),
    (DeadlineExceeded, 504, "timeout_error"),
)


def http_error(exc: KvrsError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body a kvrs error stands for.

    Bad input 400 (naming the parameter), unknown model 404, no capacity 429 (the
    client may retry later), no instance able to serve, a peer down or a request the
    recovery aborted 503, deadline 504; anything else 500.
    """
    status, error_type = next(
        ((status, name) for cls, status, name in _HTTP_BY_ERROR if isinstance(exc, cls)),
        (500, "server_error"),
    )
    code = "request_aborted" if isinstance(exc, RequestAborted) else exc.code.lower()
    return status, error_body(str(exc) or error_type, error_type, exc.field or None, code)


def json_bytes(body: Any) -> bytes:
    """Compact JSON, as sent on the wire."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
