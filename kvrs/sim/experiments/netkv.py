"""NetKV on a 64-GPU four-tier fat-tree: decode placement policies under load and congestion.

Policies (all prefill routing identical, cache-aware): round_robin; cache_load with its
weights tuned by a grid search on the same trace (the baseline gets the benefit of the
doubt); netkv, the core's network-aware score fed by link telemetry sampled every
`telemetry.link_period_s` (bandwidth left by background traffic and KV flow counts, both
as of the last sample); kvrs, the core's `Kvrs` policy: the same link samples weighed by
their age against each link's rate of change, the KV flows the control plane itself
started counted live, a bounded decode-load term, and prefill chosen with the decode side
in view. Sweeps: load scale × background
utilisation, context caps, telemetry staleness, the segregated layout, and the KV hand-off:
the decode instance chosen once the prefill has ended (what the other sweeps do), chosen
as it starts with the KV sent after it (the service's router without streaming), and
chosen as it starts with the KV streamed layer by layer under it (layer-wise streaming).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvrs.sim.experiments.common import (
    Output,
    attainment,
    deep_merge,
    load_workload,
    map_runs,
    md_table,
    pct_change,
    run,
    sim_config,
    summary_row,
)
from kvrs.sim.metrics import SloSpec

DEFAULTS: dict[str, Any] = {
    "workload": {"trace": "default", "limit": None, "synthetic": {"requests": 4000}},
    "sim": {
        "slo": {"ttft_s": 10.0, "tbt_s": 0.1, "mode": "ttft+tbt"},
        "telemetry": {"state_period_s": 0.1, "link_period_s": 1.0},
    },
    "policies": [
        {"name": "round_robin", "policy": "round_robin"},
        {"name": "cache_load", "policy": "cache_load"},
        {"name": "netkv_tiers", "policy": "netkv", "network_view": "topology"},
        {"name": "netkv", "policy": "netkv", "network_view": "telemetry"},
        {"name": "kvrs", "policy": "kvrs", "network_view": "trend", "prefill": "joint"},
    ],
    "tuning": {
        "cache_weight": [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6],
        "load_weight": [0.5, 1.0, 2.0],
        "rate_scale": 1.0,
        "background": 0.0,
    },
    "load_scales": [0.5, 1.0, 1.5, 2.0],
    "background_levels": [0.0, 0.3, 0.6],
    "context": {"caps": [8192, 32768, 131072, None], "rate_scale": 1.0, "background": 0.3},
    "staleness": {
        "periods_s": [0.0, 0.1, 1.0, 10.0, math.inf],
        "rate_scale": 1.0,
        "background": 0.3,
        "layout": "segregated",
        "policies": ["netkv", "kvrs"],
    },
    "segregated": {"rate_scales": [0.5, 1.0], "background_levels": [0.0, 0.3]},
    "handoff": {
        # (rate scale, background, layout)
        "scenarios": [
            [1.0, 0.0, "interleaved"],
            [1.0, 0.3, "interleaved"],
            [1.0, 0.3, "segregated"],
        ],
        "modes": ["after_prefill", "early", "streamed"],
        "policies": ["round_robin", "netkv", "kvrs"],
    },
    "ttft_slos_s": [2.0, 5.0, 10.0, 30.0],
    "attainment_scenarios": [[1.0, 0.0], [1.0, 0.3], [2.0, 0.6]],  # (rate scale, background)
}


HANDOFF_MODES: dict[str, dict[str, bool]] = {
    "after_prefill": {},
    "early": {"early_placement": True},
    "streamed": {"layerwise_streaming": True},
}
"""The `serving` settings of each KV hand-off mode of the `handoff` sweep."""


def run_experiment(
    params: dict[str, Any], out_dir: Path, show_progress: bool = False, workers: int = 1
) -> dict:
    """Every sweep of the experiment; `workers` processes run its simulations side by side.

    Runs are independent (the tuning grid first, since the sweeps use its winner), so the
    results are the same for any number of workers; only `wall_s` differs run to run.
    """
    p = deep_merge(DEFAULTS, params)
    out = Output(out_dir, "netkv")
    workload = load_workload(p["workload"])
    base = p["sim"]
    policies = {spec["name"]: dict(spec) for spec in p["policies"]}
    slos = [float(x) for x in p["ttft_slos_s"]]
    tbt_slo = float(base.get("slo", {}).get("tbt_s", 0.1))
    # Progress bars of parallel runs would overwrite each other.
    progress = show_progress and workers <= 1

    def config(rate_bg_layout: dict[str, Any]) -> Any:
        extra: dict[str, Any] = {"background": {"utilisation": rate_bg_layout["background"]}}
        if "layout" in rate_bg_layout:
            extra["cluster"] = {"layout": rate_bg_layout["layout"]}
        if "link_period_s" in rate_bg_layout:
            extra["telemetry"] = {"link_period_s": rate_bg_layout["link_period_s"]}
        if "handoff" in rate_bg_layout:
            extra["serving"] = HANDOFF_MODES[rate_bg_layout["handoff"]]
        return sim_config(deep_merge(base, extra))

    def one(job: tuple[str, dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
        name, scenario, policy = job
        requests = workload.scaled(scenario.get("rate_scale", 1.0), scenario.get("context_cap"))
        result = run(
            config(scenario),
            requests,
            policy,
            label=f"{name} {policy['name']}",
            show_progress=progress,
        )
        row = summary_row(result.summary)
        row["attainment_by_ttft_slo"] = {
            str(slo): attainment(result.records, SloSpec(ttft_s=slo, tbt_s=tbt_slo)) for slo in slos
        }
        return row

    # 1. Tune cache_load's weights (grid search, lowest mean TTFT).
    tuning = p["tuning"]
    grid = []
    if "cache_load" in policies and not policies["cache_load"].get("params"):
        scenario = {"rate_scale": tuning["rate_scale"], "background": tuning["background"]}
        weights = [(c, w) for c in tuning["cache_weight"] for w in tuning["load_weight"]]
        jobs = [
            (
                "tune",
                scenario,
                {
                    "name": "cache_load",
                    "policy": "cache_load",
                    "params": {"cache_weight": cache_weight, "load_weight": load_weight},
                },
            )
            for cache_weight, load_weight in weights
        ]
        for (cache_weight, load_weight), row in zip(
            weights, map_runs(one, jobs, workers), strict=True
        ):
            grid.append(
                {
                    "cache_weight": cache_weight,
                    "load_weight": load_weight,
                    "ttft_mean_s": row["ttft_s"]["mean"],
                }
            )
        best = min(grid, key=lambda g: (g["ttft_mean_s"], g["cache_weight"], g["load_weight"]))
        policies["cache_load"]["params"] = {
            "cache_weight": best["cache_weight"],
            "load_weight": best["load_weight"],
        }

    # 2. Every sweep's runs at once, then regrouped by sweep and scenario.
    names = list(policies)
    ctx = p["context"]
    stale = p["staleness"]
    seg = p["segregated"]
    sweeps: dict[str, tuple[list[dict[str, Any]], list[str]]] = {
        "load": (
            [
                {"rate_scale": s, "background": u}
                for u in p["background_levels"]
                for s in p["load_scales"]
            ],
            names,
        ),
        "context": (
            [
                {"rate_scale": ctx["rate_scale"], "background": ctx["background"], "context_cap": c}
                for c in ctx["caps"]
            ],
            names,
        ),
        "staleness": (
            [
                {
                    "rate_scale": stale["rate_scale"],
                    "background": stale["background"],
                    "layout": stale.get("layout", "interleaved"),
                    "link_period_s": float(t),
                }
                for t in stale["periods_s"]
            ],
            [n for n in stale["policies"] if n in policies],
        ),
        "segregated": (
            [
                {"rate_scale": s, "background": u, "layout": "segregated"}
                for u in seg["background_levels"]
                for s in seg["rate_scales"]
            ],
            names,
        ),
    }
    handoff = p["handoff"]
    sweeps["handoff"] = (
        [
            {"rate_scale": rate, "background": background, "layout": layout, "handoff": mode}
            for rate, background, layout in handoff["scenarios"]
            for mode in handoff["modes"]
        ],
        [n for n in handoff["policies"] if n in policies],
    )
    jobs = [
        (kind, scenario, policies[n])
        for kind, (scenarios, run_names) in sweeps.items()
        for scenario in scenarios
        for n in run_names
    ]
    results = iter(map_runs(one, jobs, workers))
    rows: dict[str, list[dict]] = {}
    for kind, (scenarios, run_names) in sweeps.items():
        rows[kind] = [
            {"scenario": scenario, "results": {n: next(results) for n in run_names}}
            for scenario in scenarios
        ]
    load_rows, context_rows = rows["load"], rows["context"]
    staleness_rows, segregated_rows = rows["staleness"], rows["segregated"]
    handoff_rows = rows["handoff"]

    data = {
        "experiment": "netkv",
        "parameters": p,
        "effective_config": sim_config(base).to_dict(),
        "workload": {"source": workload.source, "stats": workload.stats.__dict__},
        "policies": policies,
        "cache_load_tuning": grid,
        "load": load_rows,
        "context": context_rows,
        "staleness": staleness_rows,
        "segregated": segregated_rows,
        "handoff": handoff_rows,
        "headline": _headline(load_rows + context_rows + segregated_rows, slos),
    }
    out.write_json(data)
    _figures(out, data, names)
    out.write_markdown(_markdown(data, names, out))
    return data


def _headline(rows: list[dict], slos: list[float]) -> dict[str, Any]:
    """Best and typical gains of netkv and kvrs over the baselines, and TBT overheads."""

    def mean_ttft(row: dict, name: str) -> float:
        return row["results"][name]["ttft_s"]["mean"] if name in row["results"] else math.nan

    out: dict[str, Any] = {}
    for ours in ("netkv", "kvrs"):
        for base in ("round_robin", "cache_load", "netkv_tiers", "netkv"):
            if ours == base:
                continue
            deltas = [pct_change(mean_ttft(r, ours), mean_ttft(r, base)) for r in rows]
            deltas = [d for d in deltas if not math.isnan(d)]
            if deltas:
                out[f"{ours}_vs_{base}_ttft_pct"] = {
                    "best": min(deltas),
                    "worst": max(deltas),
                    "median": sorted(deltas)[len(deltas) // 2],
                }
        gains = []
        for r in rows:
            for slo in slos:
                a = r["results"].get(ours, {}).get("attainment_by_ttft_slo", {}).get(str(slo))
                b = [
                    r["results"][n]["attainment_by_ttft_slo"][str(slo)]
                    for n in ("round_robin", "cache_load")
                    if n in r["results"]
                ]
                if a is not None and b:
                    gains.append(100.0 * (a - max(b)))
        if gains:
            out[f"{ours}_attainment_gain_pp_max"] = max(gains)
        tbt = [
            abs(r["results"][ours]["tbt_s"]["mean"] - r["results"][n]["tbt_s"]["mean"]) * 1e3
            for r in rows
            for n in ("round_robin", "cache_load")
            if ours in r["results"] and n in r["results"]
        ]
        if tbt:
            out[f"{ours}_tbt_delta_ms_max"] = max(tbt)
    return out


def _figures(out: Output, data: dict, names: list[str]) -> None:
    levels = sorted({r["scenario"]["background"] for r in data["load"]})

    def draw_load(axes: Any) -> None:
        for ax, level in zip(axes, levels, strict=True):
            rows = [r for r in data["load"] if r["scenario"]["background"] == level]
            for name in names:
                ax.plot(
                    [r["scenario"]["rate_scale"] for r in rows],
                    [r["results"][name]["ttft_s"]["mean"] for r in rows],
                    marker="o",
                    label=name,
                )
            ax.set_title(f"background {level:.0%}")
            ax.set_xlabel("arrival rate scale")
            ax.set_ylabel("mean TTFT (s)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend()

    out.figure("load", draw_load, size=(4.0 * len(levels), 3.6), ncols=len(levels))

    def draw_context(ax: Any) -> None:
        rows = data["context"]
        labels = [str(r["scenario"]["context_cap"] or "native") for r in rows]
        x = range(len(rows))
        for offset, base in ((-0.2, "round_robin"), (0.2, "cache_load")):
            ax.bar(
                [i + offset for i in x],
                [
                    -pct_change(
                        r["results"]["netkv"]["ttft_s"]["mean"],
                        r["results"][base]["ttft_s"]["mean"],
                    )
                    for r in rows
                ],
                width=0.4,
                label=f"netkv vs {base}",
            )
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("context cap (tokens)")
        ax.set_ylabel("mean TTFT reduction (%)")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")

    if data["context"] and {"netkv", "round_robin", "cache_load"} <= set(names):
        out.figure("context", draw_context)

    def draw_staleness(ax: Any) -> None:
        rows = data["staleness"]
        periods = [float(r["scenario"]["link_period_s"]) for r in rows]
        finite = [t for t in periods if 0 < t < math.inf]
        lo, hi = (min(finite) / 10, max(finite) * 10) if finite else (0.01, 100)
        xs = [lo if t == 0 else hi if t == math.inf else t for t in periods]
        for name in rows[0]["results"]:
            ax.plot(
                xs, [r["results"][name]["ttft_s"]["mean"] for r in rows], marker="o", label=name
            )
        ax.set_xscale("log")
        ax.set_xticks(xs, ["0" if t == 0 else "∞" if t == math.inf else f"{t:g}" for t in periods])
        ax.set_xlabel("link telemetry period T_tel (s)")
        ax.set_ylabel("mean TTFT (s)")
        ax.legend()
        ax.grid(alpha=0.3)

    if data["staleness"]:
        out.figure("staleness", draw_staleness)

    wanted = [tuple(x) for x in data["parameters"].get("attainment_scenarios", [])]
    shown = [
        r
        for r in data["load"]
        if (r["scenario"]["rate_scale"], r["scenario"]["background"]) in wanted
    ] or data["load"][-1:]

    def draw_attainment(axes: Any) -> None:
        for ax, row in zip(axes, shown, strict=True):
            for name in names:
                by = row["results"][name]["attainment_by_ttft_slo"]
                ax.plot([float(k) for k in by], list(by.values()), marker="o", label=name)
            ax.set_xlabel("TTFT SLO (s), TBT SLO 100 ms")
            ax.set_ylabel("SLO attainment")
            ax.set_title(
                f"rate ×{row['scenario']['rate_scale']:g}, "
                f"background {row['scenario']['background']:.0%}"
            )
            ax.grid(alpha=0.3)
        axes[0].legend()

    out.figure("attainment", draw_attainment, size=(4.5 * len(shown), 3.8), ncols=len(shown))


def _scenario_rows(rows: list[dict], names: list[str], keys: list[str]) -> list[list[Any]]:
    table = []
    for r in rows:
        s = r["scenario"]
        res = r["results"]
        line: list[Any] = [s.get(k) if s.get(k) is not None else "native" for k in keys]
        line += [res[n]["ttft_s"]["mean"] for n in names]
        if "netkv" in res and "round_robin" in res:
            line.append(
                pct_change(res["netkv"]["ttft_s"]["mean"], res["round_robin"]["ttft_s"]["mean"])
            )
        if "netkv" in res and "cache_load" in res:
            line.append(
                pct_change(res["netkv"]["ttft_s"]["mean"], res["cache_load"]["ttft_s"]["mean"])
            )
        if "kvrs" in res and "netkv" in res:
            line.append(pct_change(res["kvrs"]["ttft_s"]["mean"], res["netkv"]["ttft_s"]["mean"]))
        if "kvrs" in res and "netkv_tiers" in res:
            line.append(
                pct_change(res["kvrs"]["ttft_s"]["mean"], res["netkv_tiers"]["ttft_s"]["mean"])
            )
        if "netkv" in res and "round_robin" in res:
            line.append((res["netkv"]["tbt_s"]["mean"] - res["round_robin"]["tbt_s"]["mean"]) * 1e3)
        table.append(line)
    return table


def _markdown(data: dict, names: list[str], out: Output) -> str:
    keys_load = ["background", "rate_scale"]
    extra = [
        "netkv vs RR %",
        "netkv vs tuned %",
        "kvrs vs netkv %",
        "kvrs vs netkv_tiers %",
        "ΔTBT netkv−RR (ms)",
    ]
    head = [*keys_load, *[f"{n} TTFT (s)" for n in names], *extra]
    parts = [
        "# netkv experiment",
        f"Workload: {data['workload']['source']} — {data['workload']['stats']['requests']} "
        f"requests, mean input {data['workload']['stats']['mean_input_tokens']:.0f} / output "
        f"{data['workload']['stats']['mean_output_tokens']:.0f} tokens.",
        f"cache_load weights (grid search): {data['policies'].get('cache_load', {}).get('params')}",
        "## Load × background",
        md_table(head, _scenario_rows(data["load"], names, keys_load)),
        "## Context caps",
        md_table(["cap", *head[2:]], _scenario_rows(data["context"], names, ["context_cap"])),
        "## Segregated layout",
        md_table(head, _scenario_rows(data["segregated"], names, keys_load)),
    ]
    if data["staleness"]:
        stale_names = list(data["staleness"][0]["results"])
        parts += [
            "## Telemetry staleness",
            md_table(
                ["T_tel (s)", *[f"{n} TTFT (s)" for n in stale_names]],
                [
                    [
                        r["scenario"]["link_period_s"],
                        *[r["results"][n]["ttft_s"]["mean"] for n in stale_names],
                    ]
                    for r in data["staleness"]
                ],
            ),
        ]
    if data.get("handoff"):
        parts += ["## KV hand-off", _handoff_table(data["handoff"])]
    parts += ["## Headline", "```", _dump(data["headline"]), "```"]
    parts += [f"![{f.stem}]({f.name})" for f in out.figures]
    return "\n\n".join(parts)


def _handoff_table(rows: list[dict]) -> str:
    """Mean / p99 TTFT and SLO attainment per scenario, policy and hand-off mode, and each
    mode's mean TTFT against the decision made after the prefill."""
    after: dict[tuple, dict] = {}
    for r in rows:
        sc = r["scenario"]
        if sc["handoff"] == "after_prefill":
            after[(sc["rate_scale"], sc["background"], sc["layout"])] = r["results"]
    table = []
    for r in rows:
        sc = r["scenario"]
        base = after.get((sc["rate_scale"], sc["background"], sc["layout"]), {})
        for name, result in r["results"].items():
            ttft = result["ttft_s"]
            vs = (
                pct_change(ttft["mean"], base[name]["ttft_s"]["mean"]) if name in base else math.nan
            )
            table.append(
                [
                    sc["layout"],
                    sc["background"],
                    sc["rate_scale"],
                    name,
                    sc["handoff"],
                    ttft["mean"],
                    ttft["p99"],
                    result["slo_attainment"],
                    vs,
                ]
            )
    head = ["layout", "background", "rate_scale", "policy", "hand-off"]
    head += ["TTFT mean (s)", "TTFT p99 (s)", "SLO", "vs after_prefill %"]
    return md_table(head, table)


def _dump(value: Any) -> str:
    import json

    return json.dumps(value, indent=2, default=str)
