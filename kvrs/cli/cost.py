"""`kvrs cost`: every recovery option's predicted cost for one request, as JSON.

The numbers come from the same `kvrs.recovery.Kvrs` policy the scheduler runs, on a
two-instance cluster built in memory: one prefill and one decode instance in one rack,
joined by a link of the given bandwidth and RTT.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument, KvrsError
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import ComputeProfile, compute_profile
from kvrs.recovery import Action, Kvrs, RecoveryDecision, RecoveryRequest
from kvrs.topology import DEFAULT_TIERS, InstanceSpec, Location, Role, Tier, TierSpec, Topology
from kvrs.units import gbps_to_bps, ms_to_s

PREFILL_ID = "prefill-0"
DECODE_ID = "decode-0"


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `kvrs cost` arguments."""
    parser.add_argument("--model", required=True, help="model preset (e.g. opt-13b, llama3-70b)")
    parser.add_argument("--prompt-tokens", type=int, required=True, help="prompt length L")
    parser.add_argument(
        "--bandwidth-gbps",
        type=float,
        required=True,
        help="link bandwidth between the prefill and decode instance, Gbit/s",
    )
    parser.add_argument(
        "--generated-tokens",
        type=int,
        default=0,
        help="tokens already generated when the decode instance failed",
    )
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="round-trip and setup latency of a transfer, ms"
    )
    parser.add_argument(
        "--decode-wait-s",
        type=float,
        default=0.0,
        help="work queued on the decode instance, s (W(d))",
    )
    parser.add_argument(
        "--prefill-wait-s",
        type=float,
        default=0.0,
        help="work queued on the prefill instance, s (W(p))",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="SLO deadline, seconds from now (ABORT when no option meets it)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="compute profile JSON from `kvrs calibrate` (default: preset)",
    )
    parser.add_argument(
        "--source-kv-lost", action="store_true", help="the prefill instance no longer holds the KV"
    )
    parser.add_argument("--no-slot", action="store_true", help="no migration slot is free")


def run(args: argparse.Namespace) -> int:
    """Print the JSON report; exit 2 (naming the flag) on bad input."""
    try:
        report = cost_report(args)
    except KvrsError as exc:
        flag = f"--{exc.field.replace('_', '-')}" if exc.field else ""
        print(f"kvrs cost: {flag + ': ' if flag else ''}{exc.message or exc}", file=sys.stderr)
        return 2
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def cost_report(args: argparse.Namespace) -> dict[str, Any]:
    """The report `kvrs cost` prints, as a dict."""
    if not args.bandwidth_gbps > 0:
        raise InvalidArgument("bandwidth_gbps", f"must be > 0, got {args.bandwidth_gbps}")
    for field in ("rtt_ms", "decode_wait_s", "prefill_wait_s"):
        if getattr(args, field) < 0:
            raise InvalidArgument(field, f"must be >= 0, got {getattr(args, field)}")
    model = model_spec(args.model)
    profile = ComputeProfile.load(args.profile) if args.profile else compute_profile(args.model)
    cost = CostModel(
        model,
        profile,
        NetworkModel(two_instance_topology(gbps_to_bps(args.bandwidth_gbps), ms_to_s(args.rtt_ms))),
    )
    now_s = 0.0
    view = ClusterView(
        {
            PREFILL_ID: InstanceState(PREFILL_ID, Role.PREFILL, wait_s=args.prefill_wait_s),
            DECODE_ID: InstanceState(DECODE_ID, Role.DECODE, wait_s=args.decode_wait_s),
        },
        now_s=now_s,
    )
    request = RecoveryRequest(
        request_id="cli",
        prompt_tokens=args.prompt_tokens,
        generated_tokens=args.generated_tokens,
        source_prefill_id=PREFILL_ID,
        deadline_s=None if args.deadline_s is None else now_s + args.deadline_s,
        source_kv_available=not args.source_kv_lost,
    )
    decision = Kvrs().decide(request, view, cost, now_s, migration_slot_free=not args.no_slot)
    return _report(args, cost, decision)


def two_instance_topology(bandwidth_bps: float, rtt_s: float) -> Topology:
    """One prefill and one decode instance on two nodes of a rack, joined at `bandwidth_bps`."""
    tiers = dict(DEFAULT_TIERS)
    tiers[Tier.RACK] = TierSpec(capacity_bps=bandwidth_bps, hop_latency_s=0.0)
    topology = Topology(tiers, setup_latency_s=rtt_s)
    topology.add_instance(InstanceSpec(PREFILL_ID, Role.PREFILL, Location("node-p", "rack-0")))
    topology.add_instance(InstanceSpec(DECODE_ID, Role.DECODE, Location("node-d", "rack-0")))
    return topology


def _finite(value: float) -> float | None:
    # JSON has no infinity: an option that cannot run has no cost (null).
    return value if math.isfinite(value) else None


def _report(
    args: argparse.Namespace,
    cost: CostModel,
    decision: RecoveryDecision,
) -> dict[str, Any]:
    options = {option.action: option for option in decision.options}
    hybrid = options[Action.HYBRID]
    bandwidth_bps, _ = cost.network.bandwidth_bps(PREFILL_ID, DECODE_ID, 0.0)
    return {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "generated_tokens": args.generated_tokens,
        "bandwidth_bps": bandwidth_bps,
        "rtt_s": cost.network.topology.base_rtt_s(PREFILL_ID, DECODE_ID),
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "kv_bytes": cost.kv_bytes(args.prompt_tokens),
        "prefill_s": cost.prefill_s(args.prompt_tokens),
        "extend_s": cost.extend_s(args.prompt_tokens, args.generated_tokens),
        "migrate_s": _finite(options[Action.MIGRATE].cost_s),
        "recompute_s": _finite(options[Action.RECOMPUTE].cost_s),
        "hybrid_s": _finite(hybrid.cost_s),
        "hybrid_split_tokens": hybrid.split_tokens,
        "decision": decision.action.value,
        "cost_s": _finite(decision.cost_s),
        "slack_s": _finite(decision.slack_s),
        "reason": decision.reason,
        "options": [
            {
                "action": o.action.value,
                "cost_s": _finite(o.cost_s),
                "wait_s": _finite(o.wait_s),
                "transfer_s": _finite(o.transfer_s),
                "compute_s": _finite(o.compute_s),
                "split_tokens": o.split_tokens,
                "feasible": o.feasible,
                "infeasible_reason": o.infeasible_reason,
            }
            for o in decision.options
        ],
    }
