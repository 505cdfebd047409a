"""Soak: a local cluster under ~80 % of its capacity, a decode worker killed every minute.

With `--chaos`, every `--fault-every-s` one fault of `bench.chaos.FAULTS` (decode, prefill
or scheduler kill, Redis restart, link flap, CPU-starved worker) is drawn at random from
`--seed` instead, with each worker in a network namespace of its own (where the machine
allows) so a link flap can blackhole its link; a request must then end token-exact, with
the error the recovery policy chose (ABORT, its summary's finish reason "abort"), or be
refused at admission (RESOURCE_EXHAUSTED naming the limit or the deadline it would miss)
— anything else is a failure.

`python -m bench.soak --minutes 10` starts the whole `kvrs up` cluster (private Redis,
gossip, slot broker, cost oracle, two schedulers, two prefill and two decode workers on
the tiny float64 model, prober, router), measures its capacity with closed-loop clients,
then offers Poisson arrivals at `--load` of it through the router. Every `--fault-every-s`
a decode worker gets kill -9 and is started again `--restart-after-s` later, alternating
between the two. Every stream is checked token by token against the same model run here.

Reported: latency p50/p99 (all requests, and those that went through a recovery),
errors (goal: none), each process' RSS at the start and the end of the load, and what
is still held once the load has drained: migration slots at the slot broker and KV on
each worker (goal: nothing but the prober's own payload on each prefill worker). Not a
test: figures depend on the machine; nothing here asserts. The report is also written as
JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import random
import re
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from bench import netns
from bench.chaos import Chaos
from kvrs.cli.launcher import (
    SERVICES,
    ClusterOptions,
    ClusterState,
    Host,
    ServiceSpec,
    Wiring,
    command_line,
    common_env,
    is_running,
    spawn,
    start_cluster,
    stop_cluster,
)
from kvrs.v1 import (
    router_pb2,
    router_pb2_grpc,
    slots_pb2,
    slots_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common import GrpcSettings
from services.common.healthcheck import SERVING, check_health
from services.worker.model import Transformer

DECODE_WORKERS = ("decode-0", "decode-1")
PREFILL_WORKERS = ("prefill-0", "prefill-1")
WORKERS = (*PREFILL_WORKERS, *DECODE_WORKERS)
PROMPTS = 32
"""Distinct prompts the load draws from (their reference continuations are computed once)."""
SOAK_SERVICES = tuple(spec for spec in SERVICES if spec.name != "openai-http")
SHED_FIELDS = ("max_requests_per_decode: ", "deadline_unix_ms: ")
"""The fields the router's admission refusals name."""


# -- the reference model ---------------------------------------------------------------------


@functools.cache
def _model() -> Transformer:
    torch.set_num_threads(1)  # the cluster's processes share the machine's cores
    return Transformer.load("tiny")


@functools.cache
def reference(prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """The undisturbed greedy continuation, computed in this process."""
    return tuple(_model().complete(prompt, max_new_tokens))


def prompt(index: int, tokens: int) -> tuple[int, ...]:
    return tuple((index * 53 + 13 * i) % 251 for i in range(tokens))


# -- requests --------------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: str
    started_s: float
    total_s: float = 0.0
    ttft_s: float = 0.0
    tokens: int = 0
    exact: bool = False
    recovered: bool = False
    actions: list[str] = field(default_factory=list)
    error: str = ""
    shed: bool = False
    """Refused at admission (RESOURCE_EXHAUSTED: the router had its fill of requests, or
    the request's share of the cluster would have finished it past its deadline): a
    clear, chosen end that cost the cluster nothing."""
    aborted: bool = False
    """The recovery policy gave up on it (its summary ends "abort" after an ABORT
    decision): a clear, chosen end. A stream the router ended for want of any recovery
    plan (no instance left, the scheduler unreachable) also ends "abort" but is a failure."""


async def generate(stub, index: int, args: argparse.Namespace, clock_origin_s: float) -> Outcome:
    tokens_in = prompt(index % PROMPTS, args.prompt_tokens)
    request = router_pb2.GenerateRequest(
        request_id=f"soak-{uuid.uuid4().hex[:12]}",
        prompt_token_ids=list(tokens_in),
        max_new_tokens=args.max_new_tokens,
        deadline_unix_ms=int((time.time() + args.deadline_s) * 1000) if args.deadline_s else 0,
    )
    started_s = time.monotonic()
    outcome = Outcome(request.request_id, started_s - clock_origin_s)
    streamed: list[int] = []
    try:
        async for message in stub.Generate(request, timeout=args.request_timeout_s):
            if message.index >= 0:
                if not streamed:
                    outcome.ttft_s = time.monotonic() - started_s
                streamed.append(message.token_id)
            if message.HasField("summary"):
                outcome.recovered = bool(message.summary.recoveries)
                outcome.actions = [
                    router_pb2.RecoveryReport.DESCRIPTOR.fields_by_name["action"]
                    .enum_type.values_by_number[r.action]
                    .name.removeprefix("RECOVERY_ACTION_")
                    for r in message.summary.recoveries
                ]
                decided = outcome.actions[-1] if outcome.actions else ""
                outcome.aborted = message.summary.finish_reason == "abort" and decided == "ABORT"
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"{exc.code().name}: {exc.details()}"
        outcome.shed = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
            exc.details() or ""
        ).startswith(SHED_FIELDS)
    outcome.total_s = time.monotonic() - started_s
    outcome.tokens = len(streamed)
    outcome.exact = tuple(streamed) == reference(tokens_in, args.max_new_tokens)
    if not outcome.error and not outcome.exact:
        outcome.error = "tokens differ from the undisturbed reference"
    return outcome


async def closed_loop(stub, args, concurrency: int, duration_s: float) -> float:
    """Completed requests per second with `concurrency` clients each one request at a time."""
    stop_s = time.monotonic() + duration_s
    done = 0

    async def client(offset: int) -> None:
        nonlocal done
        turn = 0
        while time.monotonic() < stop_s:
            outcome = await generate(stub, offset + turn * concurrency, args, 0.0)
            turn += 1
            if not outcome.error:
                done += 1

    started_s = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done / (time.monotonic() - started_s)


# -- processes -------------------------------------------------------------------------------


def _with_env(spec: ServiceSpec, args: argparse.Namespace) -> ServiceSpec:
    """Workers heartbeat with `--heartbeat-ttl-s`: how soon a killed one is noticed, and
    how late a starved one may be before it is (falsely) declared failed. The router sheds
    requests beyond `--max-requests-per-decode` for each alive decode instance, and with
    `--deadline-admission` those it would finish past their deadline; a request that
    finds no instance to use waits `--instance-wait-s` for one."""
    if spec.kind in ("prefill", "decode"):
        extra = {"WORKER_HEARTBEAT_TTL_S": str(args.heartbeat_ttl_s)}
    elif spec.name == "router":
        extra = {
            "ROUTER_MAX_REQUESTS_PER_DECODE": str(args.max_requests_per_decode),
            "ROUTER_DEADLINE_ADMISSION": "1" if args.deadline_admission else "0",
            "ROUTER_INSTANCE_WAIT_S": str(args.instance_wait_s),
        }
    else:
        return spec
    base = spec.env
    return dataclasses.replace(spec, env=lambda wiring: {**base(wiring), **extra})


def rss_bytes(pid: int) -> int:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def process_rss(state: ClusterState) -> dict[str, int]:
    return {r.name: rss_bytes(r.pid) for r in state.processes if is_running(r)}


class Supervisor:
    """Kills and restarts cluster processes like a crash and a redeploy."""

    def __init__(
        self, state: ClusterState, options: ClusterOptions, specs: tuple[ServiceSpec, ...]
    ) -> None:
        self.state = state
        self.options = options
        self.specs = {spec.name: spec for spec in specs}
        self.restarted: set[str] = set()

    def record(self, name: str):
        return next(r for r in self.state.processes if r.name == name)

    def kill(self, name: str) -> None:
        record = self.record(name)
        os.killpg(record.pid, signal.SIGKILL)
        while is_running(record):
            time.sleep(0.01)

    async def restart(self, name: str) -> float:
        """Starts `name` again on its address; seconds until it reports SERVING."""
        old = self.record(name)
        wiring = Wiring(
            addresses={r.name: r.address for r in self.state.processes}, options=self.options
        )
        shared = common_env(wiring, None, self.state.redis_url, self.state.redis_prefix)
        spec = self.specs[name]
        env = {
            **shared,
            spec.listen_env: old.address,
            "OTEL_SERVICE_NAME": f"kvrs-{name}",
            **spec.env(wiring),
        }
        record = spawn(
            name,
            spec.kind,
            command_line(spec, wiring),
            spec.module,
            old.address,
            env,
            Path(self.state.run_dir),
        )
        self.state.processes[self.state.processes.index(old)] = record
        self.state.save()
        self.restarted.add(name)
        started_s = time.monotonic()
        while await check_health(record.address, GrpcSettings(), timeout_s=0.5) != SERVING:
            await asyncio.sleep(0.1)
        return time.monotonic() - started_s


# -- the soak ----------------------------------------------------------------------------------


async def held_at_the_end(state: ClusterState) -> dict[str, dict]:
    held: dict[str, dict] = {}
    async with grpc.aio.insecure_channel(state.address("slot-broker")) as channel:
        stats = await slots_pb2_grpc.SlotBrokerServiceStub(channel).GetSlotStats(
            slots_pb2.GetSlotStatsRequest(), timeout=5
        )
    held["slot-broker"] = {
        "slots_in_use": stats.slots_in_use,
        "granted_total": stats.granted_total,
        "expired_total": stats.expired_total,
        "spares_lapsed_total": stats.spares_lapsed_total,
    }
    for name in WORKERS:
        async with grpc.aio.insecure_channel(state.address(name)) as channel:
            stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                worker_pb2.GetWorkerStatsRequest(), timeout=5
            )
        held[name] = {
            "resident_requests": stats.resident_requests,
            "used_kv_bytes": stats.used_kv_bytes,
            "evicted_requests": stats.evicted_requests,
            "expired_requests": stats.expired_requests,
        }
    return held


async def run_load(
    state: ClusterState,
    supervisor: Supervisor,
    args,
    lab: netns.NetnsLab | None = None,
    why_no_lab: str = "",
) -> dict:
    report: dict = {
        "args": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        }
    }
    async with grpc.aio.insecure_channel(state.address("router")) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for index in range(PROMPTS):
            reference(prompt(index, args.prompt_tokens), args.max_new_tokens)
        await closed_loop(stub, args, 2, 3.0)  # warm-up: every worker has served
        capacity = {
            c: await closed_loop(stub, args, c, args.calibrate_s)
            for c in args.calibrate_concurrency
        }
        capacity_rps = max(capacity.values())
        rate_rps = args.load * capacity_rps
        report["capacity_rps"] = {str(c): round(v, 2) for c, v in capacity.items()}
        report["offered_rps"] = round(rate_rps, 2)
        print(
            f"capacity {capacity_rps:.1f} req/s (closed loop {report['capacity_rps']}); "
            f"offering {rate_rps:.1f} req/s for {args.minutes} min",
            flush=True,
        )

        rss_start = process_rss(state)
        origin_s = time.monotonic()
        end_s = origin_s + 60.0 * args.minutes
        rng = random.Random(args.seed)
        tasks: list[asyncio.Task] = []
        faults: list[dict] = []

        async def inject_chaos() -> None:
            chaos = Chaos(
                supervisor,
                random.Random(args.seed + 1),
                args.restart_after_s,
                lab,
                why_no_lab,
            )
            turn = 0
            while True:
                next_s = origin_s + args.first_fault_s + turn * args.fault_every_s
                if next_s >= end_s:
                    return
                await asyncio.sleep(max(0.0, next_s - time.monotonic()))
                turn += 1
                at_s = time.monotonic() - origin_s
                record = {"at_s": round(at_s, 1), **await chaos.inject_one()}
                faults.append(record)
                print(f"  t={at_s:5.0f}s {json.dumps(record)}", flush=True)

        async def inject() -> None:
            turn = 0
            while True:
                next_s = origin_s + args.first_fault_s + turn * args.fault_every_s
                if next_s >= end_s:
                    return
                await asyncio.sleep(next_s - time.monotonic())
                victim = DECODE_WORKERS[turn % len(DECODE_WORKERS)]
                turn += 1
                await asyncio.to_thread(supervisor.kill, victim)
                killed_at_s = time.monotonic() - origin_s
                await asyncio.sleep(args.restart_after_s)
                serving_after_s = await supervisor.restart(victim)
                faults.append(
                    {
                        "victim": victim,
                        "killed_at_s": round(killed_at_s, 1),
                        "serving_again_after_s": round(args.restart_after_s + serving_after_s, 1),
                    }
                )
                print(
                    f"  t={killed_at_s:5.0f}s kill -9 {victim}; serving again "
                    f"{args.restart_after_s + serving_after_s:.1f} s later",
                    flush=True,
                )

        injector = asyncio.create_task(inject_chaos() if args.chaos else inject())
        index = 0
        next_arrival_s = origin_s
        while next_arrival_s < end_s:
            await asyncio.sleep(max(0.0, next_arrival_s - time.monotonic()))
            tasks.append(asyncio.create_task(generate(stub, index, args, origin_s)))
            index += 1
            next_arrival_s += rng.expovariate(rate_rps)
        outcomes: list[Outcome] = await asyncio.gather(*tasks)
        await injector
        rss_end = process_rss(state)
        await asyncio.sleep(args.drain_s)  # leases and slots of the last requests settle
        report["held_at_end"] = await held_at_the_end(state)

    report["faults"] = faults
    report["declared_failed"] = declared_failed(state)
    report["requests"] = summarise(outcomes)
    report["rss_bytes"] = {
        name: {
            "start": rss_start.get(name, 0),
            "end": rss_end.get(name, 0),
            "restarted": name in supervisor.restarted,
        }
        for name in sorted(set(rss_start) | set(rss_end))
    }
    return report


def declared_failed(state: ClusterState) -> dict[str, int]:
    """Failure declarations per instance, from gossip's log and the workers' own (a worker
    that finds itself declared failed re-registers): more than the kills = false alarms."""
    counts: dict[str, int] = {}
    logs = Path(state.run_dir) / "logs"
    for name in WORKERS:
        try:
            text = (logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            continue
        counts[name] = text.count("re-registered after being declared failed")
    try:
        gossip = (logs / "gossip.log").read_text(errors="replace")
    except OSError:
        gossip = ""
    # "instance X failed: <why>": its confirmation window ran out, or the direct probe
    # found nothing listening at its address.
    for line in gossip.splitlines():
        if " failed: " in line and "instance " in line:
            name = line.split("instance ", 1)[1].split(" ", 1)[0]
            counts[f"{name} (gossip)"] = counts.get(f"{name} (gossip)", 0) + 1
    return counts


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarise(outcomes: list[Outcome]) -> dict:
    ok = [o for o in outcomes if not o.error]
    aborted = [o for o in outcomes if o.error and o.aborted]
    recovered = [o for o in ok if o.recovered]
    actions: dict[str, int] = {}
    for outcome in recovered:
        final = outcome.actions[-1] if outcome.actions else "?"
        actions[final] = actions.get(final, 0) + 1
    errors: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.error:
            # Grouped by kind: request ids and measured figures vary from one to the next.
            key = re.sub(r"soak-[0-9a-f]+", "<request>", outcome.error)
            key = re.sub(r"(?<![\w-])-?\d+(\.\d+)?", "#", key)[:160]
            errors[key] = errors.get(key, 0) + 1

    def latency(group: list[Outcome]) -> dict:
        return {
            "count": len(group),
            "p50_s": round(_percentile([o.total_s for o in group], 50), 4),
            "p99_s": round(_percentile([o.total_s for o in group], 99), 4),
            "ttft_p50_s": round(_percentile([o.ttft_s for o in group], 50), 4),
            "ttft_p99_s": round(_percentile([o.ttft_s for o in group], 99), 4),
        }

    return {
        "sent": len(outcomes),
        "completed_exact": sum(o.exact for o in outcomes),
        "aborted_by_policy": len(aborted),
        "shed_at_admission": sum(o.shed for o in outcomes),
        "unexpected_errors": sum(1 for o in outcomes if o.error and not (o.aborted or o.shed)),
        "errors": errors,
        "all": latency(ok),
        "undisturbed": latency([o for o in ok if not o.recovered]),
        "recovered": latency(recovered),
        "recovery_final_actions": actions,
    }


def print_report(report: dict) -> None:
    requests = report["requests"]
    print(
        f"\nrequests: {requests['sent']} sent, {requests['completed_exact']} completed "
        f"token-exact, {requests['aborted_by_policy']} aborted by the recovery policy, "
        f"{requests['shed_at_admission']} shed at admission, "
        f"{requests['unexpected_errors']} other errors; errors {requests['errors'] or 'none'}"
    )
    for group in ("all", "undisturbed", "recovered"):
        figures = requests[group]
        print(
            f"  {group:12s} n={figures['count']:5d}  p50 {figures['p50_s'] * 1000:7.0f} ms  "
            f"p99 {figures['p99_s'] * 1000:7.0f} ms  TTFT p50 "
            f"{figures['ttft_p50_s'] * 1000:6.0f} ms  p99 {figures['ttft_p99_s'] * 1000:6.0f} ms"
        )
    print(f"  recoveries by final action: {requests['recovery_final_actions']}")
    print("memory (RSS start -> end of the load):")
    for name, rss in report["rss_bytes"].items():
        note = "  (restarted during the run)" if rss["restarted"] else ""
        growth = rss["end"] - rss["start"]
        print(
            f"  {name:12s} {rss['start'] / 2**20:7.1f} -> {rss['end'] / 2**20:7.1f} MiB "
            f"({growth / 2**20:+.1f}){note}"
        )
    print(f"held after the drain: {json.dumps(report['held_at_end'])}")
    print(
        f"kills: {len(report['faults'])}; failure declarations: "
        f"{json.dumps(report['declared_failed'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.8, help="share of measured capacity")
    parser.add_argument(
        "--chaos", action="store_true", help="random faults of bench.chaos, not only decode kills"
    )
    parser.add_argument("--fault-every-s", type=float, default=60.0)
    parser.add_argument("--first-fault-s", type=float, default=30.0)
    parser.add_argument("--restart-after-s", type=float, default=5.0)
    parser.add_argument(
        "--max-requests-per-decode",
        type=int,
        default=0,
        help="the router's admission limit per alive decode instance (0: none, every "
        "request queues)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=0.0,
        help="each request's deadline, from when it is sent (0: none); the recovery policy "
        "ABORTs against it",
    )
    parser.add_argument(
        "--deadline-admission",
        action="store_true",
        help="the router refuses at once a request it would finish past its deadline "
        "(ROUTER_DEADLINE_ADMISSION)",
    )
    parser.add_argument(
        "--instance-wait-s",
        type=float,
        default=5.0,
        help="how long a request with no instance to use waits for one (ROUTER_INSTANCE_WAIT_S)",
    )
    parser.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        default=2.0,
        help="workers' heartbeat TTL (the gossip default is 2 s)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--calibrate-s", type=float, default=10.0)
    parser.add_argument("--calibrate-concurrency", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--drain-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/soak"))
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
    # Chaos flaps links: each worker then runs in a network namespace of its own, the
    # control plane on the namespaces' bridge.
    why_no_lab = netns.available() if args.chaos else "not a chaos run"
    lab = None if why_no_lab else netns.NetnsLab(WORKERS).start()
    if lab is not None:
        hosts = {name: Host(lab.ips[name], lab.exec_prefix(name)) for name in WORKERS}
        options = dataclasses.replace(options, host=lab.host_ip, hosts=hosts)
    services = tuple(_with_env(spec, args) for spec in SOAK_SERVICES)
    try:
        started_s = time.monotonic()
        state = start_cluster(options, services)
        print(
            f"cluster up in {time.monotonic() - started_s:.1f} s: "
            f"{', '.join(r.name for r in state.processes)}"
            f"{'' if lab is None else ', workers in network namespaces'}",
            flush=True,
        )
        try:
            supervisor = Supervisor(state, options, services)
            report = asyncio.run(run_load(state, supervisor, args, lab, why_no_lab))
        finally:
            stop_cluster(options.run_dir, grace_s=5.0)
    finally:
        if lab is not None:
            lab.stop()
    print_report(report)
    out = args.out or args.run_dir / f"soak-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
