"""RecomputeOrMigrate on two DistServe OPT-13B nodes: the queue-depth crossover and goodput.

`rom-crossover`: a request's KV (OPT-13B, 1477 tokens = 1.21 GB) sits on node A, whose
serial queue holds Q requests of 60 ms each; node B is idle, 25 Gbps away. Waiting
locally costs Q × 60 ms; migrating costs C_mig = 8·S/B = 387 ms. Both paths run in the
simulator (the flow network for the transfer, a decode instance's job queue for the
local wait) and the curves' crossing is compared with the analytic Q* = 6.45. The
core's AlwaysMigrate policy, given the same view, must switch targets at the first
integer above the crossing. Also: the crossover surface Q*(L, B).

`rom-goodput`: Poisson arrivals split between the nodes with a skew; after prefill each
request is placed by a kvrs recovery policy used as a load balancer (MIGRATE the KV to
a decode instance, RECOMPUTE it on the other node's prefill, HYBRID), or kept on its
node (static). Goodput: the highest rate with ≥ 90 % of requests meeting TTFT 0.25 s
and TPOT 0.1 s, by bisection.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import DecodeProfile, compute_profile
from kvrs.recovery import RecoveryRequest, make_recovery_policy
from kvrs.sim.cache import PrefixCache
from kvrs.sim.engine import EventLoop
from kvrs.sim.experiments.common import (
    Output,
    deep_merge,
    map_runs,
    md_table,
    run,
    sim_config,
    summary_row,
)
from kvrs.sim.flownet import FlowNetwork
from kvrs.sim.instances import ComputeJob, DecodeInstance
from kvrs.sim.metrics import goodput_by_bisection
from kvrs.sim.trace import SyntheticWorkload
from kvrs.topology import Role, Topology


def two_node_topology(
    bandwidth_gbps: float, nvlink_gbps: float = 4800.0, setup_latency_ms: float = 0.0
) -> dict[str, Any]:
    """Two DistServe nodes, each a prefill (TP2) and a decode (TP1) instance, one Ethernet hop
    apart at `bandwidth_gbps` (NVLink 600 GB/s inside a node)."""
    link = {"capacity_gbps": bandwidth_gbps, "hop_latency_us": 0}
    return {
        "setup_latency_ms": setup_latency_ms,
        "tiers": {
            "node": {"capacity_gbps": nvlink_gbps, "hop_latency_us": 0},
            "rack": link,
            "pod": link,
            "spine": link,
        },
        "nodes": [
            {"name": "n0", "rack": "r0", "pod": "p0"},
            {"name": "n1", "rack": "r0", "pod": "p0"},
        ],
        "instances": [
            {"id": "prefill-0", "role": "prefill", "node": "n0", "gpu_index": 0},
            {"id": "decode-0", "role": "decode", "node": "n0", "gpu_index": 2},
            {"id": "prefill-1", "role": "prefill", "node": "n1", "gpu_index": 0},
            {"id": "decode-1", "role": "decode", "node": "n1", "gpu_index": 2},
        ],
    }


# -- crossover ----------------------------------------------------------------------------

CROSSOVER_DEFAULTS: dict[str, Any] = {
    "model": "opt-13b",
    "prompt_tokens": 1477,
    "bandwidth_gbps": 25.0,
    "service_s": 0.060,
    "queue_depths": list(range(16)),
    "surface": {
        "tokens": [64, 128, 256, 512, 1024, 1477, 2048],
        "bandwidth_gbps": [0.5, 1, 2, 5, 10, 25, 40, 100],
    },
}


# The local instance only runs queued jobs; it never takes a decode step.
_JOBS_ONLY = DecodeProfile(a_s=0.0, b_s_per_context_token=0.0, c_s_per_request=0.0)


def simulate_local_wait_s(queue_depth: int, service_s: float) -> float:
    """Time until a request behind `queue_depth` jobs of `service_s` starts, simulated."""
    loop = EventLoop()
    instance = DecodeInstance(
        "local", "n0", loop, _JOBS_ONLY, 1, 1, PrefixCache(0), lambda member: None
    )
    started: list[float] = []
    for _ in range(queue_depth):
        instance.add_job(ComputeJob(service_s, lambda job: None))
    instance.add_job(ComputeJob(0.0, lambda job: started.append(loop.now_s)))
    loop.run()
    return started[0]


def simulate_migration_s(topology: Topology, src_id: str, dst_id: str, kv_bytes: int) -> float:
    """Transfer time of `kv_bytes` over the path, simulated on the flow network."""
    loop = EventLoop()
    network = FlowNetwork(loop, topology.link_capacity_bps)
    done: list[float] = []
    network.start(
        topology.path_links(src_id, dst_id),
        kv_bytes,
        lambda flow: done.append(loop.now_s),
        setup_s=topology.base_rtt_s(src_id, dst_id),
    )
    loop.run()
    return done[0]


def crossing(xs: list[float], local: list[float], remote: list[float]) -> float:
    """Where local − remote first turns non-negative, by linear interpolation."""
    diff = [lo - re for lo, re in zip(local, remote, strict=True)]
    for i in range(1, len(xs)):
        if diff[i - 1] < 0 <= diff[i]:
            return xs[i - 1] + (xs[i] - xs[i - 1]) * (-diff[i - 1]) / (diff[i] - diff[i - 1])
    return math.nan


def run_crossover(params: dict[str, Any], out_dir: Path, show_progress: bool = False) -> dict:
    p = deep_merge(CROSSOVER_DEFAULTS, params)
    out = Output(out_dir, "rom-crossover")
    model = model_spec(p["model"])
    compute = compute_profile(p["model"])
    tokens = int(p["prompt_tokens"])
    kv_bytes = model.kv_bytes(tokens)
    topology = Topology.from_dict(two_node_topology(p["bandwidth_gbps"]))
    service_s = float(p["service_s"])
    depths = [int(q) for q in p["queue_depths"]]
    local = [simulate_local_wait_s(q, service_s) for q in depths]
    c_mig_sim_s = simulate_migration_s(topology, "prefill-0", "decode-1", kv_bytes)
    remote = [c_mig_sim_s] * len(depths)
    q_sim = crossing([float(q) for q in depths], local, remote)
    cost = CostModel(model, compute, NetworkModel(topology))
    c_mig_s = cost.transfer("prefill-0", "decode-1", tokens, 0.0).transfer_s
    q_analytic = c_mig_s / service_s
    # The same choice made by the core policies, over a view with the local queue.
    policy_choice = {}
    for name in ("always_migrate", "kvrs", "rom"):
        policy = make_recovery_policy(name)
        choices = []
        for q in depths:
            view = ClusterView(
                instances={
                    "prefill-0": InstanceState("prefill-0", Role.PREFILL),
                    "prefill-1": InstanceState("prefill-1", Role.PREFILL),
                    "decode-0": InstanceState("decode-0", Role.DECODE, wait_s=q * service_s),
                    "decode-1": InstanceState("decode-1", Role.DECODE),
                },
                now_s=0.0,
            )
            decision = policy.decide(RecoveryRequest("r", tokens, 0, "prefill-0"), view, cost, 0.0)
            choices.append(
                {
                    "q": q,
                    "action": decision.action.value,
                    "target": decision.target_id,
                    "cost_s": decision.cost_s,
                }
            )
        policy_choice[name] = choices
    switch = next(
        (c["q"] for c in policy_choice["always_migrate"] if c["target"] != "decode-0"), None
    )
    surface = []
    for bw in p["surface"]["bandwidth_gbps"]:
        net = NetworkModel(Topology.from_dict(two_node_topology(bw)))
        c = CostModel(model, compute, net)
        for length in p["surface"]["tokens"]:
            mig_s = c.transfer("prefill-0", "decode-1", length, 0.0).transfer_s
            surface.append(
                {
                    "bandwidth_gbps": bw,
                    "tokens": length,
                    "c_mig_s": mig_s,
                    "c_recomp_s": c.prefill_s(length),
                    "q_star_migrate": mig_s / service_s,
                    "q_star_recompute": c.prefill_s(length) / service_s,
                }
            )
    # Lowest bandwidth at which Q* reaches 250 for the longest prompt, analytically.
    longest = max(p["surface"]["tokens"])
    bw_for_250 = 8 * model.kv_bytes(longest) / (250 * service_s) / 1e9
    data = {
        "experiment": "rom-crossover",
        "parameters": p,
        "kv_bytes": kv_bytes,
        "c_mig_s": c_mig_s,
        "c_mig_simulated_s": c_mig_sim_s,
        "c_recomp_s": compute.prefill_s(tokens),
        "q_star_analytic": q_analytic,
        "q_star_simulated": q_sim,
        "q_star_error_pct": 100.0 * (q_sim - q_analytic) / q_analytic,
        "local_latency_s": dict(zip(depths, local, strict=True)),
        "policy_switch_q": switch,
        "policy_choices": policy_choice,
        "surface": surface,
        "bandwidth_gbps_for_q_star_250_at_longest": bw_for_250,
    }
    out.write_json(data)

    def draw_curves(ax: Any) -> None:
        ax.plot(depths, local, marker="o", label="local: Q × 60 ms (simulated)")
        ax.plot(depths, remote, label=f"migrate: C_mig = {c_mig_sim_s * 1e3:.0f} ms (simulated)")
        ax.axvline(q_sim, color="gray", linestyle="--", label=f"Q* = {q_sim:.2f}")
        ax.set_xlabel("local queue depth Q")
        ax.set_ylabel("latency (s)")
        ax.legend()
        ax.grid(alpha=0.3)

    out.figure("curves", draw_curves)

    def draw_surface(ax: Any) -> None:
        bws = p["surface"]["bandwidth_gbps"]
        lengths = p["surface"]["tokens"]
        grid = np.array(
            [
                [
                    next(
                        s["q_star_migrate"]
                        for s in surface
                        if s["bandwidth_gbps"] == bw and s["tokens"] == length
                    )
                    for bw in bws
                ]
                for length in lengths
            ]
        )
        image = ax.imshow(np.log10(grid), origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(bws)), [f"{b:g}" for b in bws])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("bandwidth (Gbps)")
        ax.set_ylabel("prompt tokens L")
        for i in range(len(lengths)):
            for j in range(len(bws)):
                ax.text(
                    j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7, color="white"
                )
        ax.set_title("Q*(L, B) = C_mig / 60 ms (log colour)")
        ax.figure.colorbar(image, ax=ax, label="log10 Q*")

    out.figure("surface", draw_surface, size=(7.5, 4.5))
    rows = [
        [
            c["q"],
            local[i],
            c_mig_sim_s,
            c["target"],
            policy_choice["kvrs"][i]["action"],
            policy_choice["kvrs"][i]["target"],
        ]
        for i, c in enumerate(policy_choice["always_migrate"])
    ]
    out.write_markdown(
        "\n\n".join(
            [
                "# rom-crossover",
                f"KV of {tokens} tokens ({model.name}): {kv_bytes:,} B; C_mig at "
                f"{p['bandwidth_gbps']:g} Gbps = {c_mig_s * 1e3:.1f} ms (cost model), "
                f"{c_mig_sim_s * 1e3:.1f} ms (flow simulation); C_recomp = T_pf = "
                f"{compute.prefill_s(tokens) * 1e3:.1f} ms.",
                f"Q* analytic {q_analytic:.3f}, simulated {q_sim:.3f} "
                f"({data['q_star_error_pct']:+.2f} %); AlwaysMigrate switches to the remote node "
                f"at Q = {switch}.",
                md_table(
                    [
                        "Q",
                        "local (s)",
                        "migrate (s)",
                        "always_migrate target",
                        "kvrs action",
                        "kvrs target",
                    ],
                    rows,
                ),
                *[f"![{f.stem}]({f.name})" for f in out.figures],
            ]
        )
    )
    return data


# -- goodput ------------------------------------------------------------------------------

GOODPUT_DEFAULTS: dict[str, Any] = {
    "skews": [0.5, 0.6, 0.7, 0.8, 0.9],
    "bandwidth_gbps": 25.0,
    "requests": 800,
    "low_rate": 1.0,
    "high_rate": 4.0,
    "tolerance": 0.1,
    "target_attainment": 0.9,
    "workload": {
        "input_median_tokens": 400.0,
        "input_sigma": 0.8,
        "max_input_tokens": 1536,
        "output_median_tokens": 150.0,
        "output_sigma": 0.7,
        "max_output_tokens": 512,
        "continue_prob": 0.0,
        "system_prompt_prob": 0.0,
        "seed": 0,
    },
    "sim": {
        "serving": {
            "model": "opt-13b",
            # DistServe's OPT-13B fit is for TP1; its chatbot placement prefills
            # on TP2, taken here as 1.8x faster per token (fixed cost unchanged).
            "prefill_profile": {
                "a_s": 0.01646,
                "b_s_per_token": 5.14e-5,
                "c_s_per_token2": 3.59e-9,
            },
            # step(1, 512) = 20.3 ms as DistServe's fit; the split into a, b, c
            # is an HBM-bandwidth estimate (819,200 B of KV per context token).
            "decode_profile": {
                "a_s": 0.020,
                "b_s_per_context_token": 5.0e-7,
                "c_s_per_request": 5.0e-5,
            },
            "prefill_budget_tokens": 2048,
            "prefix_pool_tokens": 0,
            "decode_kv_tokens": 60_000,
            "decode_cache_tokens": 0,
            "decode_max_batch": 128,
            "prefill_router": "weighted",
        },
        "slo": {"ttft_s": 0.25, "tpot_s": 0.1, "mode": "ttft+tpot"},
        "telemetry": {"state_period_s": 0.0, "link_period_s": 1.0},
    },
    "policies": [
        {
            "name": "static",
            "policy": "least_loaded",
            "candidates": "same_node",
            "network_view": "live",
        },
        {
            "name": "always_migrate",
            "policy": "always_migrate",
            "mode": "recovery",
            "network_view": "live",
        },
        {
            "name": "always_recompute",
            "policy": "always_recompute",
            "mode": "recovery",
            "network_view": "live",
        },
        {"name": "rom", "policy": "rom", "mode": "recovery", "network_view": "live"},
        {"name": "kvrs", "policy": "kvrs", "mode": "recovery", "network_view": "live"},
    ],
}


def run_goodput(
    params: dict[str, Any], out_dir: Path, show_progress: bool = False, workers: int = 1
) -> dict:
    """Goodput per (skew, policy); `workers` processes run the bisections side by side.

    Each bisection is independent and deterministic, so the results are the same for any
    number of workers; only `wall_s` differs run to run.
    """
    p = deep_merge(GOODPUT_DEFAULTS, params)
    out = Output(out_dir, "rom-goodput")
    # Progress bars of parallel runs would overwrite each other.
    progress = show_progress and workers <= 1
    jobs = [(skew, policy) for skew in p["skews"] for policy in p["policies"]]
    rows = map_runs(lambda job: _goodput_row(p, job[0], job[1], progress), jobs, workers)
    data = {
        "experiment": "rom-goodput",
        "parameters": p,
        "effective_config": sim_config(
            deep_merge(
                p["sim"],
                {
                    "cluster": {"topology": two_node_topology(p["bandwidth_gbps"])},
                    "serving": {"prefill_weights": {"prefill-0": 0.9, "prefill-1": 0.1}},
                },
            )
        ).to_dict(),
        "results": rows,
        "headline": _goodput_headline(rows),
    }
    out.write_json(data)
    names = [policy["name"] for policy in p["policies"]]

    def draw(ax: Any) -> None:
        for name in names:
            mine = [r for r in rows if r["policy"] == name]
            ax.plot(
                [100 * r["skew"] for r in mine],
                [r["goodput_per_s"] for r in mine],
                marker="o",
                label=name,
            )
        ax.set_xlabel("share of arrivals at node 0 (%)")
        ax.set_ylabel("goodput (req/s, ≥ 90 % attainment)")
        ax.legend()
        ax.grid(alpha=0.3)

    out.figure("goodput", draw)
    table = []
    for skew in p["skews"]:
        by = {r["policy"]: r["goodput_per_s"] for r in rows if r["skew"] == skew}
        line: list[Any] = [f"{skew:.0%}", *[by.get(n, math.nan) for n in names]]
        if "static" in by and "rom" in by and by["static"]:
            line.append(100.0 * (by["rom"] - by["static"]) / by["static"])
        if "static" in by and "kvrs" in by and by["static"]:
            line.append(100.0 * (by["kvrs"] - by["static"]) / by["static"])
        table.append(line)
    out.write_markdown(
        "\n\n".join(
            [
                "# rom-goodput",
                f"Two OPT-13B nodes, {p['bandwidth_gbps']:g} Gbps apart; {p['requests']} Poisson "
                f"requests per probe; goodput = highest rate with ≥ {p['target_attainment']:.0%} "
                f"meeting TTFT {p['sim']['slo']['ttft_s']} s and "
                f"TPOT {p['sim']['slo']['tpot_s']} s "
                f"(bisection to {p['tolerance']} req/s).",
                md_table(
                    [
                        "skew",
                        *[f"{n} (req/s)" for n in names],
                        "rom vs static %",
                        "kvrs vs static %",
                    ],
                    table,
                ),
                *[f"![{f.stem}]({f.name})" for f in out.figures],
            ]
        )
    )
    return data


def _goodput_row(
    p: dict[str, Any], skew: float, policy: dict[str, Any], show_progress: bool
) -> dict[str, Any]:
    """The goodput of one policy at one skew, by bisection over the arrival rate."""
    sim = deep_merge(
        p["sim"],
        {
            "cluster": {"topology": two_node_topology(p["bandwidth_gbps"])},
            "serving": {"prefill_weights": {"prefill-0": skew, "prefill-1": 1.0 - skew}},
        },
    )
    config = sim_config(sim)
    at_rate: dict[float, dict] = {}

    def attainment_at(rate: float) -> float:
        requests = SyntheticWorkload(
            requests=int(p["requests"]), rate_per_s=rate, **p["workload"]
        ).generate()
        result = run(
            config,
            requests,
            policy,
            label=f"skew {skew:.0%} {policy['name']} {rate:.2f}/s",
            show_progress=show_progress,
        )
        at_rate[rate] = summary_row(result.summary)
        at_rate[rate]["placed"] = {k: v for k, v in result.stats.items() if k.startswith("placed_")}
        return result.summary.slo_attainment

    goodput, probes = goodput_by_bisection(
        attainment_at, p["low_rate"], p["high_rate"], p["target_attainment"], p["tolerance"]
    )
    return {
        "skew": skew,
        "policy": policy["name"],
        "goodput_per_s": goodput,
        "probes": probes,
        "at_goodput": at_rate.get(goodput, {}),
    }


def _goodput_headline(rows: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for skew in sorted({r["skew"] for r in rows}):
        by = {r["policy"]: r["goodput_per_s"] for r in rows if r["skew"] == skew}
        static = by.get("static")
        if static:
            for name, value in by.items():
                if name != "static":
                    out[f"{name}_vs_static_pct_at_{skew:g}"] = 100.0 * (value - static) / static
    return out
