"""What the HTTP adapter asks of a generator, and the router-backed generator.

The HTTP side sees a generation as an async iterator of `Token`s ending with one
`Finished`, or raising a `kvrs.errors` exception; `RouterGenerator` produces exactly
that from `RouterService.Generate`, so completions go through the router's whole path
(prefill, placement, KV transfer, decode, recovery from a lost decode instance, which
the client never sees).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

import grpc
from opentelemetry.sdk.trace import TracerProvider

from kvrs.errors import KvrsError
from kvrs.rpc import error_from_rpc
from kvrs.sampling import Sampling
from kvrs.v1 import router_pb2, router_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.common.core_pb import sampling_to_pb
from services.common.openai_protocol import RequestAborted

FINISH_ABORT = "abort"


@dataclass(frozen=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    timeout_s: float
    """The completion's deadline, from now."""
    ttft_slo_s: float = 0.0
    decode_instance_id: str = ""
    """Decode instance the router places the request on first; empty = its choice."""
    sampling: Sampling = Sampling()
    """How tokens are drawn (seed 0: the router derives one from request_id)."""


@dataclass(frozen=True)
class Token:
    index: int
    token_id: int


@dataclass(frozen=True)
class Finished:
    finish_reason: str
    """OpenAI's: "length" (max_tokens reached) or "stop"."""
    prompt_tokens: int
    generated_tokens: int
    decode_instance_id: str = ""
    """Where decoding ended (after any recovery); empty when unknown."""


class Generator(Protocol):
    def generate(self, call: GenerateCall) -> AsyncGenerator[Token | Finished, None]:
        """Tokens in order, then one `Finished`; a `KvrsError` when the request fails."""
        ...


class RouterGenerator:
    """Generations served by `RouterService.Generate` at `address`."""

    def __init__(
        self, address: str, settings: GrpcSettings, provider: TracerProvider | None = None
    ) -> None:
        self.address = address
        self._channel = open_channel(address, settings, provider)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, call: GenerateCall) -> AsyncGenerator[Token | Finished, None]:
        request = router_pb2.GenerateRequest(
            request_id=call.request_id,
            prompt_token_ids=list(call.prompt_token_ids),
            max_new_tokens=call.max_new_tokens,
            ttft_slo_s=call.ttft_slo_s,
            deadline_unix_ms=int((time.time() + call.timeout_s) * 1000),
            decode_instance_id=call.decode_instance_id,
            sampling=sampling_to_pb(call.sampling),
        )
        stream = self._stub.Generate(request, timeout=call.timeout_s)
        received = 0
        aborted: router_pb2.GenerateSummary | None = None
        try:
            async for message in stream:
                summary = message.summary if message.HasField("summary") else None
                # The last token's message carries the summary; an ABORT summary may come
                # without a token of its own (then generated_tokens == tokens received).
                if summary is None or received < summary.generated_tokens:
                    if message.index != received:
                        raise KvrsError(
                            f"router sent token #{message.index} after "
                            f"{received} tokens (from {self.address})"
                        )
                    received += 1
                    yield Token(message.index, message.token_id)
                if summary is None:
                    continue
                if summary.finish_reason == FINISH_ABORT:
                    aborted = summary
                    continue
                yield Finished(
                    "length",
                    summary.prompt_tokens,
                    summary.generated_tokens,
                    summary.final_decode_instance_id,
                )
                return
        except grpc.aio.AioRpcError as exc:
            if aborted is not None:
                raise _aborted(aborted) from exc
            raise error_from_rpc(exc, self.address) from exc
        finally:
            stream.cancel()
        if aborted is not None:
            raise _aborted(aborted)
        raise KvrsError(
            f"router ended request {call.request_id} without a summary (from {self.address})"
        )


def _aborted(summary: router_pb2.GenerateSummary) -> RequestAborted:
    """Says what was lost and why its last recovery gave up (the abort decision's reason
    or the failed attempt's error)."""
    head = f"request {summary.request_id} was aborted after {summary.generated_tokens} tokens"
    if not summary.recoveries:
        return RequestAborted(head)
    last = summary.recoveries[-1]
    why = last.error or "no recovery could finish before the deadline"
    return RequestAborted(
        f"{head}: decode instance {last.failed_instance_id} was lost "
        f"({last.detected_by}: {last.lost_reason}); {why}"
    )
