"""One endpoint pick: the request's prompt, the gateway's subset, the scheduler's choice.

The picker restricts the candidates to the decode instances behind the endpoints the
gateway may use (all known ones, or those of its subset hint), asks the kvrs scheduler's
`SelectDecode` to place the request among exactly those, and maps the chosen instance
back to its `ip:port`. The scheduler decides with the network-aware cost model (KV
transfer from the prefill instance, queued work, resident prefix blocks); the picker
only translates between the gateway's view and kvrs'. No gRPC here: the scheduler and
gossip are reached through `kvrs.client.KvrsClient` (or anything with its methods).

Outcomes (`kvrs.epp.outcome`): `picked`; `no_endpoint` (the subset names no known decode
endpoint, or none is registered: HTTP 503); `no_capacity` (no instance has KV memory
left: 429); `unavailable` (scheduler, gossip or every prefill instance down: 503);
`error` (a misconfiguration such as an unknown policy: 500).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from kvrs import tokenizer
from kvrs.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvrsError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvrs.prefill import PrefillOption
from kvrs.profile import ComputeProfile
from kvrs.v1 import scheduler_pb2
from services.common import openai_chat as chat
from services.common.metrics import Metrics
from services.common.openai_protocol import prompt_token_ids
from services.common.tokenizer import TextCodec
from services.epp.endpoints import EndpointDirectory, Endpoints

DECISION = "epp_pick"
"""The `decision` label of the picker's metrics."""


class Scheduler(Protocol):
    """The scheduler as the picker calls it (`kvrs.client.KvrsClient` is one)."""

    async def select_decode(
        self,
        prefill_instance_id: str,
        prompt_tokens: int,
        *,
        prefix_hashes: Iterable[int] = (),
        policy: str = "",
        candidate_instance_ids: Iterable[str] = (),
        request_id: str = "",
        prefill_options: Iterable[PrefillOption] = (),
    ) -> scheduler_pb2.SelectDecodeResponse: ...


class NoEligibleEndpoint(Unavailable):
    """No endpoint the gateway may use maps to an alive decode instance."""


@dataclass(frozen=True)
class PromptInfo:
    prompt_tokens: int
    prefix_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PickRequest:
    request_id: str
    prompt: PromptInfo
    subset: tuple[str, ...] | None = None
    """The gateway's subset hint; None when it sent none (every endpoint is eligible)."""


@dataclass(frozen=True)
class Pick:
    endpoint: str
    """`ip:port` the gateway sends the request to."""
    instance_id: str
    prefill_instance_id: str
    predicted_ttft_s: float
    fallbacks: tuple[str, ...] = ()
    """Endpoints to try, in order, when `endpoint` cannot take the request."""
    prefill_endpoint: str = ""
    """`ip:port` of the prefill instance, for the gateway's P/D sidecar; "" when the
    picker names none (no `Picker.prefiller_header`)."""

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The pick, then its fallbacks: the protocol's ordered endpoint list."""
        return (self.endpoint, *self.fallbacks)

    def rank_of(self, served: str) -> str:
        """Which of the picked endpoints served the request: primary, fallback, or
        unlisted (the gateway went elsewhere)."""
        if served == self.endpoint:
            return "primary"
        return "fallback" if served in self.fallbacks else "unlisted"


def new_request_id() -> str:
    return uuid.uuid4().hex


def prompt_info(body: bytes, block_tokens: int, codec: TextCodec | None = None) -> PromptInfo:
    """Prompt length and prefix-block hashes of an OpenAI request body.

    `/v1/completions` bodies carry `prompt` (a batch counts every prompt's tokens, the
    first one's blocks are hashed); chat bodies carry `messages`, rendered into the prompt
    the HTTP adapter will prefill (`chat.render`). A body with neither places by load
    alone (0 tokens). A body that is not JSON, or a malformed prompt, is InvalidArgument.
    Texts are cut by `codec`, the served model's tokenizer (default: the byte-level one).
    """
    if not body.strip():
        return PromptInfo(0)
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument("body", f"is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidArgument("body", "must be a JSON object")
    if "prompt" in request:
        prompts = prompt_token_ids(request["prompt"], codec=codec)
    elif "messages" in request:
        prompts = [chat.prompt_ids(request["messages"], codec)]
    else:
        return PromptInfo(0)
    return PromptInfo(
        prompt_tokens=sum(len(prompt) for prompt in prompts),
        prefix_hashes=tuple(tokenizer.prefix_block_hashes(prompts[0], block_tokens)),
    )


def outcome_of(exc: KvrsError) -> str:
    if isinstance(exc, NoEligibleEndpoint):
        return "no_endpoint"
    if isinstance(exc, ResourceExhausted):
        return "no_capacity"
    if isinstance(exc, Unavailable):
        return "unavailable"
    return "error"


class Picker:
    """Picks the endpoint of each request; one per process, shared by every stream."""

    def __init__(
        self,
        directory: EndpointDirectory,
        scheduler: Scheduler,
        tracer: Tracer,
        *,
        profile: ComputeProfile,
        block_tokens: int,
        prefill_instance_id: str = "",
        policy: str = "",
        fallback_endpoints: int = 0,
        prefiller_header: str = "",
        metrics: Metrics | None = None,
    ) -> None:
        """`profile` prices prefill when choosing the prefill instance (as the router
        does); `block_tokens` is the prefix-hash block of the served model. With
        `prefiller_header` each pick names where the prompt prefills in that header
        (`Pick.prefill_endpoint`, for a P/D sidecar), and a policy that chooses prefill
        and decode together may choose it among every alive prefill instance."""
        self.directory = directory
        self.scheduler = scheduler
        self.tracer = tracer
        self.profile = profile
        self.block_tokens = block_tokens
        self.prefill_instance_id = prefill_instance_id
        self.policy = policy
        self.fallback_endpoints = fallback_endpoints
        self.prefiller_header = prefiller_header
        self.metrics = metrics

    async def pick(self, request: PickRequest, context: Context | None = None) -> Pick:
        """The endpoint for `request`; a KvrsError whose kind says which HTTP status the
        gateway answers instead (see the module doc). `context` parents the span."""
        started_s = time.perf_counter()
        with self.tracer.start_as_current_span("kvrs.epp.pick", context=context) as span:
            span.set_attributes(
                {
                    "kvrs.request_id": request.request_id,
                    "kvrs.prompt_tokens": request.prompt.prompt_tokens,
                    "kvrs.prefix_blocks": len(request.prompt.prefix_hashes),
                    "kvrs.epp.subset_size": -1 if request.subset is None else len(request.subset),
                }
            )
            try:
                pick = await self._pick(request, span)
            except KvrsError as exc:
                outcome = outcome_of(exc)
                span.set_attribute("kvrs.epp.outcome", outcome)
                self._record(outcome, started_s)
                raise
            span.set_attribute("kvrs.epp.outcome", "picked")
            self._record("picked", started_s)
            return pick

    async def _pick(self, request: PickRequest, span: Any) -> Pick:
        endpoints = await self.directory.current()
        known = endpoints.instance_by_endpoint
        if request.subset is None:
            eligible = dict(known)
        else:
            eligible = {e: known[e] for e in (s.strip() for s in request.subset) if e in known}
        span.set_attributes(
            {
                "kvrs.epp.endpoints_known": len(known),
                "kvrs.epp.endpoints_eligible": len(eligible),
            }
        )
        if not eligible:
            if request.subset is None:
                raise NoEligibleEndpoint("no decode instance is registered in gossip")
            raise NoEligibleEndpoint(
                f"none of the {len(request.subset)} endpoints of the subset hint "
                f"({', '.join(request.subset[:4])}{', ...' if len(request.subset) > 4 else ''})"
                f" is an alive decode instance ({len(known)} known)"
            )
        options: tuple[PrefillOption, ...] = ()
        if self.prefill_instance_id:
            prefill_id = self.prefill_instance_id
        else:
            choice = endpoints.choose_prefill(
                request.prompt.prompt_tokens,
                request.prompt.prefix_hashes,
                self.block_tokens,
                self.profile,
            )
            prefill_id = choice.instance_id if choice is not None else ""
            # The scheduler may move the prompt only where the sidecar will be told to
            # prefill it.
            if choice is not None and self.prefiller_header and len(choice.options) > 1:
                options = choice.options
        span.set_attributes(
            {
                "kvrs.prefill_instance_id": prefill_id,
                "kvrs.epp.prefill_source": "configured"
                if self.prefill_instance_id
                else "least_loaded",
            }
        )
        if not prefill_id:
            raise Unavailable(
                "no alive prefill instance to score placements from "
                "(set EPP_PREFILL_INSTANCE or start one)"
            )
        try:
            reply = await self.scheduler.select_decode(
                prefill_id,
                request.prompt.prompt_tokens,
                prefix_hashes=request.prompt.prefix_hashes,
                policy=self.policy,
                candidate_instance_ids=sorted(eligible.values()),
                request_id=request.request_id,
                prefill_options=options,
            )
        except (NotFound, FailedPrecondition) as exc:
            # The scheduler's view lags or lacks what gossip just listed: for the
            # client, nothing can serve the request right now.
            raise Unavailable(f"scheduler: {exc}") from exc
        except InvalidArgument as exc:
            raise KvrsError(
                f"scheduler rejected the placement request ({exc}); "
                "check EPP_POLICY and EPP_PREFILL_INSTANCE"
            ) from exc
        endpoint = endpoints.endpoint_by_instance.get(reply.decode_instance_id, "")
        span.set_attributes(
            {
                "kvrs.chosen_instance_id": reply.decode_instance_id,
                "kvrs.epp.endpoint": endpoint,
                "kvrs.policy": reply.policy,
                "kvrs.predicted_ttft_s": reply.predicted_ttft_s,
                "kvrs.prefix_hit_tokens": reply.prefix_hit_tokens,
                "kvrs.runner_up.instance_id": reply.runner_up_instance_id,
                "kvrs.view_stale": reply.view_stale,
                "kvrs.view_age_s": reply.view_age_s,
            }
        )
        if endpoint not in eligible:
            raise Unavailable(
                f"scheduler chose {reply.decode_instance_id!r}, which is not an eligible endpoint"
            )
        prefill_id = reply.prefill_instance_id or prefill_id
        prefill_endpoint = ""
        if self.prefiller_header:
            prefill_endpoint = endpoints.prefill_endpoint(prefill_id)
            if not prefill_endpoint:
                raise Unavailable(f"prefill instance {prefill_id!r} has no reachable address")
            span.set_attributes(
                {
                    "kvrs.prefill_instance_id": prefill_id,
                    "kvrs.epp.prefill_endpoint": prefill_endpoint,
                }
            )
        fallbacks = self._fallbacks(endpoint, reply.runner_up_instance_id, endpoints, eligible)
        span.set_attribute("kvrs.epp.fallbacks", ",".join(fallbacks))
        return Pick(
            endpoint=endpoint,
            instance_id=reply.decode_instance_id,
            prefill_instance_id=prefill_id,
            predicted_ttft_s=reply.predicted_ttft_s,
            fallbacks=fallbacks,
            prefill_endpoint=prefill_endpoint,
        )

    def _fallbacks(
        self, chosen: str, runner_up_id: str, endpoints: Endpoints, eligible: dict[str, str]
    ) -> tuple[str, ...]:
        """Up to `fallback_endpoints` other eligible endpoints: the scheduler's runner-up
        first (its second best), then the rest in address order (the scheduler ranks
        only two)."""
        if self.fallback_endpoints == 0:
            return ()
        runner_up = endpoints.endpoint_by_instance.get(runner_up_id, "")
        ordered = [runner_up] if runner_up in eligible else []
        ordered += sorted(e for e in eligible if e not in (runner_up, chosen))
        return tuple(e for e in ordered if e != chosen)[: self.fallback_endpoints]

    def served(self, pick: Pick, served: str, context: Context | None = None) -> str:
        """Records which endpoint the gateway reports served the request picked as
        `pick` (`x-gateway-destination-endpoint-served`); returns its rank."""
        rank = pick.rank_of(served)
        with self.tracer.start_as_current_span("kvrs.epp.served", context=context) as span:
            span.set_attributes(
                {
                    "kvrs.epp.endpoint": pick.endpoint,
                    "kvrs.epp.served_endpoint": served,
                    "kvrs.epp.served_rank": rank,
                }
            )
        if self.metrics is not None:
            self.metrics.epp_served.labels(rank=rank).inc()
        return rank

    def _record(self, outcome: str, started_s: float) -> None:
        if self.metrics is None:
            return
        self.metrics.decisions.labels(decision=DECISION, action=outcome).inc()
        self.metrics.decision_latency_s.labels(decision=DECISION).observe(
            time.perf_counter() - started_s
        )
