"""`kvrs up`, `kvrs down` and `kvrs status`: a local cluster of processes, and a look inside one.

`up` and `down` drive `kvrs.cli.launcher`; `status` reads any cluster through its gossip
and slot-broker gRPC APIs (the local one by default, or the addresses given as flags or
GOSSIP_ADDR / SLOT_BROKER_ADDR, e.g. a compose deployment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrs.cli.launcher import DEFAULT_RUN_DIR
from kvrs.model import BLOCK_TOKENS_VARIABLE, DEFAULT_MODEL

_BPS_PER_GBPS = 1e9


def register(parser: argparse.ArgumentParser) -> None:
    command = parser.prog.split()[-1]
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(DEFAULT_RUN_DIR),
        help=f"run directory: logs, certificates, state file (default {DEFAULT_RUN_DIR})",
    )
    if command == "up":
        add_model_argument(parser)
        parser.add_argument(
            "--block-tokens",
            type=_positive_int,
            default=0,
            help="tokens per KV block, the unit workers allocate and cache prefixes in "
            "and placement hashes prompts by (default KVRS_BLOCK_TOKENS, else 512)",
        )
        parser.add_argument(
            "--tls",
            action="store_true",
            help="generate dev certificates and run every hop over mTLS",
        )
        parser.add_argument(
            "--otlp-endpoint",
            default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
            help="export spans over OTLP gRPC (e.g. http://127.0.0.1:4317)",
        )
        parser.add_argument(
            "--envoy",
            action="store_true",
            help="also run Envoy with the endpoint picker in front of one "
            "OpenAI adapter per decode instance",
        )
        parser.add_argument(
            "--base-port",
            type=int,
            default=0,
            help="the standard ports shifted to start here (50051: gossip "
            "50051, cost-oracle 50052, scheduler-1 50053, ...; "
            "default: free ports)",
        )
        parser.add_argument(
            "--topology",
            type=Path,
            default=None,
            help="topology file (default deploy/topology.yaml)",
        )
        profile = parser.add_mutually_exclusive_group()
        profile.add_argument(
            "--calibrate",
            action="store_true",
            help="measure the workers' model on this machine first (kvrs "
            "calibrate) and price every decision with that profile",
        )
        profile.add_argument(
            "--profile-file",
            type=Path,
            default=None,
            help="a kvrs calibrate profile to price decisions with (default: the model's preset)",
        )
        parser.add_argument(
            "--timeout-s",
            type=float,
            default=60.0,
            help="how long each startup stage may take (default 60)",
        )
    elif command == "down":
        parser.add_argument(
            "--grace-s",
            type=float,
            default=10.0,
            help="seconds between SIGTERM and SIGKILL (default 10)",
        )
    else:
        parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
        parser.add_argument(
            "--gossip-addr",
            default="",
            help="gossip host:port (default: the local cluster, or GOSSIP_ADDR)",
        )
        parser.add_argument(
            "--slot-broker-addr",
            default="",
            help="slot broker host:port (default: the local cluster, or SLOT_BROKER_ADDR)",
        )
        parser.add_argument(
            "--scheduler-addrs",
            default="",
            help="scheduler replicas, comma-separated, asked for the prediction error and "
            "corrections (default: the local cluster, or SCHEDULER_ADDRS)",
        )


def run(args: argparse.Namespace) -> int:
    from kvrs.cli.launcher import ClusterError

    handlers = {"up": _up, "down": _down, "status": _status}
    try:
        return handlers[args.command](args)
    except ClusterError as exc:
        print(f"kvrs {args.command}: {exc}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    from kvrs.cli.launcher import (
        DEFAULT_TOPOLOGY_FILE,
        ENVOY_SERVICES,
        SERVICES,
        ClusterOptions,
        find_redis_server,
        start_cluster,
    )

    logging.basicConfig(level=logging.INFO, format="kvrs up: %(message)s")
    profile_file = args.profile_file.resolve() if args.profile_file else None
    if not os.environ.get("REDIS_URL"):
        find_redis_server()  # a missing Redis fails now, not after calibrating
    if args.block_tokens:
        # This process prices and calibrates with the cluster's block size too.
        os.environ[BLOCK_TOKENS_VARIABLE] = str(args.block_tokens)
    model = checked_model(args.model)
    if args.calibrate:
        profile_file = calibrate_into(args.dir, model)
    options = ClusterOptions(
        run_dir=args.dir,
        workers_model=model,
        block_tokens=args.block_tokens,
        tls=args.tls,
        otlp_endpoint=args.otlp_endpoint,
        base_port=args.base_port,
        redis_url=os.environ.get("REDIS_URL", ""),
        redis_prefix=os.environ.get("KVRS_REDIS_PREFIX", ""),
        topology_file=(args.topology or DEFAULT_TOPOLOGY_FILE).resolve(),
        profile_file=profile_file,
        startup_timeout_s=args.timeout_s,
    )
    started_s = time.monotonic()
    state = start_cluster(options, SERVICES + ENVOY_SERVICES if args.envoy else SERVICES)
    elapsed_s = time.monotonic() - started_s
    print(f"kvrs cluster up in {elapsed_s:.1f} s (run dir {state.run_dir})")
    rows = [
        [r.name, r.kind, r.address, _metrics_url(r.metrics_addr), str(r.pid), r.log_file]
        for r in state.processes
    ]
    print(_table(["SERVICE", "KIND", "ADDRESS", "METRICS", "PID", "LOG"], rows))
    print()
    for line in urls(state, args.otlp_endpoint):
        print(line)
    print(f"\nredis {state.redis_url}  prefix {state.redis_prefix}")
    print("client environment:")
    for name, value in {**state.client_env(), **_openai_env(state)}.items():
        print(f"  export {name}={value}")
    return 0


def _openai_env(state: Any) -> dict[str, str]:
    """OPENAI_BASE_URL, which the `openai` client reads: the cluster's OpenAI adapter."""
    for record in state.processes:
        if record.name == "openai-http":
            return {"OPENAI_BASE_URL": f"http://{record.address}/v1"}
    return {}


JAEGER_UI_PORT = 16686


def _metrics_url(address: str) -> str:
    return f"http://{address}/metrics" if address else "-"


def urls(state: Any, otlp_endpoint: str = "") -> list[str]:
    """Every address a user of a fresh cluster reaches for, one line each."""
    from urllib.parse import urlparse

    from kvrs.cli.launcher import ADAPTER_PREFIX, SCRAPE_CONFIG_FILE

    lines = []
    for record in state.processes:
        if record.name == "openai-http":
            base = f"http://{record.address}/v1"
            lines.append(f"OpenAI API: {base}  (curl {base}/models; OPENAI_BASE_URL={base})")
        elif record.name.startswith(ADAPTER_PREFIX):
            instance = record.name.removeprefix(ADAPTER_PREFIX)
            lines.append(f"OpenAI API pinned to {instance}: http://{record.address}/v1")
        elif record.kind == "gateway":
            lines.append(
                f"Envoy (OpenAI API through the endpoint picker): http://{record.address}/v1"
            )
    scrape = Path(state.run_dir) / SCRAPE_CONFIG_FILE
    lines.append(
        f"Prometheus metrics: each service's METRICS URL above; all of them: "
        f"prometheus --config.file {scrape} (then http://localhost:9090)"
    )
    if otlp_endpoint:
        parsed = urlparse(otlp_endpoint if "://" in otlp_endpoint else f"http://{otlp_endpoint}")
        host = parsed.hostname or "localhost"
        lines.append(
            f"Jaeger UI (spans exported to {otlp_endpoint}): http://{host}:{JAEGER_UI_PORT}"
            "/search?service=kvrs-router"
        )
    return lines


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`--model` (alias `--workers-model`): what every service of the cluster runs."""
    parser.add_argument(
        "--model",
        "--workers-model",
        dest="model",
        default=os.environ.get("KVRS_MODEL") or DEFAULT_MODEL,
        help="a Hugging Face checkpoint directory (config.json, *.safetensors, "
        "tokenizer.json) or an embedded checkpoint; default KVRS_MODEL, else "
        f"{DEFAULT_MODEL} (random weights: meaningless text)",
    )


def checked_model(model: str) -> str:
    """`model` as every service must see it (a directory made absolute, since services
    run elsewhere); a name that is neither a checkpoint nor a preset fails now, naming it."""
    from kvrs.cli.launcher import ClusterError
    from kvrs.errors import KvrsError
    from kvrs.model import checkpoint_dir, model_spec

    path = checkpoint_dir(model)
    if path is not None:
        model = os.path.abspath(path)
    try:
        model_spec(model)
    except KvrsError as exc:
        raise ClusterError(f"--model: {exc}") from None
    return model


def calibrate_into(run_dir: Path, model: str) -> Path:
    """Measures `model`'s prefill on this machine into <run_dir>/profile.json; says what it
    found, since every predicted cost the cluster reports rests on it."""
    from kvrs.cli.calibrate import calibrate

    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / "profile.json").resolve()
    print(f"calibrating {model} on this machine ...", flush=True)
    report = calibrate(model, path)
    measured = ", ".join(
        f"{row['tokens']} tokens {row['measured_s'] * 1e3:.1f} ms"
        for row in report["fit_vs_measured"][::3]
    )
    print(f"prefill measured: {measured} (profile {path})", flush=True)
    return path


def _down(args: argparse.Namespace) -> int:
    from kvrs.cli.launcher import stop_cluster

    state, killed = stop_cluster(args.dir, args.grace_s)
    print(f"stopped {len(state.processes)} processes from {state.run_dir}")
    if killed:
        print(f"killed after {args.grace_s:.0f} s: {', '.join(killed)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvrs.cli.launcher import ClusterError, ClusterState

    state: ClusterState | None = None
    try:
        state = ClusterState.load(args.dir)
    except ClusterError:
        if not (args.gossip_addr or os.environ.get("GOSSIP_ADDR")):
            raise
    report = asyncio.run(_collect(args, state))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report))
    return 0


async def _collect(args: argparse.Namespace, state: Any) -> dict[str, Any]:
    from kvrs import errors
    from kvrs.cli.launcher import is_running
    from kvrs.client import KvrsClient
    from kvrs.rpc import GrpcSettings, TlsConfig

    env = dict(os.environ)
    if state is not None:
        env.update(state.client_env())
    gossip_addr = args.gossip_addr or env.get("GOSSIP_ADDR", "")
    slot_broker_addr = args.slot_broker_addr or env.get("SLOT_BROKER_ADDR", "")
    scheduler_addrs = args.scheduler_addrs or env.get("SCHEDULER_ADDRS", "")
    settings = GrpcSettings(tls=TlsConfig.from_env(env))
    report: dict[str, Any] = {
        "gossip_addr": gossip_addr,
        "slot_broker_addr": slot_broker_addr,
        "scheduler_addrs": scheduler_addrs,
    }
    async with KvrsClient(
        gossip_addr=gossip_addr,
        slot_broker_addr=slot_broker_addr,
        scheduler_addrs=scheduler_addrs,
        settings=settings,
        timeout_s=2.0,
        max_attempts=2,
    ) as client:
        try:
            nodes = await client.list_nodes(include_down=True)
            links = await client.list_links()
            report["instances"] = [_node(node) for node in nodes.nodes]
            report["links"] = [_link(link) for link in links.links]
        except errors.KvrsError as exc:
            report["gossip_error"] = str(exc)
        try:
            report["slots"] = _slots(await client.get_slot_stats())
        except errors.KvrsError as exc:
            report["slots_error"] = str(exc)
        if scheduler_addrs:
            try:
                report["predictions"] = _predictions(await client.get_corrections())
            except errors.KvrsError as exc:
                report["predictions_error"] = str(exc)
    if state is not None:
        now_ms = int(time.time() * 1000)
        report["run_dir"] = state.run_dir
        report["processes"] = [
            {
                "name": record.name,
                "kind": record.kind,
                "address": record.address,
                "pid": record.pid,
                "running": is_running(record),
                "uptime_s": round((now_ms - record.started_unix_ms) / 1000, 1),
            }
            for record in state.processes
        ]
    return report


def _node(node: Any) -> dict[str, Any]:
    from kvrs.v1 import common_pb2, gossip_pb2

    return {
        "instance_id": node.instance_id,
        "role": common_pb2.Role.Name(node.role).removeprefix("ROLE_").lower(),
        "address": node.address,
        "state": gossip_pb2.NodeState.Name(node.state).removeprefix("NODE_STATE_").lower(),
        "age_s": round(node.age_s, 3),
        "queue_depth": node.queue_depth,
        "queued_work_s": round(node.queued_work_s, 6),
        "compute_factor": round(node.compute_factor, 3),
        "running_requests": node.running_requests,
        "running_context_tokens": node.running_context_tokens,
        "free_kv_blocks": node.free_kv_blocks,
        "kv_capacity_blocks": node.kv_capacity_blocks,
        "node": node.location.node,
        "model": node.model,
    }


def _link(link: Any) -> dict[str, Any]:
    return {
        "src_instance_id": link.src_instance_id,
        "dst_instance_id": link.dst_instance_id,
        "bandwidth_bps": link.bandwidth_bps,
        "sample_bandwidth_bps": link.sample_bandwidth_bps,
        "rtt_s": link.rtt_s,
        "samples": link.samples,
        "age_s": round(link.age_s, 3),
    }


def _slots(stats: Any) -> dict[str, Any]:
    return {
        "slots_in_use": stats.slots_in_use,
        "cluster_cap": stats.cluster_cap,
        "granted_total": stats.granted_total,
        "denied_total": stats.denied_total,
        "expired_total": stats.expired_total,
        "spare_slots": stats.spare_slots,
        "spares_lapsed_total": stats.spares_lapsed_total,
        "links": [
            {
                "src_instance_id": link.src_instance_id,
                "dst_instance_id": link.dst_instance_id,
                "in_use": link.in_use,
                "cap": link.cap,
            }
            for link in stats.links
        ],
    }


def _predictions(reply: Any) -> dict[str, Any]:
    return {
        "samples": reply.samples,
        "compute_factor": reply.compute_factor,
        "wait_per_decode_s": reply.wait_per_decode_s,
        "worker_wait_s": dict(reply.worker_wait_s),
        "links": [
            {
                "src_instance_id": link.src_instance_id,
                "dst_instance_id": link.dst_instance_id,
                "fixed_s": link.fixed_s,
                "bandwidth_bps": link.bandwidth_bps,
                "samples": link.samples,
            }
            for link in reply.links
        ],
        "errors": [
            {"kind": e.kind, "term": e.term, "p50": e.p50, "p90": e.p90, "samples": e.samples}
            for e in reply.errors
        ],
    }


def _render_predictions(report: dict[str, Any]) -> list[str]:
    parts = [f"\npredictions (scheduler {report['scheduler_addrs']})"]
    if "predictions_error" in report:
        return [*parts, f"  unavailable: {report['predictions_error']}"]
    predictions = report["predictions"]
    parts.append(
        f"  fitted from {predictions['samples']} outcomes: compute x"
        f"{predictions['compute_factor']:.2f}, decode interference "
        f"{predictions['wait_per_decode_s'] * 1000:.2f} ms per decoding request"
    )
    for worker, wait_s in sorted(predictions["worker_wait_s"].items()):
        parts.append(f"  {worker} waits {wait_s * 1000:.2f} ms beyond its reported queue")
    rows = [
        [
            e["kind"],
            e["term"],
            f"{100 * e['p50']:.0f}",
            f"{100 * e['p90']:.0f}",
            str(e["samples"]),
        ]
        for e in predictions["errors"]
    ]
    parts.append(
        _table(
            ["KIND", "TERM", "ERROR_P50_%", "ERROR_P90_%", "DECISIONS"],
            rows,
            empty="  (no executed decision reported yet)",
        )
    )
    rows = [
        [
            link["src_instance_id"],
            link["dst_instance_id"],
            f"{link['fixed_s'] * 1000:.2f}",
            f"{link['bandwidth_bps'] / _BPS_PER_GBPS:.3f}",
            str(link["samples"]),
        ]
        for link in predictions["links"]
    ]
    if rows:
        parts.append("  links as decisions measured them:")
        parts.append(_table(["SRC", "DST", "FIXED_MS", "GBPS", "TRANSFERS"], rows))
    return parts


def _render(report: dict[str, Any]) -> str:
    parts: list[str] = []
    if "processes" in report:
        rows = [
            [
                p["name"],
                p["kind"],
                p["address"],
                str(p["pid"]),
                "running" if p["running"] else "EXITED",
                f"{p['uptime_s']:.0f}",
            ]
            for p in report["processes"]
        ]
        parts.append(f"processes ({report['run_dir']})")
        parts.append(_table(["NAME", "KIND", "ADDRESS", "PID", "STATE", "UP_S"], rows))
    parts.append(f"\ninstances (gossip {report['gossip_addr']})")
    if "gossip_error" in report:
        parts.append(f"  unavailable: {report['gossip_error']}")
    else:
        rows = [
            [
                n["instance_id"],
                n["role"],
                n["address"],
                n["node"],
                n["state"],
                f"{n['age_s']:.2f}",
                str(n["queue_depth"]),
                f"{n['queued_work_s']:.3f}",
                f"{n['compute_factor']:.2f}" if n["compute_factor"] else "-",
                str(n["running_requests"]),
                str(n["running_context_tokens"]),
                f"{n['free_kv_blocks']}/{n['kv_capacity_blocks']}",
            ]
            for n in report["instances"]
        ]
        parts.append(
            _table(
                [
                    "ID",
                    "ROLE",
                    "ADDRESS",
                    "NODE",
                    "STATE",
                    "AGE_S",
                    "QUEUE",
                    "QUEUED_WORK_S",
                    "PACE",
                    "RUNNING",
                    "CONTEXT",
                    "FREE_KV_BLOCKS",
                ],
                rows,
                empty="  (no instances registered)",
            )
        )
        parts.append("\nlinks (measured by the prober)")
        rows = [
            [
                link["src_instance_id"],
                link["dst_instance_id"],
                f"{link['bandwidth_bps'] / _BPS_PER_GBPS:.3f}",
                f"{link['sample_bandwidth_bps'] / _BPS_PER_GBPS:.3f}",
                f"{link['rtt_s'] * 1000:.3f}",
                str(link["samples"]),
                f"{link['age_s']:.2f}",
            ]
            for link in report["links"]
        ]
        parts.append(
            _table(
                ["SRC", "DST", "EWMA_GBPS", "LAST_GBPS", "RTT_MS", "SAMPLES", "AGE_S"],
                rows,
                empty="  (no link measured yet)",
            )
        )
    parts.append(f"\nslots (slot broker {report['slot_broker_addr']})")
    if "slots_error" in report:
        parts.append(f"  unavailable: {report['slots_error']}")
    else:
        slots = report["slots"]
        parts.append(
            f"  {slots['slots_in_use']} in use of {slots['cluster_cap']}"
            f"  (granted {slots['granted_total']}, denied {slots['denied_total']},"
            f" expired {slots['expired_total']}; spares held {slots['spare_slots']},"
            f" lapsed {slots['spares_lapsed_total']})"
        )
        if slots["links"]:
            rows = [
                [
                    s["src_instance_id"],
                    s["dst_instance_id"],
                    str(s["in_use"]),
                    str(s["cap"]) if s["cap"] else "-",
                ]
                for s in slots["links"]
            ]
            parts.append(_table(["SRC", "DST", "IN_USE", "CAP"], rows))
    if report.get("scheduler_addrs"):
        parts.extend(_render_predictions(report))
    return "\n".join(parts)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], empty: str = "") -> str:
    if not rows and empty:
        return empty
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in (header, *rows)
    ]
    return "\n".join("  " + line.rstrip() for line in lines)
