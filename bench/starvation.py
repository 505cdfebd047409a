"""Starvation: do CPU-starved or briefly stopped workers cost their streams? Does a kill still?

`python -m bench.starvation` starts a local cluster (private Redis, gossip, slot broker,
cost oracle, one scheduler, two prefill and two decode tiny float64 workers, router) and
keeps `--concurrency` closed-loop streams running through the router for the whole run,
every one checked token by token against the same model run here. Three phases, in order:

1. `--busy-loops` processes spinning `while 1: pass` for `--busy-s` seconds (four on two
   cores starve every process of the cluster, workers included);
2. a decode worker SIGSTOPped for `--stop-ttls` heartbeat TTLs, then SIGCONTed;
3. the other decode worker killed with SIGKILL (a real death).

Reported per phase: gossip's failure declarations and suspicions (from its event stream),
recoveries the router ran (from the streams' summaries, attributed to the phase whose
victim they name: a recovery in phases 1 and 2 is needless, nothing died), the reasons
the router logged, streams that were not token-exact; for the kill, the longest silence
the streams decoding there saw from the kill on. Not a test: nothing here asserts; the
report is printed and written as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis

from bench.soak import reference
from kvrs.cli.launcher import SERVICES, ClusterOptions, ClusterState, start_cluster, stop_cluster
from kvrs.v1 import router_pb2, router_pb2_grpc

CLUSTER = (
    "gossip",
    "slot-broker",
    "cost-oracle",
    "scheduler-1",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "router",
)


@dataclass
class Stream:
    """One request as the client saw it: token arrival times, recoveries, exactness."""

    started_s: float
    token_s: list[float] = field(default_factory=list)
    recoveries: list[tuple[str, str]] = field(default_factory=list)
    """(failed instance, detected_by) per recovery."""
    decode_instance_id: str = ""
    exact: bool = False
    error: str = ""


def prompt(index: int, tokens: int) -> tuple[int, ...]:
    return tuple((index * 29 + 7 * i) % 251 for i in range(tokens))


async def one_stream(stub, index: int, args, origin_s: float) -> Stream:
    tokens_in = prompt(index % 16, args.prompt_tokens)
    request = router_pb2.GenerateRequest(
        request_id=f"starve-{uuid.uuid4().hex[:12]}",
        prompt_token_ids=list(tokens_in),
        max_new_tokens=args.max_new_tokens,
    )
    stream = Stream(time.monotonic() - origin_s)
    streamed: list[int] = []
    try:
        async for message in stub.Generate(request, timeout=120):
            if message.index >= 0:
                streamed.append(message.token_id)
                stream.token_s.append(time.monotonic() - origin_s)
            if message.HasField("summary"):
                stream.decode_instance_id = message.summary.decode_instance_id
                stream.recoveries = [
                    (r.failed_instance_id, r.detected_by) for r in message.summary.recoveries
                ]
    except grpc.aio.AioRpcError as exc:
        stream.error = f"{exc.code().name}: {exc.details()}"
    stream.exact = tuple(streamed) == reference(tokens_in, args.max_new_tokens)
    return stream


def gossip_events(state: ClusterState) -> list[dict]:
    """Every membership event gossip wrote, with its Redis time."""
    client = redis.Redis.from_url(state.redis_url)
    try:
        entries = client.xrange(f"{state.redis_prefix}gossip:events")
    finally:
        client.close()
    return [{k.decode(): v.decode() for k, v in raw.items()} for _, raw in entries]


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def record_pid(state: ClusterState, name: str) -> int:
    return next(r.pid for r in state.processes if r.name == name)


async def run(state: ClusterState, args) -> dict:
    origin_s = time.monotonic()
    origin_unix_ms = time.time() * 1000
    streams: list[Stream] = []
    phases: list[dict] = []
    stop = asyncio.Event()

    async with grpc.aio.insecure_channel(state.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for index in range(16):
            reference(prompt(index, args.prompt_tokens), args.max_new_tokens)

        async def client(offset: int) -> None:
            turn = 0
            while not stop.is_set():
                streams.append(await one_stream(stub, offset + 7 * turn, args, origin_s))
                turn += 1

        clients = [asyncio.create_task(client(i)) for i in range(args.concurrency)]

        def mark(name: str, start_s: float, **extra) -> None:
            phases.append({"phase": name, "start_s": start_s, "end_s": now(), **extra})

        def now() -> float:
            return time.monotonic() - origin_s

        await asyncio.sleep(args.warmup_s)
        start_s = now()
        loops = busy_loops(args.busy_loops)
        try:
            await asyncio.sleep(args.busy_s)
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        await asyncio.sleep(args.settle_s)
        mark("busy", start_s, busy_loops=args.busy_loops, busy_s=args.busy_s)

        start_s = now()
        stopped = record_pid(state, "decode-0")
        stop_s = args.stop_ttls * args.heartbeat_ttl_s
        os.kill(stopped, signal.SIGSTOP)
        try:
            await asyncio.sleep(stop_s)
        finally:
            os.kill(stopped, signal.SIGCONT)
        await asyncio.sleep(args.settle_s)
        mark("sigstop", start_s, stopped="decode-0", stopped_s=stop_s)

        start_s = now()
        killed = record_pid(state, "decode-1")
        os.killpg(killed, signal.SIGKILL)
        kill_s = now()
        await asyncio.sleep(args.settle_s)
        stop.set()
        await asyncio.gather(*clients)
        mark("kill", start_s, killed="decode-1", kill_s=kill_s)

    events = gossip_events(state)
    router_log = Path(state.run_dir) / "logs" / "router.log"
    recovering = [
        line.split(" lost (", 1)[1]
        for line in router_log.read_text(errors="replace").splitlines()
        if " recovering " in line and " lost (" in line
    ]
    report: dict = {"args": vars(args), "phases": []}
    for phase in phases:
        lo, hi = phase["start_s"], phase["end_s"]
        lo_ms, hi_ms = origin_unix_ms + lo * 1000, origin_unix_ms + hi * 1000
        in_phase = [e for e in events if lo_ms <= int(e["unix_ms"]) < hi_ms]
        touched = [s for s in streams if s.token_s and s.token_s[-1] >= lo and s.started_s < hi]
        # A recovery belongs to the phase whose victim it names; in the busy phase nobody
        # is a victim, so every recovery of a stream that ended within it counts.
        victim = phase.get("stopped") or phase.get("killed")
        if victim:
            blamed = [(s, [r for r in s.recoveries if r[0] == victim]) for s in touched]
        else:
            blamed = [(s, s.recoveries) for s in touched if s.token_s[-1] < hi]
        recovered = [(s, r) for s, r in blamed if r]
        entry = {
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in phase.items()},
            "streams": len(touched),
            "not_exact": sum(not s.exact for s in touched),
            "errors": sorted({s.error for s in touched if s.error}),
            "streams_recovered": len(recovered),
            "recoveries": sum(len(r) for _, r in recovered),
            "detected_by": sorted({d for _, r in recovered for _, d in r}),
            "gossip_failed": [e["instance_id"] for e in in_phase if e["type"] == "failed"],
            "gossip_suspect": [e["instance_id"] for e in in_phase if e["type"] == "suspect"],
        }
        if phase["phase"] == "kill":
            kill_s = phase["kill_s"]
            gaps = []
            for s in touched:
                decoding = sum(t <= kill_s for t in s.token_s) >= 2  # token 0: prefill
                if not decoding or not any(f == "decode-1" for f, _ in s.recoveries):
                    continue
                # The stall the recovery caused: the longest silence from the kill on.
                times = [kill_s, *(t for t in s.token_s if t > kill_s)]
                if len(times) > 1:
                    gaps.append(max(b - a for a, b in zip(times, times[1:], strict=False)))
            entry["resumed_streams"] = len(gaps)
            if gaps:
                entry["longest_stall_after_kill_s"] = {
                    "median": round(statistics.median(gaps), 3),
                    "max": round(max(gaps), 3),
                }
        report["phases"].append(entry)
    report["router_recovery_reasons"] = sorted(set(recovering))[:20]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-loops", type=int, default=4)
    parser.add_argument("--busy-s", type=float, default=60.0)
    parser.add_argument("--stop-ttls", type=float, default=1.8)
    parser.add_argument("--heartbeat-ttl-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--settle-s", type=float, default=8.0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/starvation"))
    parser.add_argument(
        "--json",
        "--out",
        dest="out",
        metavar="FILE",
        type=Path,
        default=None,
        help="JSON report with every printed figure (default: in the run dir)",
    )
    args = parser.parse_args(argv)

    options = ClusterOptions(
        run_dir=args.run_dir / "cluster", workers_model="tiny", startup_timeout_s=180
    )
    ttl = {"WORKER_HEARTBEAT_TTL_S": str(args.heartbeat_ttl_s)}

    def with_ttl(spec):
        if spec.kind not in ("prefill", "decode"):
            return spec
        base = spec.env
        return dataclasses.replace(spec, env=lambda wiring: {**base(wiring), **ttl})

    services = tuple(with_ttl(s) for s in SERVICES if s.name in CLUSTER)
    state = start_cluster(options, services)
    try:
        report = asyncio.run(run(state, args))
    finally:
        stop_cluster(options.run_dir, grace_s=5.0)
    report["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    text = json.dumps(report, indent=2)
    print(text)
    out = args.out or args.run_dir / f"starvation-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
