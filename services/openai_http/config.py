"""Configuration of the OpenAI-compatible HTTP adapter, read from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrs.model import DEFAULT_MODEL, served_model_name
from services.common import ConfigError, GrpcSettings, env_float, env_int, env_str


@dataclass(frozen=True)
class Config:
    """Everything `python -m services.openai_http` needs; `from_env` names any bad variable."""

    listen_addr: str = "127.0.0.1:8000"
    """OPENAI_HTTP_LISTEN_ADDR: host:port the HTTP server binds; loopback unless told
    otherwise ("0.0.0.0:8000" in a container, "127.0.0.1:0" in tests)."""
    api_keys: tuple[str, ...] = ()
    """OPENAI_HTTP_API_KEY: keys a client must present as `Authorization: Bearer <key>` on
    every /v1/ route (comma-separated for several, as during a rotation); empty = open."""
    readiness_timeout_s: float = 1.0
    """OPENAI_HTTP_READINESS_TIMEOUT_S: how long GET /ready waits for the router's health."""
    router_addr: str = "127.0.0.1:50056"
    """ROUTER_ADDR: the router whose RouterService.Generate serves every completion."""
    model: str = DEFAULT_MODEL
    """OPENAI_HTTP_MODEL (default: KVRS_MODEL's name, a checkpoint directory's base name):
    the model id clients name in `model` and GET /v1/models lists."""
    checkpoint: str = DEFAULT_MODEL
    """KVRS_MODEL: the checkpoint directory (or embedded checkpoint) the workers run;
    prompts are cut with its tokenizer.json, and its path is accepted as `model` too."""
    max_tokens_limit: int = 4096
    """OPENAI_HTTP_MAX_TOKENS: the largest `max_tokens` a request may ask for."""
    request_timeout_s: float = 300.0
    """OPENAI_HTTP_REQUEST_TIMEOUT_S: a completion's deadline, passed to the router (its
    recovery aborts early when no option can finish in time); beyond it the client gets 504."""
    ttft_slo_s: float = 0.0
    """OPENAI_HTTP_TTFT_SLO_S: time-to-first-token objective reported by the router; 0 = none."""
    decode_instance_id: str = ""
    """OPENAI_HTTP_DECODE_INSTANCE: decode instance every completion is placed on first
    (one adapter per instance behind a gateway that picks it); empty = the router's choice."""
    metrics_addr: str = ""
    """KVRS_METRICS_ADDR: host:port of the Prometheus endpoint; empty = off."""
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    """TLS towards the router, message size and shutdown grace (KVRS_TLS_*, ...)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        checkpoint = env_str("KVRS_MODEL", DEFAULT_MODEL, env)
        config = cls(
            listen_addr=env_str("OPENAI_HTTP_LISTEN_ADDR", "127.0.0.1:8000", env),
            api_keys=tuple(
                key.strip()
                for key in env_str("OPENAI_HTTP_API_KEY", "", env).split(",")
                if key.strip()
            ),
            readiness_timeout_s=env_float("OPENAI_HTTP_READINESS_TIMEOUT_S", 1.0, env),
            router_addr=env_str("ROUTER_ADDR", "127.0.0.1:50056", env),
            model=env_str("OPENAI_HTTP_MODEL", "", env) or served_model_name(checkpoint),
            checkpoint=checkpoint,
            max_tokens_limit=env_int("OPENAI_HTTP_MAX_TOKENS", 4096, env),
            request_timeout_s=env_float("OPENAI_HTTP_REQUEST_TIMEOUT_S", 300.0, env),
            ttft_slo_s=env_float("OPENAI_HTTP_TTFT_SLO_S", 0.0, env),
            decode_instance_id=env_str("OPENAI_HTTP_DECODE_INSTANCE", "", env),
            metrics_addr=env_str("KVRS_METRICS_ADDR", "", env),
            grpc=GrpcSettings.from_env(env),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Fails fast, naming the variable, on a value the adapter cannot run with."""
        if self.max_tokens_limit < 1:
            raise ConfigError(f"OPENAI_HTTP_MAX_TOKENS must be >= 1, got {self.max_tokens_limit}")
        if not self.request_timeout_s > 0:
            raise ConfigError(
                f"OPENAI_HTTP_REQUEST_TIMEOUT_S must be > 0, got {self.request_timeout_s}"
            )
        if not self.readiness_timeout_s > 0:
            raise ConfigError(
                f"OPENAI_HTTP_READINESS_TIMEOUT_S must be > 0, got {self.readiness_timeout_s}"
            )
        if self.ttft_slo_s < 0:
            raise ConfigError(f"OPENAI_HTTP_TTFT_SLO_S must be >= 0, got {self.ttft_slo_s}")
        host, sep, port = self.listen_addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(
                f"OPENAI_HTTP_LISTEN_ADDR must be host:port, got {self.listen_addr!r}"
            )
