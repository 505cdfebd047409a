"""Recovery: HYBRID at the migrate/recompute crossover, and a node failure with hundreds of
requests planned per request (RoM's rule) or together (the kvrs batch plan).

Part 1 runs one OPT-13B request on the two-node RoM cluster, kills its decode instance
mid-generation and recovers it on the other node with each mode, at bandwidths around
B*, where the cost model prices MIGRATE and RECOMPUTE the same. Part 2 fills a 64-GPU
fat-tree (segregated layout: decode instances in their own racks) with chat traffic,
kills a decode node and compares per-request RoM with the batch plan (kvrs policy,
HYBRID allowed, 32 migration slots, transfers sharing links).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.learning import Outcome, error_stats, fit
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.recovery import Action, RecoveryRequest, make_recovery_policy
from kvrs.sim.config import SimConfig
from kvrs.sim.experiments.common import (
    Output,
    deep_merge,
    map_runs,
    md_table,
    run,
    sim_config,
    summary_row,
)
from kvrs.sim.experiments.rom import GOODPUT_DEFAULTS, two_node_topology
from kvrs.sim.metrics import recovery_outcomes
from kvrs.sim.trace import SyntheticWorkload, TraceRequest
from kvrs.topology import Role, Topology

DEFAULTS: dict[str, Any] = {
    "single": {
        # Failures before the first decode step (nothing generated: no extend needed)
        # and mid-generation (the generated tokens' KV must be extended on the target).
        "prompt_tokens": 1477,
        "output_tokens": 200,
        "fail_at_s": [0.11, 0.6],
        "bandwidth_factors": [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0],
        "policies": ["always_migrate", "always_recompute", "kvrs"],
    },
    "node_failure": {
        "fail_at_s": 60.0,
        "node": "n2",
        "workload": {
            "requests": 4000,
            "rate_per_s": 50.0,
            "input_median_tokens": 1000.0,
            "input_sigma": 0.6,
            "max_input_tokens": 8192,
            "output_median_tokens": 800.0,
            "output_sigma": 0.3,
            "max_output_tokens": 2048,
            "continue_prob": 0.0,
            "system_prompt_prob": 0.0,
            "seed": 3,
        },
        "sim": {
            "cluster": {"layout": "segregated"},
            "telemetry": {"state_period_s": 0.1, "link_period_s": 1.0},
            "slo": {"ttft_s": 10.0, "tbt_s": 0.1},
        },
        "variants": [
            {"name": "rom per request", "policy": "rom", "planner": "per_request"},
            {"name": "kvrs per request", "policy": "kvrs", "planner": "per_request"},
            {"name": "rom batch", "policy": "rom", "planner": "batch"},
            {"name": "kvrs batch plan", "policy": "kvrs", "planner": "batch"},
            # The same plan deciding with the error the previous run measured in view.
            {
                "name": "kvrs batch plan, error in view",
                "policy": "kvrs",
                "planner": "batch",
                "margins_from": "kvrs batch plan",
            },
        ],
        "placement": {"name": "kvrs", "policy": "netkv", "network_view": "live"},
    },
}


def crossover_bandwidth_gbps(
    config: SimConfig,
    prompt_tokens: int,
    generated_tokens: int,
) -> float:
    """B* where the cost model prices MIGRATE (over Ethernet) and RECOMPUTE the same."""
    model = config.serving.model_spec()
    compute = config.serving.compute()
    policy = make_recovery_policy("kvrs")
    states = {
        "prefill-0": InstanceState("prefill-0", Role.PREFILL),
        "prefill-1": InstanceState("prefill-1", Role.PREFILL),
        "decode-0": InstanceState("decode-0", Role.DECODE, alive=False),
        "decode-1": InstanceState("decode-1", Role.DECODE),
    }
    request = RecoveryRequest(
        "r", prompt_tokens, generated_tokens, "prefill-0", exclude_ids=frozenset({"decode-0"})
    )

    def gap(gbps: float) -> float:
        cost = CostModel(model, compute, NetworkModel(Topology.from_dict(two_node_topology(gbps))))
        # A fresh view per network model: decisions cache path terms on the view.
        view = ClusterView(instances=states, now_s=0.0)
        options = {o.action: o.cost_s for o in policy.decide(request, view, cost, 0.0).options}
        return options[Action.MIGRATE] - options[Action.RECOMPUTE]

    lo, hi = 0.1, 10_000.0
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
    return math.sqrt(lo * hi)


def _singles(p: dict[str, Any], show_progress: bool, workers: int) -> list[dict[str, Any]]:
    return map_runs(
        lambda at_s: _single({**p, "fail_at_s": at_s}, show_progress), p["fail_at_s"], workers
    )


def _single(p: dict[str, Any], show_progress: bool) -> dict[str, Any]:
    base = deep_merge(
        GOODPUT_DEFAULTS["sim"],
        {
            "serving": {"prefill_weights": {"prefill-0": 1.0, "prefill-1": 0.0}},
            "telemetry": {"state_period_s": 0.0, "link_period_s": 0.0},
            "recovery": {"planner": "batch", "network_view": "live"},
        },
    )
    probe_config = sim_config(deep_merge(base, {"cluster": {"topology": two_node_topology(25.0)}}))
    request = TraceRequest(0, 0.0, int(p["prompt_tokens"]), int(p["output_tokens"]))
    # The tokens generated before the failure do not depend on the Ethernet bandwidth
    # (prefill and decode share a node until then): read them from one run.
    probe = run(
        sim_config(
            deep_merge(
                base,
                {
                    "cluster": {"topology": two_node_topology(25.0)},
                    "failures": [{"at_s": p["fail_at_s"], "instance": "decode-0"}],
                },
            )
        ),
        [request],
        {"name": "static", "policy": "least_loaded", "candidates": "same_node"},
    )
    generated = probe.records[0].recoveries[0].generated_tokens
    b_star = crossover_bandwidth_gbps(probe_config, request.input_tokens, generated)
    rows = []
    for factor in p["bandwidth_factors"]:
        gbps = b_star * factor
        row: dict[str, Any] = {"factor": factor, "bandwidth_gbps": gbps}
        for name in p["policies"]:
            config = sim_config(
                deep_merge(
                    base,
                    {
                        "cluster": {"topology": two_node_topology(gbps)},
                        "failures": [{"at_s": p["fail_at_s"], "instance": "decode-0"}],
                        "recovery": {"policy": name},
                    },
                )
            )
            result = run(
                config,
                [request],
                {"name": "static", "policy": "least_loaded", "candidates": "same_node"},
                label=f"single {name} {gbps:.1f} Gbps",
                show_progress=show_progress,
            )
            rec = result.records[0].recoveries[0]
            row[name] = {
                "action": rec.action,
                "restore_s": rec.restore_s,
                "resume_s": rec.latency_s,
                "predicted_s": rec.predicted_s,
                "generated_at_failure": rec.generated_tokens,
            }
        rows.append(row)
    at_star = (
        next(r for r in rows if r["factor"] == 1.0)
        if any(r["factor"] == 1.0 for r in rows)
        else rows[len(rows) // 2]
    )
    singles = [n for n in p["policies"] if n != "kvrs"]

    def ratio(key: str) -> float:
        best = min(at_star[n][key] for n in singles)
        return at_star["kvrs"][key] / best if best else math.nan

    return {
        "fail_at_s": p["fail_at_s"],
        "b_star_gbps": b_star,
        "generated_at_failure": generated,
        "rows": rows,
        "kvrs_action_at_b_star": at_star["kvrs"]["action"],
        "hybrid_over_best_single_restore": ratio("restore_s"),
        "hybrid_over_best_single_resume": ratio("resume_s"),
    }


def _node_failure(p: dict[str, Any], show_progress: bool, workers: int) -> dict[str, Any]:
    """Every variant's run; a variant deciding with margins another one measured
    (`margins_from`) runs once that one has, the others side by side."""
    requests = SyntheticWorkload(**p["workload"]).generate()
    variants = p["variants"]
    sources = _margin_sources(variants)
    done: dict[int, tuple[dict[str, Any], list[Outcome]]] = {}
    while len(done) < len(variants):
        ready = [
            i
            for i, source in enumerate(sources)
            if i not in done and (source is None or source in done)
        ]
        jobs = []
        for i in ready:
            margins: dict[str, float] = {}
            source = sources[i]
            if source is not None:
                # Replay the earlier run's outcomes: the margins it measured, as a scheduler
                # fits them from the outcomes routers report.
                earlier = done[source][1]
                base = sim_config(p["sim"]).serving.compute()
                now_s = max((o.at_s for o in earlier), default=0.0)
                margins = fit(earlier, base, now_s).margins()
            jobs.append((variants[i], margins))
        runs = map_runs(
            lambda job: _node_failure_run(p, requests, job[0], job[1], show_progress), jobs, workers
        )
        done.update(zip(ready, runs, strict=True))
    return {"results": [done[i][0] for i in range(len(variants))]}


def _margin_sources(variants: list[dict[str, Any]]) -> list[int | None]:
    """For each variant, the index of the earlier variant whose margins it decides with."""
    sources: list[int | None] = []
    latest: dict[str, int] = {}
    for i, variant in enumerate(variants):
        name = variant.get("margins_from")
        if name and name not in latest:
            raise InvalidArgument("node_failure.variants", f"no earlier variant named {name!r}")
        sources.append(latest[name] if name else None)
        latest[variant["name"]] = i
    return sources


def _node_failure_run(
    p: dict[str, Any],
    requests: list[TraceRequest],
    variant: dict[str, Any],
    margins: dict[str, float],
    show_progress: bool,
) -> tuple[dict[str, Any], list[Outcome]]:
    """One variant's run: its row of results, and its recovery outcomes."""
    recovery: dict[str, Any] = {"policy": variant["policy"], "planner": variant["planner"]}
    if variant.get("margins_from"):
        recovery["margins"] = margins
    config = sim_config(
        deep_merge(
            p["sim"],
            {"failures": [{"at_s": p["fail_at_s"], "node": p["node"]}], "recovery": recovery},
        )
    )
    result = run(
        config, requests, p["placement"], label=variant["name"], show_progress=show_progress
    )
    outcomes = recovery_outcomes(result.records)
    errors = error_stats(outcomes, last_n=len(result.records))
    recovered = [r for r in result.records if r.recoveries]
    latencies = sorted(
        r.recoveries[0].latency_s for r in recovered if not math.isnan(r.recoveries[0].latency_s)
    )
    actions: dict[str, int] = {}
    for r in recovered:
        actions[r.recoveries[0].action] = actions.get(r.recoveries[0].action, 0) + 1
    row = {
        "variant": variant,
        "summary": summary_row(result.summary),
        "recovered_requests": len(recovered),
        "actions": actions,
        "recovery_latency_s": {
            "mean": sum(latencies) / len(latencies) if latencies else math.nan,
            "p50": latencies[len(latencies) // 2] if latencies else math.nan,
            "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            if latencies
            else math.nan,
            "max": latencies[-1] if latencies else math.nan,
        },
        "batches": result.recovery_batches,
        "margins": margins,
        "prediction_error": {
            kind: {"p50": stats.p50, "p90": stats.p90, "n": stats.samples}
            for (kind, term), stats in errors.items()
            if term == "total_s"
        },
    }
    return row, outcomes


def run_experiment(
    params: dict[str, Any], out_dir: Path, show_progress: bool = False, workers: int = 1
) -> dict:
    """Both parts; `workers` processes run their independent simulations side by side,
    with the same results for any number of workers (only wall-clock figures differ)."""
    p = deep_merge(DEFAULTS, params)
    out = Output(out_dir, "recovery")
    # Progress bars of parallel runs would overwrite each other.
    progress = show_progress and workers <= 1
    singles = _singles(p["single"], progress, workers)
    node = _node_failure(p["node_failure"], progress, workers)
    data = {
        "experiment": "recovery",
        "parameters": p,
        "single": singles,
        "node_failure": node,
        "opt13b_kv_bytes_per_token": model_spec("opt-13b").kv_bytes_per_token,
    }
    out.write_json(data)
    names = p["single"]["policies"]

    def draw_single(axes: Any) -> None:
        for ax, single in zip(axes, singles, strict=True):
            rows = single["rows"]
            for name in names:
                ax.plot(
                    [r["bandwidth_gbps"] for r in rows],
                    [r[name]["restore_s"] * 1e3 for r in rows],
                    marker="o",
                    label=name,
                )
            ax.axvline(
                single["b_star_gbps"],
                color="gray",
                linestyle="--",
                label=f"B* = {single['b_star_gbps']:.0f} Gbps",
            )
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(
                [r["bandwidth_gbps"] for r in rows], [f"{r['bandwidth_gbps']:.0f}" for r in rows]
            )
            ax.set_title(f"{single['generated_at_failure']} tokens generated at failure")
            ax.set_xlabel("inter-node bandwidth (Gbps)")
            ax.set_ylabel("failure → KV restored (ms)")
            ax.legend()
            ax.grid(alpha=0.3)

    out.figure("hybrid", draw_single, size=(5.0 * len(singles), 4.0), ncols=len(singles))

    def draw_node(ax: Any) -> None:
        for res in node["results"]:
            recovered = res["recovery_latency_s"]
            ax.bar(res["variant"]["name"], recovered["mean"], alpha=0.6)
            ax.errorbar(
                res["variant"]["name"],
                recovered["mean"],
                yerr=[[0], [max(0.0, recovered["p99"] - recovered["mean"])]],
                color="black",
                capsize=4,
            )
        ax.set_ylabel("recovery latency, mean (bar) to p99 (s)")
        ax.tick_params(axis="x", labelrotation=15)
        ax.grid(alpha=0.3, axis="y")

    out.figure("node_failure", draw_node, size=(7.5, 4.0))
    single_parts = []
    for single in singles:
        rows = [
            [
                r["factor"],
                r["bandwidth_gbps"],
                *[
                    f"{r[n]['action']} {r[n]['restore_s'] * 1e3:.0f} / {r[n]['resume_s'] * 1e3:.0f}"
                    for n in names
                ],
            ]
            for r in single["rows"]
        ]
        single_parts += [
            f"### Failure at {single['fail_at_s']} s ({single['generated_at_failure']} tokens "
            f"generated), B* = {single['b_star_gbps']:.1f} Gbps",
            md_table(["× B*", "Gbps", *names], rows),
            f"HYBRID / best single mode at B*: restore "
            f"{single['hybrid_over_best_single_restore']:.3f}, first token "
            f"{single['hybrid_over_best_single_resume']:.3f}.",
        ]
    node_rows = [
        [
            r["variant"]["name"],
            r["recovered_requests"],
            ", ".join(f"{k} {v}" for k, v in sorted(r["actions"].items())),
            r["recovery_latency_s"]["mean"],
            r["recovery_latency_s"]["p50"],
            r["recovery_latency_s"]["p99"],
            r["recovery_latency_s"]["max"],
            r["summary"]["aborted"],
            r["summary"]["lost"],
            max((b["plan_wall_s"] for b in r["batches"]), default=math.nan) * 1e3,
            ", ".join(
                f"{kind} {100 * e['p50']:.0f}/{100 * e['p90']:.0f}"
                for kind, e in sorted(r["prediction_error"].items())
            ),
            ", ".join(f"{k} {100 * v:.0f} %" for k, v in sorted(r["margins"].items())) or "-",
        ]
        for r in node["results"]
    ]
    out.write_markdown(
        "\n\n".join(
            [
                "# recovery",
                "## One request at the crossover",
                "Cells: action, failure → KV restored / → first token after recovery (ms).",
                *single_parts,
                "## Node failure",
                md_table(
                    [
                        "planner",
                        "recovered",
                        "actions",
                        "mean (s)",
                        "p50 (s)",
                        "p99 (s)",
                        "max (s)",
                        "aborted",
                        "lost",
                        "plan wall (ms)",
                        "prediction error p50/p90 (%)",
                        "margins decided with",
                    ],
                    node_rows,
                ),
                *[f"![{f.stem}]({f.name})" for f in out.figures],
            ]
        )
    )
    return data
