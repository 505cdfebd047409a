"""The cost oracle's answers: T_x, cost matrices and T_pf / T_ext from the shared core.

Prices come from the same `CostModel` the scheduler decides with, over the same cached
gossip view (`services.common.gossip_view`), so an oracle answer and a scheduler decision
made at the same moment agree. Before gossip first answers, transfers are priced from
the topology file alone (no telemetry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument, NotFound
from kvrs.network import NetworkModel, TransferEstimate
from kvrs.topology import Role
from services.common.gossip_view import ViewCache


@dataclass(frozen=True)
class ComputeEstimate:
    compute_s: float
    kv_bytes: int
    """KV of the whole cache after the computation (cached + new tokens)."""
    model: str


@dataclass(frozen=True)
class CostMatrix:
    prefill_ids: tuple[str, ...]
    decode_ids: tuple[str, ...]
    rows: tuple[tuple[TransferEstimate, ...], ...]
    """rows[i][j]: prefill_ids[i] -> decode_ids[j]."""


class CostOracle:
    """Answers the CostOracleService's questions (see the module docstring)."""

    def __init__(self, view: ViewCache, clock: Callable[[], float] = time.time) -> None:
        self.view = view
        self._clock = clock
        inputs = view.inputs
        self._static_cost = CostModel(
            inputs.model, inputs.compute, NetworkModel(inputs.topology, inputs.staleness)
        )

    def cost_model(self) -> CostModel:
        state = self.view.state
        return self._static_cost if state is None else state.cost

    def transfer(self, src_id: str, dst_id: str, kv_bytes: int, tokens: int) -> TransferEstimate:
        self._require_known("src_instance_id", src_id)
        self._require_known("dst_instance_id", dst_id)
        size = self._kv_bytes(kv_bytes, tokens)
        return self.cost_model().network.transfer(src_id, dst_id, size, self._clock())

    def matrix(
        self,
        prefill_ids: Sequence[str],
        decode_ids: Sequence[str],
        kv_bytes: int,
        tokens: int,
    ) -> CostMatrix:
        """Every prefill x decode transfer; empty id lists mean every alive instance."""
        size = self._kv_bytes(kv_bytes, tokens)
        prefill = self._ids("prefill_instance_ids", prefill_ids, Role.PREFILL)
        decode = self._ids("decode_instance_ids", decode_ids, Role.DECODE)
        network = self.cost_model().network
        now_s = self._clock()
        rows = tuple(tuple(network.transfer(p, d, size, now_s) for d in decode) for p in prefill)
        return CostMatrix(prefill_ids=prefill, decode_ids=decode, rows=rows)

    def compute(self, cached_tokens: int, new_tokens: int) -> ComputeEstimate:
        if cached_tokens < 0:
            raise InvalidArgument("cached_tokens", f"must be >= 0, got {cached_tokens}")
        if new_tokens <= 0:
            raise InvalidArgument("new_tokens", f"must be > 0, got {new_tokens}")
        inputs = self.view.inputs
        inputs.require_context_tokens("cached_tokens", cached_tokens)
        inputs.require_context_tokens("new_tokens", cached_tokens + new_tokens)
        cost = self.cost_model()
        return ComputeEstimate(
            compute_s=cost.extend_s(cached_tokens, new_tokens),
            kv_bytes=cost.kv_bytes(cached_tokens + new_tokens),
            model=cost.model.name,
        )

    def _kv_bytes(self, kv_bytes: int, tokens: int) -> int:
        if kv_bytes < 0:
            raise InvalidArgument("kv_bytes", f"must be >= 0, got {kv_bytes}")
        if tokens < 0:
            raise InvalidArgument("tokens", f"must be >= 0, got {tokens}")
        if kv_bytes and tokens:
            raise InvalidArgument("tokens", "give either kv_bytes or tokens, not both")
        if not kv_bytes and not tokens:
            raise InvalidArgument("kv_bytes", "give kv_bytes or tokens (> 0)")
        self.view.inputs.require_context_tokens("tokens", tokens)
        return kv_bytes or self.cost_model().kv_bytes(tokens)

    def _ids(self, field: str, given: Sequence[str], role: Role) -> tuple[str, ...]:
        if given:
            for i, instance_id in enumerate(given):
                self._require_known(f"{field}[{i}]", instance_id)
            return tuple(given)
        state = self.view.state
        if state is not None:
            alive = (
                state.cluster.prefill_instances()
                if role is Role.PREFILL
                else state.cluster.decode_instances()
            )
            return tuple(instance.instance_id for instance in alive)
        return tuple(
            sorted(
                spec.instance_id
                for spec in self.view.inputs.topology.instances.values()
                if spec.role is role
            )
        )

    def _require_known(self, field: str, instance_id: str) -> None:
        if not instance_id:
            raise InvalidArgument(field, "must not be empty")
        try:
            self.view.inputs.topology.instance(instance_id)
        except NotFound:
            raise NotFound(f"unknown instance {instance_id!r}", field=field) from None
