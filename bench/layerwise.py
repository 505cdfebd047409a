"""Layer-wise streaming: time to KV ready on the decode worker when the KV streams while
the prompt prefills, against prefill alone and transfer alone, over a tc-shaped link.

    python -m bench.layerwise [--model DIR|tiny] [--prompt-tokens 2048]
                              [--rates 1gbit,10gbit] [--repeats 3] [--json FILE]

A prefill worker and a decode worker run as real processes, each in its own network
namespace on one bridge (`bench.netns`, needs root, ip and tc); the traffic into the
decode worker's namespace is shaped with tc (tbf) to each rate in turn. Per rate, in
interleaved rounds (medians; load on a shared machine drifts), one prompt each time:

- prefill alone: the Prefill RPC;
- transfer alone: the decode worker's PullKv of a finished prefill's KV;
- after the prefill: Prefill, then PullKv (what a router without streaming does);
- streamed: Prefill and PullKv(while_prefilling) sent together: each layer crosses the
  link as soon as the prefill has computed it (the prefill's own time in this run is
  reported too: on a machine with few cores the transfer's work slows it).

Each time ends when the KV is resident on the decode worker (its first decode step can
run). The goal is streamed ≤ 1.15 × max(prefill alone, transfer alone). The default
model is the OPT-125m-shaped checkpoint of `bench.checkpoints` (12 layers, bf16: 36 KiB
of KV a token), so a 2,048-token prompt moves 72 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.checkpoints import opt_125m
from bench.netns import NetnsLab, available
from bench.report import add_json_argument, write_json
from kvrs.rpc import GrpcSettings, check_health, open_channel
from kvrs.v1 import worker_pb2 as pb
from kvrs.v1 import worker_pb2_grpc

WORKER_PORT = 50060
GOAL_RATIO = 1.15
ROLES = {"prefill-0": "prefill", "decode-0": "decode"}


def _start_workers(lab: NetnsLab, model: str, log_dir: Path) -> list[subprocess.Popen]:
    processes = []
    for name, role in ROLES.items():
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "WORKER_INSTANCE_ID": name,
            "WORKER_ROLE": role,
            "WORKER_LISTEN_ADDR": f"0.0.0.0:{WORKER_PORT}",
            "WORKER_ADVERTISE_ADDR": f"{lab.ips[name]}:{WORKER_PORT}",
            "WORKER_TRANSFER_HOST": lab.ips[name],
            "WORKER_TRANSFER_TIMEOUT_S": "120",
            "KVRS_MODEL": model,
            "KVRS_LOG_LEVEL": "WARNING",
        }
        env.pop("GOSSIP_ADDR", None)
        with open(log_dir / f"{name}.log", "ab") as log:
            processes.append(
                subprocess.Popen(
                    [*lab.exec_prefix(name), sys.executable, "-m", "services.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return processes


async def _wait_serving(addresses: list[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        while await check_health(address, GrpcSettings(), timeout_s=1.0) != "SERVING":
            if time.monotonic() > deadline:
                raise SystemExit(f"worker at {address} not serving after {timeout_s} s")
            await asyncio.sleep(0.5)


class _Round:
    """The four measurements of one prompt, each on a fresh request id."""

    def __init__(self, prefill, decode, prefill_addr: str, prompt: list[int]) -> None:
        self.prefill = prefill
        self.decode = decode
        self.prefill_addr = prefill_addr
        self.prompt = prompt
        self._count = 0

    def _id(self, kind: str) -> str:
        self._count += 1
        return f"{kind}-{os.getpid()}-{time.monotonic_ns()}-{self._count}"

    async def _prefill(self, request_id: str) -> None:
        request = pb.PrefillRequest(request_id=request_id, prompt_token_ids=self.prompt)
        await self.prefill.Prefill(request, timeout=600)

    async def _pull(self, request_id: str, streamed: bool) -> None:
        request = pb.PullKvRequest(
            request_id=request_id,
            source_instance_id="prefill-0",
            source_address=self.prefill_addr,
            token_start=0,
            token_end=len(self.prompt),
            while_prefilling=streamed,
        )
        await self.decode.PullKv(request, timeout=600)

    async def _release(self, request_id: str) -> None:
        for stub in (self.prefill, self.decode):
            await stub.ReleaseKv(pb.ReleaseKvRequest(request_id=request_id), timeout=30)

    async def run(self) -> dict[str, float]:
        seconds = {}
        request_id = self._id("alone")
        started = time.perf_counter()
        await self._prefill(request_id)
        seconds["prefill_s"] = time.perf_counter() - started
        started = time.perf_counter()
        await self._pull(request_id, streamed=False)
        seconds["transfer_s"] = time.perf_counter() - started
        seconds["after_prefill_s"] = seconds["prefill_s"] + seconds["transfer_s"]
        await self._release(request_id)
        request_id = self._id("streamed")
        started = time.perf_counter()

        async def prefill_under_streaming() -> None:
            await self._prefill(request_id)
            seconds["prefill_streamed_s"] = time.perf_counter() - started

        await asyncio.gather(prefill_under_streaming(), self._pull(request_id, streamed=True))
        seconds["streamed_s"] = time.perf_counter() - started
        await self._release(request_id)
        return seconds


async def _measure(args: argparse.Namespace, lab: NetnsLab, model: str) -> dict:
    addresses = {name: f"{lab.ips[name]}:{WORKER_PORT}" for name in ROLES}
    await _wait_serving(list(addresses.values()))
    channels = [open_channel(address, GrpcSettings()) for address in addresses.values()]
    prefill, decode = (worker_pb2_grpc.WorkerServiceStub(channel) for channel in channels)
    vocab = 250
    prompt = [(17 * i + 3) % vocab for i in range(args.prompt_tokens)]
    rounds = _Round(prefill, decode, addresses["prefill-0"], prompt)
    report: dict = {"model": model, "prompt_tokens": args.prompt_tokens, "rates": {}}
    try:
        lab.shape("decode-0", args.rates[0])
        await rounds.run()  # warm-up: the first pass and the pair's first set-up
        for rate in args.rates:
            lab.shape("decode-0", rate)
            runs = [await rounds.run() for _ in range(args.repeats)]
            medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            bound_s = max(medians["prefill_s"], medians["transfer_s"])
            medians["ratio"] = medians["streamed_s"] / bound_s
            medians["after_prefill_ratio"] = medians["after_prefill_s"] / bound_s
            report["rates"][rate] = medians
            print(
                f"{rate}: prefill alone {medians['prefill_s']:.3f} s, transfer alone "
                f"{medians['transfer_s']:.3f} s; KV ready after the prefill "
                f"{medians['after_prefill_s']:.3f} s, streamed {medians['streamed_s']:.3f} s "
                f"(its prefill {medians['prefill_streamed_s']:.3f} s); "
                f"streamed / max(prefill, transfer) ratio {medians['ratio']:.2f} "
                f"(goal <= {GOAL_RATIO}; after the prefill: "
                f"{medians['after_prefill_ratio']:.2f})",
                flush=True,
            )
    finally:
        for channel in channels:
            await channel.close()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="checkpoint (default: OPT-125m shaped)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    args.rates = [rate.strip() for rate in args.rates.split(",") if rate.strip()]
    why_not = available()
    if why_not:
        print(f"bench.layerwise needs network namespaces: {why_not}", file=sys.stderr)
        return 2
    model = args.model or opt_125m()
    lab = NetnsLab(tuple(ROLES)).start()
    processes: list[subprocess.Popen] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvrs-layerwise-") as logs:
            processes = _start_workers(lab, model, Path(logs))
            report = asyncio.run(_measure(args, lab, model))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            if process.poll() is None:
                process.kill()
        lab.stop()
    write_json(args.json, "layerwise", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
