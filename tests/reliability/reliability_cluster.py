"""A `kvrs up` cluster of real processes for one test module, and Generate streams over it.

The launcher's own services with extra environment per service (a short heartbeat TTL, a
batching window), started once per module on the module's Redis prefix; `Stream` keeps
what one Generate returned and compares it with the same model run in this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvrs.cli.launcher import SERVICES, ClusterOptions, start_cluster, stop_cluster
from kvrs.cli.launcher.services import ServiceSpec
from kvrs.cli.launcher.state import ClusterState
from kvrs.rpc.generate import generate_into
from kvrs.v1 import router_pb2
from tests.tiny_reference import reference


def _with_env(spec: ServiceSpec, extra: Mapping[str, str]) -> ServiceSpec:
    if not extra:
        return spec
    base = spec.env
    return dataclasses.replace(spec, env=lambda wiring: {**base(wiring), **extra})


@contextlib.contextmanager
def launched(
    run_dir: Path,
    redis_url: str,
    redis_prefix: str,
    names: Sequence[str],
    extra_env: Mapping[str, Mapping[str, str]],
) -> Iterator[ClusterState]:
    """The launcher's services called `names` (tiny workers), each with its `extra_env`."""
    options = ClusterOptions(
        run_dir=run_dir,
        workers_model="tiny",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        startup_timeout_s=120,
    )
    services = tuple(_with_env(s, extra_env.get(s.name, {})) for s in SERVICES if s.name in names)
    state = start_cluster(options, services)
    try:
        yield state
    finally:
        stop_cluster(options.run_dir, grace_s=5.0)


@dataclasses.dataclass
class Stream:
    """One Generate call: its tokens, its summary, or the error that ended it."""

    request: router_pb2.GenerateRequest
    tokens: list[int] = dataclasses.field(default_factory=list)
    summary: router_pb2.GenerateSummary | None = None
    error: str = ""

    @property
    def exact(self) -> bool:
        prompt = tuple(self.request.prompt_token_ids)
        return self.tokens == reference(prompt, self.request.max_new_tokens)

    def describe(self) -> str:
        summary = self.summary or router_pb2.GenerateSummary()
        recoveries = [(r.failed_instance_id, r.detected_by) for r in summary.recoveries]
        return (
            f"{self.request.request_id}: {len(self.tokens)} tokens, exact={self.exact}, "
            f"placed on {summary.decode_instance_id!r}, recoveries={recoveries}, "
            f"error={self.error!r}"
        )


async def run(stub, stream: Stream) -> Stream:
    """Stream `stream.request` through the router's Generate to its end or its error."""
    stream.summary, error = await generate_into(stub, stream.request, stream.tokens, 120)
    if error is not None:
        stream.error = f"{error.code().name}: {error.details()}"
    return stream
