"""Migrate-vs-recompute crossover on real workers, measured against the cost model.

    python -m bench.crossover [--rates 0.1,0.2,0.3] [--lengths 16,32,...,1024] [--repeats 2]

Three opt-125m workers (bf16, as deployed) on loopback: `remote` holds the prompt's KV
(the prefill instance that survived), `local` is a prefill instance next to the target
`decode` (same node: its transfer is unpaced). For each prompt length L:

    MIGRATE   decode pulls [0, L) from remote, paced at the link rate R (libkvxfer pacing)
    RECOMPUTE local prefills L tokens, decode pulls them unpaced

both measured to "KV ready on the target" (the router's recovery time). The base model
prices the same two with `kvrs calibrate`'s profile for T_pf and T_x = rtt + 8 S(L) / rate,
with rtt and the local rate measured here, R the pacing rate: what the prober would
publish. The corrected model is the base model with `kvrs.learning` corrections fitted
from a few executed migrations and recomputes at training lengths off the evaluated
grid (per-link fixed cost and rate, compute factor, the prefill call's own wait), as the
scheduler fits them from the outcomes routers report.

Printed per rate: measured and predicted times per L, the measured crossovers (where the
two measured curves cross, interpolated in log L) and the predicted ones, and the errors;
then the decision regret of each model: how often the option it predicts faster was the
slower one measured, and by how much.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.checkpoints import opt_125m
from bench.report import add_json_argument, write_json
from kvrs.learning import Corrections, Outcome, Terms, fit
from kvrs.model import model_spec
from kvrs.profile import ComputeProfile

ROOT = Path(__file__).resolve().parent.parent
PORTS = {"remote": 50180, "local": 50181, "decode": 50182}
TRAIN_LENGTHS = (24, 96, 384, 768)
"""Lengths the corrections are fitted at: off the evaluated grid, so no point scored is
one the fit has seen."""


def start_worker(name: str, role: str, port: int, log_dir: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "WORKER_INSTANCE_ID": name,
        "WORKER_LISTEN_ADDR": f"127.0.0.1:{port}",
        "WORKER_TRANSFER_HOST": "127.0.0.1",
        "WORKER_MODEL": opt_125m(),
        "GOSSIP_ADDR": "",
        "WORKER_KV_CAPACITY_BYTES": str(2 << 30),
        "WORKER_TRANSFER_CHUNK_TOKENS": "64",
    }
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the worker
    return subprocess.Popen(
        [sys.executable, "-m", "services.worker", "--role", role],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def calibrate(lengths: list[int], path: Path) -> ComputeProfile:
    command = [
        sys.executable,
        "-m",
        "kvrs",
        "calibrate",
        "--model",
        opt_125m(),
        "--lengths",
        ",".join(str(x) for x in lengths),
        "--repeats",
        "2",
        "--output",
        str(path),
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT, timeout=900)
    return ComputeProfile.load(path)


def _prompt(length: int, salt: int) -> list[int]:
    """A prompt of `length` tokens; one per `salt` shares no prefix block with another, so
    every recompute computes all of its tokens (a worker reuses resident prefix blocks,
    and a curve measured over prefixes of one prompt would price a prefix hit)."""
    return [(11 * i + 5 + 7919 * salt) % 50000 for i in range(length)]


def link_id(rate_bps: float) -> str:
    """The paced link at `rate_bps` as the learner names it (one link per pacing rate)."""
    return f"remote@{rate_bps / 1e9:g}G"


async def measure(
    lengths: list[int], rates_bps: list[float], repeats: int, profile: ComputeProfile
) -> dict:
    from services.common import GrpcSettings
    from services.common.healthcheck import SERVING, check_health
    from services.worker.client import Endpoint, WorkerPool

    endpoints = {name: Endpoint(name, f"127.0.0.1:{port}") for name, port in PORTS.items()}
    for endpoint in endpoints.values():
        deadline = time.monotonic() + 300
        while await check_health(endpoint.address, GrpcSettings(), timeout_s=1.0) != SERVING:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{endpoint.instance_id} did not start")
            await asyncio.sleep(0.5)
    pool = WorkerPool(GrpcSettings(), None, timeout_s=600)
    remote, local, decode = endpoints["remote"], endpoints["local"], endpoints["decode"]
    longest = max(lengths)
    prompt = _prompt(longest, 0)
    await pool.prefill(remote, "held", prompt)
    recomputed = itertools.count(1)

    async def timed_pull(
        source: Endpoint, kv_id: str, tokens: int, pacing_bps: float
    ) -> tuple[float, float]:
        """(wall seconds, seconds on the wire) of one pull into decode."""
        started = time.perf_counter()
        pulled = await pool.pull_kv(decode, kv_id, source, 0, tokens, tokens, pacing_bps=pacing_bps)
        elapsed = time.perf_counter() - started
        await pool.release_kv(decode, kv_id)
        return elapsed, pulled.transfer_s

    async def pull(source: Endpoint, kv_id: str, tokens: int, pacing_bps: float) -> float:
        return (await timed_pull(source, kv_id, tokens, pacing_bps))[0]

    # Warm-up: the first transfer of each pair also builds its process group.
    await pull(remote, "held", 1, 0.0)
    await pool.prefill(local, "warm", prompt[:8])
    await pull(local, "warm", 8, 0.0)
    await pool.release_kv(local, "warm")
    await pull(remote, "held", longest, 0.0)
    rtt_s = statistics.median([await pull(remote, "held", 1, 0.0) for _ in range(5)])
    local_full_s = statistics.median([await pull(remote, "held", longest, 0.0) for _ in range(3)])
    bytes_per_token = model_spec(opt_125m()).kv_bytes_per_token
    local_bps = 8 * bytes_per_token * longest / max(local_full_s - rtt_s, 1e-6)
    bits = 8 * bytes_per_token
    outcomes = []
    for length in TRAIN_LENGTHS:
        for rate in rates_bps:
            wall_s, wire_s = await timed_pull(remote, "held", length, rate)
            outcomes.append(
                Outcome(
                    kind="migrate",
                    request_id=f"train-m-{rate:g}-{length}",
                    source_id=link_id(rate),
                    target_id="decode",
                    at_s=time.time(),
                    predicted=Terms(
                        setup_s=rtt_s,
                        stream_s=bits * length / rate,
                        total_s=rtt_s + bits * length / rate,
                    ),
                    measured=Terms(
                        setup_s=max(0.0, wall_s - wire_s), stream_s=wire_s, total_s=wall_s
                    ),
                    kv_bytes=bytes_per_token * length,
                )
            )
        kv_id = f"train-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        prefilled = await pool.prefill(local, kv_id, _prompt(length, next(recomputed)))
        prefill_wall_s = time.perf_counter() - started
        wall_s, wire_s = await timed_pull(local, kv_id, length, 0.0)
        await pool.release_kv(local, kv_id)
        outcomes.append(
            Outcome(
                kind="recompute",
                request_id=f"train-r-{length}",
                source_id="local",
                target_id="decode",
                at_s=time.time(),
                predicted=Terms(
                    prefill_s=profile.prefill_s(length),
                    setup_s=rtt_s,
                    stream_s=bits * length / local_bps,
                    total_s=profile.prefill_s(length) + rtt_s + bits * length / local_bps,
                ),
                measured=Terms(
                    source_wait_s=max(0.0, prefill_wall_s - prefilled.prefill_s),
                    prefill_s=prefilled.prefill_s,
                    setup_s=max(0.0, wall_s - wire_s),
                    stream_s=wire_s,
                    total_s=prefill_wall_s + wall_s,
                ),
                kv_bytes=bytes_per_token * length,
                prefill_tokens=length,
            )
        )
    recompute: dict[int, float] = {}
    for length in lengths:
        runs = []
        for _ in range(repeats):
            kv_id = f"re-{uuid.uuid4().hex[:8]}"
            started = time.perf_counter()
            await pool.prefill(local, kv_id, _prompt(length, next(recomputed)))
            await pool.pull_kv(decode, kv_id, local, 0, length, length)
            runs.append(time.perf_counter() - started)
            await pool.release_kv(decode, kv_id)
            await pool.release_kv(local, kv_id)
        recompute[length] = min(runs)
    migrate: dict[float, dict[int, float]] = {}
    for rate in rates_bps:
        migrate[rate] = {
            length: min([await pull(remote, "held", length, rate) for _ in range(repeats)])
            for length in lengths
        }
    await pool.release_kv(remote, "held")
    await pool.close()
    return {
        "rtt_s": rtt_s,
        "local_bps": local_bps,
        "recompute": recompute,
        "migrate": {str(rate): values for rate, values in migrate.items()},
        "outcomes": [o.to_json() for o in outcomes],
    }


def crossovers(lengths: list[int], diff) -> list[float]:
    """Every L where diff(L) = migrate - recompute changes sign, interpolated in log L
    (prefill grows faster than linearly, so recompute can win only in a middle band)."""
    values = [diff(length) for length in lengths]
    found = []
    for (l0, d0), (l1, d1) in zip(
        zip(lengths, values, strict=True), zip(lengths[1:], values[1:], strict=True), strict=False
    ):
        if (d0 < 0) != (d1 < 0):
            t = d0 / (d0 - d1)
            found.append(math.exp(math.log(l0) + t * (math.log(l1) - math.log(l0))))
    return found


class Prices:
    """Predicted MIGRATE and RECOMPUTE times of one model (base or corrected)."""

    def __init__(
        self,
        profile: ComputeProfile,
        rtt_s: float,
        local_bps: float,
        corrections: Corrections | None = None,
    ) -> None:
        self.corrections = corrections or Corrections()
        self.profile = self.corrections.compute_profile(profile)
        self.rtt_s = rtt_s
        self.local_bps = local_bps
        self.bits = 8 * model_spec(opt_125m()).kv_bytes_per_token

    def _transfer_s(self, link: str, tokens: int, rate_bps: float) -> float:
        fitted = self.corrections.link(link, "decode")
        if fitted is None:
            return self.rtt_s + self.bits * tokens / rate_bps
        return fitted.fixed_s + self.bits * tokens / fitted.bandwidth_bps

    def migrate_s(self, tokens: int, rate_bps: float) -> float:
        return self._transfer_s(link_id(rate_bps), tokens, rate_bps)

    def recompute_s(self, tokens: int) -> float:
        wait_s = self.corrections.worker_wait_s.get("local", 0.0)
        return (
            wait_s
            + self.profile.prefill_s(tokens)
            + self._transfer_s("local", tokens, self.local_bps)
        )


def predicted_crossovers(prices: Prices, rate_bps: float, low: int, high: int) -> list[float]:
    def diff(length: float) -> float:
        tokens = max(1, round(length))
        return prices.migrate_s(tokens, rate_bps) - prices.recompute_s(tokens)

    grid = sorted(
        {
            round(math.exp(math.log(low) + i * (math.log(high) - math.log(low)) / 200))
            for i in range(201)
        }
    )
    return crossovers(grid, diff)


def _tokens(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values) if values else "none in range"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.crossover", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--rates",
        default="0.1,0.2,0.3",
        help="link rates in Gbit/s (on a CPU, prefill runs at milliseconds "
        "per token: the crossover sits at tens of Mbit/s)",
    )
    parser.add_argument("--lengths", default="16,32,64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=2)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.lengths.split(","))
    rates = [float(x) * 1e9 for x in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvrs-crossover-"))
    print(f"calibrating {opt_125m()} (kvrs calibrate) ...", flush=True)
    profile = calibrate(lengths, work / "profile.json")
    workers = [
        start_worker(name, "decode" if name == "decode" else "prefill", port, work)
        for name, port in PORTS.items()
    ]
    try:
        result = asyncio.run(measure(lengths, rates, args.repeats, profile))
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(15)
    print(json.dumps({"profile": profile.to_json()}))
    rtt_s, local_bps = result["rtt_s"], result["local_bps"]
    bits = 8 * model_spec(opt_125m()).kv_bytes_per_token
    outcomes = [Outcome.from_json(o) for o in result["outcomes"]]
    corrections = fit(outcomes, profile, time.time())
    models = {
        "base": Prices(profile, rtt_s, local_bps),
        "corrected": Prices(profile, rtt_s, local_bps, corrections),
    }
    print(
        f"\nper-transfer cost {rtt_s * 1e3:.1f} ms, local (unpaced) rate "
        f"{local_bps / 1e9:.2f} Gbit/s, S(L) = {bits // 8} B/token"
    )
    print(
        f"corrections from {len(outcomes)} training outcomes: compute x"
        f"{corrections.compute_factor:.3f}, local prefill call "
        f"{corrections.worker_wait_s.get('local', 0.0) * 1e3:.2f} ms"
    )
    for (src, _), link in sorted(corrections.links.items()):
        print(
            f"  {src}: fixed {link.fixed_s * 1e3:.2f} ms, rate "
            f"{link.bandwidth_bps / 1e9:.3f} Gbit/s ({link.samples} transfers)"
        )
    errors: dict[str, list[float]] = {name: [] for name in models}
    regret: dict[str, list[float]] = {name: [] for name in models}
    figures: dict = {
        "profile": profile.to_json(),
        "rtt_s": rtt_s,
        "local_bps": local_bps,
        "corrections": {
            "compute_factor": corrections.compute_factor,
            "worker_wait_s": dict(corrections.worker_wait_s),
            "links": {
                src: {"fixed_s": link.fixed_s, "bandwidth_bps": link.bandwidth_bps}
                for (src, _), link in corrections.links.items()
            },
        },
    }
    figures["links"] = links = []
    for rate in rates:
        measured_m = result["migrate"][str(rate)]
        measured_r = result["recompute"]
        print(f"\nlink {rate / 1e9:g} Gbit/s   (seconds)")
        print(
            f"  {'L':>6} {'migrate':>9} {'recompute':>10} {'base mig':>9} {'base rec':>9} "
            f"{'corr mig':>9} {'corr rec':>9}"
        )
        for length in lengths:
            base, corrected = models["base"], models["corrected"]
            print(
                f"  {length:>6} {measured_m[length]:>9.3f} {measured_r[length]:>10.3f} "
                f"{base.migrate_s(length, rate):>9.3f} {base.recompute_s(length):>9.3f} "
                f"{corrected.migrate_s(length, rate):>9.3f} {corrected.recompute_s(length):>9.3f}"
            )
            best = min(measured_m[length], measured_r[length])
            for name, prices in models.items():
                migrates = prices.migrate_s(length, rate) <= prices.recompute_s(length)
                chosen = measured_m[length] if migrates else measured_r[length]
                regret[name].append((chosen - best) / best)
        measured = crossovers(lengths, lambda n, m=measured_m, r=measured_r: m[n] - r[n])
        print(f"  measured crossovers: {_tokens(measured)}")
        per_rate: dict = {
            "rate_bps": rate,
            "rows": [
                {
                    "tokens": n,
                    "migrate_s": measured_m[n],
                    "recompute_s": measured_r[n],
                    **{
                        f"{name}_predicted_{option}_s": value
                        for name, prices in models.items()
                        for option, value in (
                            ("migrate", prices.migrate_s(n, rate)),
                            ("recompute", prices.recompute_s(n)),
                        )
                    },
                }
                for n in lengths
            ],
            "crossovers_measured": measured,
        }
        links.append(per_rate)
        for name, prices in models.items():
            predicted = predicted_crossovers(prices, rate, lengths[0], lengths[-1])
            per_rate[f"crossovers_predicted_{name}"] = predicted
            print(f"  {name} model predicts {_tokens(predicted)}")
            for meas, pred in zip(measured, predicted, strict=False):
                error = abs(pred - meas) / meas
                errors[name].append(error)
                print(f"    L* measured {meas:.0f}, predicted {pred:.0f}: error {error:.1%}")
    print()
    for name in models:
        if errors[name]:
            print(
                f"{name} model: mean crossover error {statistics.mean(errors[name]):.1%} "
                f"over {len(errors[name])} crossovers"
            )
            figures[f"mean_crossover_error_{name}"] = statistics.mean(errors[name])
        wrong = [r for r in regret[name] if r > 0]
        figures[f"regret_{name}"] = {
            "points": len(regret[name]),
            "slower": len(wrong),
            "mean": statistics.mean(regret[name]),
            "worst": max(wrong, default=0.0),
        }
        print(
            f"{name} model: decision regret in {len(wrong)} of {len(regret[name])} (rate, L) "
            f"points, mean {statistics.mean(regret[name]):.1%}"
            + (f", worst {max(wrong):.1%} slower than the better option" if wrong else "")
        )
    write_json(args.json, "crossover", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
