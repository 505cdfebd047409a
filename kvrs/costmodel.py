"""The cost model a decision uses: KV size, transfer time and compute time of one model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from kvrs.errors import InvalidArgument
from kvrs.model import ModelSpec
from kvrs.network import NetworkModel, TransferEstimate
from kvrs.profile import ComputeProfile
from kvrs.topology import LinkId
from kvrs.units import BITS_PER_BYTE

__all__ = ["CostModel", "Seconds", "prefix_hit_tokens", "streamed_tail_s"]

Seconds = TypeVar("Seconds", float, np.ndarray)
"""A time in seconds, or an array of them (one per candidate)."""


class CostModel:
    """S(L), T_x, T_pf and T_ext for one served model, over one network model."""

    def __init__(
        self,
        model: ModelSpec,
        compute: ComputeProfile,
        network: NetworkModel,
        margins: Mapping[str, float] | None = None,
    ):
        self.model = model
        self.compute = compute
        self.network = network
        self.margins: Mapping[str, float] = dict(margins or {})
        """Measured relative error of each recovery action's predictions (by action value):
        an option more complex than MIGRATE must win by more than its error, and the
        deadline check uses the upper end, cost · (1 + error). Empty: decide on the point
        estimates."""
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self.kv_bits_per_token = BITS_PER_BYTE * model.kv_bytes_per_token

    def kv_bytes(self, tokens: int) -> int:
        """S(L)."""
        return self.model.kv_bytes(tokens)

    def transfer(
        self,
        src_id: str,
        dst_id: str,
        tokens: int,
        now_s: float,
        extra_flows: Mapping[LinkId, int] | None = None,
    ) -> TransferEstimate:
        """T_x(src, dst, S(tokens))."""
        return self.network.transfer(
            src_id, dst_id, self.model.kv_bytes(tokens), now_s, extra_flows
        )

    def prefill_s(self, tokens: int) -> float:
        """T_pf(L)."""
        return self.compute.prefill_s(tokens)

    def extend_s(self, cached_tokens: int, new_tokens: int) -> float:
        """T_ext(L0, g)."""
        return self.compute.extend_s(cached_tokens, new_tokens)


def prefix_hit_tokens(
    prefix_hashes: Sequence[int],
    resident: frozenset[int],
    block_tokens: int,
    prompt_tokens: int,
) -> int:
    """Tokens of the prompt whose KV `resident` already holds: the leading resident blocks.

    Counting stops at the first missing block, because a block's KV depends on every
    token before it; the result is capped at the prompt's length (the last block may be
    partial).
    """
    if prompt_tokens < 0:
        raise InvalidArgument("prompt_tokens", f"must be >= 0, got {prompt_tokens}")
    blocks = 0
    for block_hash in prefix_hashes:
        if block_hash not in resident:
            break
        blocks += 1
    return min(blocks * block_tokens, prompt_tokens)


def streamed_tail_s(
    transfer_s: Seconds, prefill_s: float, layers: int, fixed_s: float | np.ndarray = 0.0
) -> Seconds:
    """What is left of a transfer once its prefill has ended, when each layer's KV leaves
    as soon as the prefill has computed that layer (layer-wise streaming); elementwise
    for arrays of transfer times and of their fixed costs.

    The transfer's fixed cost (`fixed_s` of `transfer_s`: its set-up, the path's latency)
    is paid once, as the prefill starts; its stream, S = transfer_s − fixed_s, goes layer
    by layer. The prefill computes the layers one after another, prefill_s / layers
    each; layer i leaves once it is computed, the set-up is done and the link has
    carried layer i − 1, taking S / layers. The last byte lands at the latest of
    fixed_s + S (the set-up, then the stream without a pause), prefill_s / layers + S
    (the stream paced by the first layer) and prefill_s + S / layers (the last layer).
    Less prefill_s, that is the tail: a transfer faster than the prefill hides its set-up
    and all but its last layer.
    """
    if layers < 1:
        raise InvalidArgument("layers", f"must be >= 1, got {layers}")
    if not prefill_s >= 0.0:
        raise InvalidArgument("prefill_s", f"must be >= 0, got {prefill_s}")
    hidden_s = prefill_s * (layers - 1) / layers
    if isinstance(transfer_s, np.ndarray):
        stream_s = transfer_s - np.minimum(fixed_s, transfer_s)
        return np.maximum(
            np.maximum(stream_s / layers, stream_s - hidden_s), transfer_s - prefill_s
        )
    if not transfer_s >= 0.0:
        raise InvalidArgument("transfer_s", f"must be >= 0, got {transfer_s}")
    stream_s = transfer_s - min(float(fixed_s), transfer_s)
    return max(stream_s / layers, stream_s - hidden_s, transfer_s - prefill_s)
