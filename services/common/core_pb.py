"""Core types as protobuf and back (transfer estimates, recovery actions and options): one
translation for every service that sends or reads them."""

from __future__ import annotations

from kvrs.network import TransferEstimate
from kvrs.recovery import Action, OptionCost
from kvrs.sampling import Sampling
from kvrs.v1 import common_pb2, scheduler_pb2

ACTION_TO_PB = {
    Action.MIGRATE: common_pb2.RECOVERY_ACTION_MIGRATE,
    Action.RECOMPUTE: common_pb2.RECOVERY_ACTION_RECOMPUTE,
    Action.HYBRID: common_pb2.RECOVERY_ACTION_HYBRID,
    Action.ABORT: common_pb2.RECOVERY_ACTION_ABORT,
}

ACTION_FROM_PB = {message: action for action, message in ACTION_TO_PB.items()}


def transfer_to_pb(estimate: TransferEstimate) -> common_pb2.TransferEstimate:
    return common_pb2.TransferEstimate(
        src_instance_id=estimate.src_id,
        dst_instance_id=estimate.dst_id,
        kv_bytes=estimate.kv_bytes,
        transfer_s=estimate.transfer_s,
        tier=int(estimate.tier),
        bottleneck_bandwidth_bps=estimate.bottleneck_bps,
        rtt_s=estimate.rtt_s,
        telemetry_age_s=estimate.telemetry_age_s,
        telemetry_stale=estimate.telemetry_stale,
        flows_on_path=estimate.flows_on_path,
    )


def option_to_pb(option: OptionCost) -> scheduler_pb2.OptionCost:
    return scheduler_pb2.OptionCost(
        action=ACTION_TO_PB[option.action],
        target_instance_id=option.target_id,
        source_instance_id=option.source_id,
        cost_s=option.cost_s,
        wait_s=option.wait_s,
        transfer_s=option.transfer_s,
        compute_s=option.compute_s,
        split_tokens=option.split_tokens,
        feasible=option.feasible,
        infeasible_reason=option.infeasible_reason,
    )


def option_from_pb(option: scheduler_pb2.OptionCost) -> OptionCost:
    return OptionCost(
        action=ACTION_FROM_PB[option.action],
        target_id=option.target_instance_id,
        source_id=option.source_instance_id,
        cost_s=option.cost_s,
        wait_s=option.wait_s,
        transfer_s=option.transfer_s,
        compute_s=option.compute_s,
        split_tokens=option.split_tokens,
        feasible=option.feasible,
        infeasible_reason=option.infeasible_reason,
    )


def sampling_to_pb(sampling: Sampling) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
    )


def sampling_from_pb(message: common_pb2.SamplingParams) -> Sampling:
    """The parameters `message` carries (InvalidArgument naming the bad field)."""
    return Sampling.of(message.temperature, message.top_p, message.top_k, message.seed)
