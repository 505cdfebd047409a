"""CostOracleService: protobuf in, `estimates.CostOracle` call, protobuf out."""

from __future__ import annotations

import grpc
from opentelemetry import trace

from kvrs.v1 import oracle_pb2, oracle_pb2_grpc
from services.common.core_pb import transfer_to_pb
from services.cost_oracle.estimates import CostOracle


class CostOracleServicer(oracle_pb2_grpc.CostOracleServiceServicer):
    def __init__(self, oracle: CostOracle) -> None:
        self.oracle = oracle

    async def EstimateTransfer(
        self, request: oracle_pb2.EstimateTransferRequest, context: grpc.aio.ServicerContext
    ) -> oracle_pb2.EstimateTransferResponse:
        estimate = self.oracle.transfer(
            request.src_instance_id, request.dst_instance_id, request.kv_bytes, request.tokens
        )
        trace.get_current_span().set_attributes(
            {
                "kvrs.transfer_s": estimate.transfer_s,
                "kvrs.transfer.bandwidth_bps": estimate.bottleneck_bps,
                "kvrs.transfer.telemetry_age_s": estimate.telemetry_age_s,
                "kvrs.transfer.telemetry_stale": estimate.telemetry_stale,
            }
        )
        return oracle_pb2.EstimateTransferResponse(estimate=transfer_to_pb(estimate))

    async def GetCostMatrix(
        self, request: oracle_pb2.GetCostMatrixRequest, context: grpc.aio.ServicerContext
    ) -> oracle_pb2.GetCostMatrixResponse:
        matrix = self.oracle.matrix(
            list(request.prefill_instance_ids),
            list(request.decode_instance_ids),
            request.kv_bytes,
            request.tokens,
        )
        trace.get_current_span().set_attribute(
            "kvrs.matrix.pairs", len(matrix.prefill_ids) * len(matrix.decode_ids)
        )
        return oracle_pb2.GetCostMatrixResponse(
            rows=[
                oracle_pb2.CostMatrixRow(
                    prefill_instance_id=prefill_id,
                    to_decode=[transfer_to_pb(estimate) for estimate in row],
                )
                for prefill_id, row in zip(matrix.prefill_ids, matrix.rows, strict=True)
            ],
            decode_instance_ids=matrix.decode_ids,
        )

    async def EstimateCompute(
        self, request: oracle_pb2.EstimateComputeRequest, context: grpc.aio.ServicerContext
    ) -> oracle_pb2.EstimateComputeResponse:
        estimate = self.oracle.compute(request.cached_tokens, request.new_tokens)
        return oracle_pb2.EstimateComputeResponse(
            compute_s=estimate.compute_s, kv_bytes=estimate.kv_bytes, model=estimate.model
        )
