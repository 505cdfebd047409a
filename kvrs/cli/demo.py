"""`kvrs demo`: requests through a local cluster, a decode worker killed mid-stream, and how
each affected request recovered.

    kvrs demo [--requests 8] [--warmup N] [--cluster-dir DIR] [--json FILE]

Measures the workers' model on this machine (`kvrs calibrate`, so predicted costs are this
machine's), starts a local cluster (`kvrs up`'s launcher; or reuses the one in
--cluster-dir), optionally warms it up with short requests (`--warmup`, see `_warm_up`), streams
a batch of requests through the router, kill -9s the decode worker serving most of them
once every stream is under way, then prints each affected request's recovery decision and
its cost terms, checks that every request completed, replays the prompts on the
survivors to show the recovered streams equal undisturbed ones, and tears the cluster
down (a reused cluster is left running, minus the killed worker). A fresh cluster lives in
a temporary directory, removed afterwards unless the demo failed (then its logs stay there
and the last line names it). Without REDIS_URL it needs a `redis-server` and says so before
it calibrates or starts anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvrs.cli.cluster import JAEGER_UI_PORT, add_model_argument

PROMPTS = (
    "kvrs moves KV caches across the datacenter network. ",
    "When a decode instance dies, every request on it must continue elsewhere. ",
    "Migrate the KV still held by the prefill instance, or recompute it? ",
    "The answer depends on the link, the queue and the prompt length. ",
    "A hybrid recomputes a prefix while the rest streams over the network. ",
    "Abort early when no path can meet the deadline. ",
)
ACTION_NAMES = {1: "MIGRATE", 2: "RECOMPUTE", 3: "HYBRID", 4: "ABORT"}
DEMO_SERVICES = (
    "gossip",
    "slot-broker",
    "cost-oracle",
    "scheduler-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "prober",
    "router",
)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=int, default=8, help="requests to stream through the router (default 8)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=1500, help="tokens per request (default 1500)"
    )
    parser.add_argument(
        "--cluster-dir",
        type=Path,
        default=None,
        help="reuse the cluster running from this run directory (kvrs up "
        "--dir); default: start a fresh one and stop it afterwards",
    )
    add_model_argument(parser)
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="first stream N short requests one after another, whose measured outcomes "
        "the scheduler learns from before it prices the batch (default 0: none; 12 gives "
        "each prefill-decode pair the 3 outcomes a correction needs)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=120.0, help="deadline of each request (default 120)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write every recovery (action, predicted_s, measured_s, each term "
        "predicted and measured) to FILE as JSON",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="price decisions with the model's preset profile instead of "
        "measuring the model on this machine first (~2 s for tiny)",
    )


def run(args: argparse.Namespace) -> int:
    from kvrs.cli.launcher import ClusterError

    if args.requests < 1 or args.max_new_tokens < 2 or args.warmup < 0:
        print(
            "kvrs demo: --requests must be >= 1, --max-new-tokens >= 2 and --warmup >= 0",
            file=sys.stderr,
        )
        return 2
    try:
        state, owned = _cluster(args)
    except ClusterError as exc:
        print(f"kvrs demo: {exc}", file=sys.stderr)
        return 1
    status = 1
    try:
        status = asyncio.run(_demo(args, state))
        return status
    finally:
        if owned:
            _stop(Path(state.run_dir), keep_logs=status != 0)


def _stop(run_dir: Path, keep_logs: bool) -> None:
    """Stops the demo's own cluster; its temporary directory goes too unless the run failed,
    when its logs are what a user needs to see why."""
    from kvrs.cli.launcher import stop_cluster

    stop_cluster(run_dir, grace_s=5.0)
    if keep_logs:
        print(f"cluster stopped; its logs are in {run_dir / 'logs'} (remove {run_dir.parent})")
    else:
        shutil.rmtree(run_dir.parent, ignore_errors=True)
        print(f"cluster stopped; {run_dir.parent} removed")


def _cluster(args: argparse.Namespace):
    """The cluster to use and whether this command started it (and so stops it)."""
    from kvrs.cli.cluster import calibrate_into, checked_model
    from kvrs.cli.launcher import (
        SERVICES,
        ClusterOptions,
        ClusterState,
        find_redis_server,
        start_cluster,
    )

    if args.cluster_dir is not None:
        state = ClusterState.load(args.cluster_dir)
        print(f"reusing the cluster in {state.run_dir}")
        return state, False
    redis_url = os.environ.get("REDIS_URL", "")
    if not redis_url:
        find_redis_server()  # before calibrating: a missing Redis fails in a second, not later
    model = args.model = checked_model(args.model)
    run_dir = Path(tempfile.mkdtemp(prefix="kvrs-demo-")) / "cluster"
    profile_file = None if args.no_calibrate else calibrate_into(run_dir, model)
    options = ClusterOptions(
        run_dir=run_dir,
        workers_model=model,
        profile_file=profile_file,
        otlp_endpoint=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        redis_url=redis_url,
        redis_prefix=f"{{kvrs-demo-{uuid.uuid4().hex[:8]}}}:" if redis_url else "",
    )
    print(f"starting a local cluster in {run_dir} ...", flush=True)
    started_s = time.monotonic()
    services = [spec for spec in SERVICES if spec.name in DEMO_SERVICES]
    state = start_cluster(options, services)
    print(f"cluster up in {time.monotonic() - started_s:.1f} s", flush=True)
    return state, True


@dataclass
class Stream:
    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    summary: Any = None
    error: str = ""


async def _demo(args: argparse.Namespace, state) -> int:
    from kvrs.rpc import GrpcSettings, TlsConfig, open_channel
    from kvrs.v1 import router_pb2_grpc
    from services.common.tokenizer import load_codec

    env = {**os.environ, **state.client_env()}
    settings = GrpcSettings(tls=TlsConfig.from_env(env))
    await _wait_for_workers(state, settings)
    run_id = uuid.uuid4().hex[:6]
    encode = load_codec(args.model).encode
    streams = [
        Stream(f"demo-{run_id}-{i}", encode(PROMPTS[i % len(PROMPTS)] * (1 + i % 3)))
        for i in range(args.requests)
    ]
    async with open_channel(state.address("router"), settings) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        await _warm_up(router, encode, run_id, args)
        print(
            f"\nstreaming {len(streams)} requests of {args.max_new_tokens} tokens "
            "through the router ...",
            flush=True,
        )
        tasks = [asyncio.create_task(_stream(router, s, args)) for s in streams]
        victim = await _kill_busiest_decode(state, settings, streams, tasks)
        await asyncio.gather(*tasks)
        _report(streams, victim, args.max_new_tokens)
        _report_placements(streams)
        if args.json is not None:
            report = {
                "victim": victim,
                "recoveries": recoveries(streams),
                "placements": placements(streams),
            }
            args.json.write_text(json.dumps(report, indent=2))
            print(f"recoveries written to {args.json}")
        completed = sum(1 for s in streams if len(s.tokens) == args.max_new_tokens)
        print(f"\n{completed}/{len(streams)} requests completed")
        identical = await _replay(router, streams, args)
    print(f"{identical}/{completed} streams identical to a fault-free rerun of their prompt")
    _traces(env, streams)
    failed = completed != len(streams) or identical != completed
    return 1 if failed else 0


WARMUP_NEW_TOKENS = 16
"""Tokens each warm-up request generates: enough for its placement's first decode step
to be measured, few enough that it is done before the batch starts."""


async def _warm_up(router, encode, run_id: str, args: argparse.Namespace) -> None:
    """Streams `--warmup` short requests, each started once the one before it has its
    first token, and waits for them all.

    A freshly started cluster has no outcomes: its first decisions are priced with the
    calibrated model alone, measured on an idle machine, while a serving cluster always
    has the outcomes of the traffic it has just served. Each warm-up placement is carried
    out alone, so what it measures (the prompt's prefill, the transfer's set-up, the
    first decode step) reaches the scheduler's corrections: the compute the workers
    deliver now, each pair's fixed cost (its first transfer pays for building the pair),
    the workers' waits. A correction needs `LearningConfig.min_samples` (3) outcomes
    behind it: 12 give each of the demo's four (prefill, decode) pairs three, were the
    scheduler to spread them, and pairs it leaves unused are priced with the median of
    those it used. Their prompts share no prefix with the batch's, so the batch's
    placements and recoveries find nothing cached by them.

    Off by default: a set-up learned from transfers made alone is priced as work that
    concurrent transfers share (`kvrs.batch`), while concurrent set-ups largely overlap,
    so after a warm-up a batch of recoveries is over-predicted (docs/benchmarks.md).
    """
    if args.warmup == 0:
        return
    print(
        f"\nwarm-up: {args.warmup} short requests, one after another, so that the scheduler "
        "prices the batch with what this cluster measured, not only with the calibration",
        flush=True,
    )
    warmups = [
        Stream(
            f"demo-{run_id}-warmup-{i}",
            encode(f"warm-up {i}: " + PROMPTS[(i + 1) % len(PROMPTS)] * (1 + i % 3)),
        )
        for i in range(args.warmup)
    ]
    short = argparse.Namespace(**{**vars(args), "max_new_tokens": WARMUP_NEW_TOKENS})
    tasks = []
    for stream in warmups:
        tasks.append(asyncio.create_task(_stream(router, stream, short)))
        while not stream.tokens and not tasks[-1].done():
            await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    failed = [s for s in warmups if s.error or len(s.tokens) != WARMUP_NEW_TOKENS]
    for stream in failed:
        print(f"  warm-up {stream.request_id}: {stream.error or 'incomplete'}")
    print(f"warm-up done: {len(warmups) - len(failed)}/{len(warmups)} completed", flush=True)


async def _stream(router, stream: Stream, args: argparse.Namespace) -> None:
    from kvrs.rpc.generate import generate_into
    from kvrs.v1 import router_pb2

    request = router_pb2.GenerateRequest(
        request_id=stream.request_id,
        prompt_token_ids=stream.prompt,
        max_new_tokens=args.max_new_tokens,
    )
    stream.summary, error = await generate_into(router, request, stream.tokens, args.timeout_s)
    if error is not None:
        stream.error = f"{error.code().name}: {error.details()}"


async def _wait_for_workers(state, settings, timeout_s: float = 30.0) -> None:
    """Until gossip lists both decode workers alive (they register after their canary)."""
    from services.gossip.client import GossipClient

    client = GossipClient(state.address("gossip"), settings, timeout_s=2.0)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            nodes = await client.list_nodes()
            if (
                sum(1 for n in nodes if n.registration.role == "decode") >= 2
                and sum(1 for n in nodes if n.registration.role == "prefill") >= 1
            ):
                return
            await asyncio.sleep(0.2)
    finally:
        await client.close()


async def _kill_busiest_decode(state, settings, streams, tasks) -> str:
    """Once every stream is under way, kill -9 the decode worker running the most."""
    from kvrs.rpc import open_channel
    from kvrs.v1 import worker_pb2, worker_pb2_grpc

    deadline = time.monotonic() + 60.0
    while min(len(s.tokens) for s in streams) < 5 and time.monotonic() < deadline:
        if all(task.done() for task in tasks):
            break
        await asyncio.sleep(0.002)
    decoders = [r for r in state.processes if r.kind == "decode"]
    running: dict[str, int] = {}
    for record in decoders:
        async with open_channel(record.address, settings) as channel:
            try:
                stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                    worker_pb2.GetWorkerStatsRequest(), timeout=2.0
                )
            except Exception:  # noqa: BLE001 - a worker that does not answer is skipped
                continue
            running[record.name] = stats.running_requests
    victim = max(running, key=lambda name: running[name])
    record = next(r for r in decoders if r.name == victim)
    os.killpg(record.pid, signal.SIGKILL)
    at = {s.request_id: len(s.tokens) for s in streams}
    print(
        f"kill -9 {victim} (pid {record.pid}) with {running[victim]} requests decoding "
        f"on it; tokens streamed so far: {min(at.values())}..{max(at.values())}",
        flush=True,
    )
    return victim


LEGEND = (
    ("REQUEST", "the request's id"),
    ("AT TOKEN", "tokens the client had received when its decode instance died"),
    (
        "ACTION",
        "how it continued: MIGRATE (pull the prompt's KV from its prefill instance), "
        "RECOMPUTE (prefill prompt + generated tokens again on a prefill instance, then pull "
        "it), HYBRID (recompute the first SPLIT tokens on the target while the rest streams "
        "in)",
    ),
    ("TARGET", "the decode instance that took the request over"),
    (
        "PREDICTED s",
        "the chosen option's predicted time from the decision to KV ready on the target",
    ),
    ("MEASURED s", "the same time as measured by the router"),
    ("ERROR %", "|measured - predicted| / measured"),
    (
        "MIGRATE/RECOMPUTE/HYBRID s",
        "each option's predicted time on its best target (- = infeasible or not priced)",
    ),
    ("SPLIT", "HYBRID only: tokens [0, SPLIT) recomputed on the target, the rest migrated"),
    ("SLACK s", "deadline - now - predicted time (- = the request has no deadline)"),
    ("BATCH", "requests planned together with this one (they share links and queues)"),
    ("REASON", "why the scheduler chose this option"),
)
TERM_LEGEND = (
    (
        "wait",
        "queue wait before the compute: at the target (its extend) or, for "
        "RECOMPUTE, at the prefill instance",
    ),
    ("setup", "transfer set-up: the calls, the ticket and the pair before the KV streams"),
    ("stream", "the KV on the wire"),
    ("prefill", "compute from scratch: RECOMPUTE's prefill, HYBRID's recomputed prefix"),
    ("extend", "the target's compute on top of the moved KV (the generated tokens)"),
    ("1st tok", "decision to the first token the new decode instance streamed"),
)


def _best(options, action: int) -> float:
    costs = [o.cost_s for o in options if o.action == action and o.feasible]
    return min(costs) if costs else math.inf


def _seconds(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.4f}"


def _error(predicted_s: float, measured_s: float) -> float:
    from kvrs.learning import relative_error

    return relative_error(predicted_s, measured_s)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def _term_pairs(report) -> dict[str, tuple[float, float]]:
    """(predicted, measured) of each term of one recovery, as the legend names them."""
    p, m = report.predicted_terms, report.measured_terms
    return {
        "wait": (p.source_wait_s + p.target_wait_s, m.source_wait_s + m.target_wait_s),
        "setup": (p.setup_s, m.setup_s),
        "stream": (p.stream_s, m.stream_s),
        "prefill": (p.prefill_s, m.prefill_s),
        "extend": (p.extend_s, m.extend_s),
        "1st tok": (p.first_token_s, m.first_token_s),
    }


def recoveries(streams: list[Stream]) -> list[dict[str, Any]]:
    """Every executed recovery as `--json` writes it (predicted_s / measured_s: decision
    to KV ready on the target; every term predicted and measured)."""
    from kvrs.learning import TERMS

    rows = []
    for stream in streams:
        if stream.summary is None:
            continue
        for report in stream.summary.recoveries:
            action = ACTION_NAMES.get(report.action, "?")
            row: dict[str, Any] = {
                "request_id": stream.request_id,
                "at_token": report.generated_tokens,
                "action": action,
                "target": report.target_instance_id,
                "source": report.source_instance_id,
                "split_tokens": report.split_tokens if report.action == 3 else 0,
                "batch_size": report.batch_size,
                "succeeded": report.succeeded,
                "reason": report.reason,
                "predicted_s": report.predicted_cost_s,
                "measured_s": report.measured_s,
                "error": _error(report.predicted_cost_s, report.measured_s),
                "predicted": {t: getattr(report.predicted_terms, t) for t in TERMS},
                "measured": {t: getattr(report.measured_terms, t) for t in TERMS},
            }
            rows.append(row)
    return rows


def placements(streams: list[Stream]) -> list[dict[str, Any]]:
    """Every placement as `--json` writes it: predicted_s / measured_s = SelectDecode's
    answer to the first decoded token (the KV pull, the decode instance's queue and the
    first token's extend)."""
    return [
        {
            "request_id": s.request_id,
            "target": s.summary.decode_instance_id,
            "predicted_s": s.summary.placement_predicted_s,
            "measured_s": s.summary.placement_measured_s,
            "error": _error(s.summary.placement_predicted_s, s.summary.placement_measured_s),
        }
        for s in streams
        if s.summary is not None and s.summary.placement_measured_s > 0.0
    ]


def _report_placements(streams: list[Stream]) -> None:
    rows = placements(streams)
    if rows:
        errors = [row["error"] for row in rows]
        print(
            f"\nplacements: predicted vs measured time from SelectDecode's answer to the "
            f"first decoded token over {len(rows)} requests: error p50 "
            f"{100 * _quantile(errors, 0.5):.0f} %, p90 {100 * _quantile(errors, 0.9):.0f} %"
        )


def _report(streams: list[Stream], victim: str, max_new_tokens: int) -> None:
    header = [
        "REQUEST",
        "AT TOKEN",
        "ACTION",
        "TARGET",
        "PREDICTED s",
        "MEASURED s",
        "ERROR %",
        "MIGRATE s",
        "RECOMPUTE s",
        "HYBRID s",
        "SPLIT",
        "SLACK s",
        "BATCH",
        "REASON",
    ]
    terms_header = ["REQUEST", *(f"{name} p/m ms" for name, _ in TERM_LEGEND)]
    rows, term_rows, errors = [], [], []
    for stream in streams:
        summary = stream.summary
        if summary is None:
            continue
        for report in summary.recoveries:
            action = ACTION_NAMES.get(report.action, "?")
            if not report.succeeded and report.action != 4:
                action += " (failed)"
            error = _error(report.predicted_cost_s, report.measured_s)
            if report.succeeded:
                errors.append(error)
            rows.append(
                [
                    stream.request_id,
                    str(report.generated_tokens),
                    action,
                    report.target_instance_id or "-",
                    _seconds(report.predicted_cost_s),
                    _seconds(report.measured_s),
                    f"{100 * error:.0f}" if report.succeeded else "-",
                    _seconds(_best(report.options, 1)),
                    _seconds(_best(report.options, 2)),
                    _seconds(_best(report.options, 3)),
                    str(report.split_tokens) if report.action == 3 else "-",
                    _seconds(report.slo_slack_s),
                    str(report.batch_size),
                    report.reason,
                ]
            )
            pairs = _term_pairs(report)
            term_rows.append(
                [
                    stream.request_id,
                    *(f"{1000 * p:.1f}/{1000 * m:.1f}" for p, m in pairs.values()),
                ]
            )
    print(
        f"\nrecoveries after {victim} died (predicted cost per option, best target; "
        "measured = decision to KV ready on the target):"
    )
    if not rows:
        print("  (none: every request had finished before the kill)")
        return
    _table(header, rows)
    if errors:
        print(
            f"  prediction error over {len(errors)} recoveries: "
            f"p50 {100 * _quantile(errors, 0.5):.0f} %, p90 {100 * _quantile(errors, 0.9):.0f} %"
        )
    print("\nthe same recoveries term by term (predicted/measured, ms):")
    _table(terms_header, term_rows)
    print("\ncolumns:")
    for name, meaning in (*LEGEND, *TERM_LEGEND):
        print(f"  {name:<26} {meaning}")
    for stream in streams:
        if stream.error:
            print(f"  {stream.request_id}: {stream.error}")


def _table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


async def _replay(router, streams: list[Stream], args: argparse.Namespace) -> int:
    """Streams every completed prompt again (no failure now); how many match exactly."""
    replays = [
        Stream(f"{s.request_id}-replay", s.prompt)
        for s in streams
        if len(s.tokens) == args.max_new_tokens
    ]
    await asyncio.gather(*(_stream(router, r, args) for r in replays))
    originals = {f"{s.request_id}-replay": s for s in streams}
    return sum(1 for r in replays if r.tokens == originals[r.request_id].tokens)


def _traces(env: dict[str, str], streams: list[Stream]) -> None:
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if not endpoint:
        return
    host = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}").hostname
    print(f"\ntraces: http://{host or 'localhost'}:{JAEGER_UI_PORT}/search?service=kvrs-router")
    for stream in streams:
        if stream.summary is not None and stream.summary.recoveries:
            print(
                f"  {stream.request_id}: http://{host or 'localhost'}:{JAEGER_UI_PORT}"
                f"/trace/{stream.summary.trace_id}"
            )
