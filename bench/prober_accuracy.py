"""The prober's estimate on shaped links: how close after 1, 2 and 3 probes.

    python -m bench.prober_accuracy [--rates 1,5,10] [--probes 3] [--mode auto|netns|pacing]

netns (needs root): two network namespaces joined by a veth pair whose sending side
carries `tc qdisc ... root tbf rate <R>gbit burst 256kb latency 50ms`; a prefill worker
runs in the first, a decode worker in the second, and the prober (the service's own
LinkProber over the workers' PullKv) runs in the second, so every probe byte crosses the
shaped veth exactly as a KV would. pacing (no namespaces): both workers on loopback, the
probes paced by libkvxfer at R. Workers run opt-125m (bf16): a 2048-token payload is
75 MB, so one pull at 10 Gbit/s lasts 60 ms.

Printed per rate: the estimate after each probe, its error against the shaping rate and
against a bulk transfer's goodput on the same path (four back-to-back full-payload pulls,
timed on the wire), and the probing time each probe cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.checkpoints import opt_125m
from bench.report import add_json_argument, write_json

NS_SRC, NS_DST = "kvrsbenchA", "kvrsbenchB"
VETH_SRC, VETH_DST = "kvbA", "kvbB"
IP_SRC, IP_DST = "10.78.0.1", "10.78.0.2"
SRC_PORT, DST_PORT = 50170, 50171
ROOT = Path(__file__).resolve().parent.parent


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    try:
        sh("ip", "netns", "add", "kvrsprobe")
    except subprocess.CalledProcessError:
        return False
    sh("ip", "netns", "del", "kvrsprobe")
    return True


def teardown_netns() -> None:
    for ns in (NS_SRC, NS_DST):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def setup_netns(rate_gbps: float) -> None:
    teardown_netns()
    sh("ip", "netns", "add", NS_SRC)
    sh("ip", "netns", "add", NS_DST)
    sh(
        "ip",
        "link",
        "add",
        VETH_SRC,
        "netns",
        NS_SRC,
        "type",
        "veth",
        "peer",
        "name",
        VETH_DST,
        "netns",
        NS_DST,
    )
    for ns, dev, ip in ((NS_SRC, VETH_SRC, IP_SRC), (NS_DST, VETH_DST, IP_DST)):
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh(
        "ip",
        "netns",
        "exec",
        NS_SRC,
        "tc",
        "qdisc",
        "add",
        "dev",
        VETH_SRC,
        "root",
        "tbf",
        "rate",
        f"{rate_gbps:g}gbit",
        "burst",
        "256kb",
        "latency",
        "50ms",
    )


def start_worker(
    name: str, role: str, ip: str, port: int, ns: str | None, log_dir: Path
) -> subprocess.Popen:
    env = {
        **os.environ,
        "WORKER_INSTANCE_ID": name,
        "WORKER_LISTEN_ADDR": f"{ip}:{port}",
        "WORKER_ADVERTISE_ADDR": f"{ip}:{port}",
        "WORKER_TRANSFER_HOST": ip,
        "WORKER_MODEL": opt_125m(),
        "WORKER_KV_CAPACITY_BYTES": str(2 << 30),
        "GOSSIP_ADDR": "",
        "PYTHONUNBUFFERED": "1",
    }
    prefix = ["ip", "netns", "exec", ns] if ns else []
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the worker
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "services.worker", "--role", role],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def measure(src: str, dst: str, probes: int, pacing_bps: float, ns: str | None) -> dict:
    """Runs the measuring side (in the receiver's namespace) and returns its report."""
    prefix = ["ip", "netns", "exec", ns] if ns else []
    command = [
        *prefix,
        sys.executable,
        "-m",
        "bench.prober_accuracy",
        "--inner",
        "--src",
        src,
        "--dst",
        dst,
        "--probes",
        str(probes),
        "--pacing-bps",
        str(pacing_bps),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, check=False, timeout=600
    )
    if result.returncode != 0:
        raise RuntimeError(f"measurement failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


async def inner(src_addr: str, dst_addr: str, probes: int, pacing_bps: float) -> dict:
    """In the receiver's namespace: wait for both workers, probe, then a bulk transfer."""
    from services.common import GrpcSettings
    from services.common.healthcheck import SERVING, check_health
    from services.prober.probing import LinkProber, ProbeSettings, payload_id
    from services.prober.transport import WorkerTransport
    from services.worker.client import Endpoint, WorkerPool

    deadline = time.monotonic() + 300
    for address in (src_addr, dst_addr):
        while await check_health(address, GrpcSettings(), timeout_s=1.0) != SERVING:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker at {address} did not start")
            await asyncio.sleep(0.5)

    class Collect:
        async def report_link_sample(self, sample) -> None:
            return None

    pool = WorkerPool(GrpcSettings(), None, timeout_s=300)
    settings = ProbeSettings(pacing_bps=pacing_bps)
    prober = LinkProber(WorkerTransport(pool), Collect(), settings)
    src, dst = Endpoint("prefill-a", src_addr), Endpoint("decode-b", dst_addr)
    rounds = []
    for _ in range(probes):
        started = time.monotonic()
        state = await prober.probe(src, dst)
        rounds.append(
            {
                "estimate_bps": state.estimate.bandwidth_bps,
                "sample_bps": state.sample_bps,
                "rtt_s": state.rtt_s,
                "probe_bytes": state.probe_bytes,
                "probe_s": time.monotonic() - started,
            }
        )
    kv_id = payload_id(src.instance_id)
    wire_s, moved = 0.0, 0
    for _ in range(4):
        pulled = await pool.pull_kv(
            dst,
            kv_id,
            src,
            0,
            settings.payload_tokens,
            settings.payload_tokens,
            pacing_bps=pacing_bps,
        )
        await pool.release_kv(dst, kv_id)
        # Net of the per-transfer cost the prober found, as the cost model prices it.
        wire_s += pulled.transfer_s - state.rtt_s
        moved += pulled.kv_bytes
    await pool.close()
    return {"rounds": rounds, "bulk_bps": 8 * moved / wire_s}


def report(rate_gbps: float, result: dict) -> tuple[float, float]:
    rate_bps = rate_gbps * 1e9
    bulk = result["bulk_bps"]
    print(
        f"\nlink shaped to {rate_gbps:g} Gbit/s; bulk KV transfer achieves {bulk / 1e9:.3f} Gbit/s"
    )
    print(
        f"  {'probe':>5}  {'estimate Gb/s':>13}  {'sample Gb/s':>11}  {'vs shaping':>10}  "
        f"{'vs bulk':>8}  {'rtt ms':>7}  {'probe MB':>8}  {'probe s':>7}"
    )
    last_errors = (0.0, 0.0)
    for i, r in enumerate(result["rounds"], 1):
        vs_rate = r["estimate_bps"] / rate_bps - 1
        vs_bulk = r["estimate_bps"] / bulk - 1
        last_errors = (vs_rate, vs_bulk)
        print(
            f"  {i:>5}  {r['estimate_bps'] / 1e9:>13.3f}  {r['sample_bps'] / 1e9:>11.3f}  "
            f"{vs_rate:>+10.1%}  {vs_bulk:>+8.1%}  {r['rtt_s'] * 1e3:>7.1f}  "
            f"{r['probe_bytes'] / 1e6:>8.1f}  {r['probe_s']:>7.2f}"
        )
    return last_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prober_accuracy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rates", default="1,5,10", help="link rates in Gbit/s")
    parser.add_argument("--probes", type=int, default=3)
    parser.add_argument("--mode", choices=("auto", "netns", "pacing"), default="auto")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    parser.add_argument("--pacing-bps", type=float, default=0.0, help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.inner:
        print(json.dumps(asyncio.run(inner(args.src, args.dst, args.probes, args.pacing_bps))))
        return 0
    mode = args.mode
    if mode == "auto":
        mode = "netns" if netns_available() else "pacing"
    how = (
        "tc tbf on a veth pair between two network namespaces"
        if mode == "netns"
        else "libkvxfer pacing on loopback (network namespaces unavailable)"
    )
    print(f"shaping by {how}")
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "kvrs-prober-accuracy"
    log_dir.mkdir(parents=True, exist_ok=True)
    worst = worst_bulk = 0.0
    figures: dict = {"shaping": mode, "probes": args.probes, "links": []}
    for rate_gbps in (float(x) for x in args.rates.split(",")):
        workers: list[subprocess.Popen] = []
        try:
            if mode == "netns":
                setup_netns(rate_gbps)
                workers.append(
                    start_worker("prefill-a", "prefill", IP_SRC, SRC_PORT, NS_SRC, log_dir)
                )
                workers.append(
                    start_worker("decode-b", "decode", IP_DST, DST_PORT, NS_DST, log_dir)
                )
                result = measure(
                    f"{IP_SRC}:{SRC_PORT}", f"{IP_DST}:{DST_PORT}", args.probes, 0.0, NS_DST
                )
            else:
                workers.append(
                    start_worker("prefill-a", "prefill", "127.0.0.1", SRC_PORT, None, log_dir)
                )
                workers.append(
                    start_worker("decode-b", "decode", "127.0.0.1", DST_PORT, None, log_dir)
                )
                result = measure(
                    f"127.0.0.1:{SRC_PORT}",
                    f"127.0.0.1:{DST_PORT}",
                    args.probes,
                    rate_gbps * 1e9,
                    None,
                )
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                try:
                    worker.wait(10)
                except subprocess.TimeoutExpired:
                    worker.kill()
            if mode == "netns":
                teardown_netns()
        vs_rate, vs_bulk = report(rate_gbps, result)
        figures["links"].append(
            {
                "rate_bps": rate_gbps * 1e9,
                **result,
                "last_vs_rate": vs_rate,
                "last_vs_bulk": vs_bulk,
            }
        )
        worst, worst_bulk = max(worst, abs(vs_rate)), max(worst_bulk, abs(vs_bulk))
    print(
        f"\nworst error after {args.probes} probes: {worst:.1%} against the shaping rate, "
        f"{worst_bulk:.1%} against what a bulk KV transfer achieves on the same path "
        "(goal: within 10 %; where libkvxfer cannot fill the link, the bulk rate is the "
        "one T_x needs)"
    )
    figures.update(worst_vs_rate=worst, worst_vs_bulk=worst_bulk)
    write_json(args.json, "prober_accuracy", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
