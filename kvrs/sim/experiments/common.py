"""What every experiment shares: parameters, workloads, runs, and JSON/markdown/figure output."""

from __future__ import annotations

import copy
import json
import logging
import math
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.generators import make_generator
from kvrs.sim.metrics import RequestRecord, RunSummary, SloSpec
from kvrs.sim.progress import Progress
from kvrs.sim.simulator import RunResult, run_policy
from kvrs.sim.trace import (
    SyntheticWorkload,
    TraceRequest,
    TraceStats,
    cap_context,
    load_mooncake,
    scale_arrivals,
)

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TRACE = REPO_ROOT / "data" / "traces" / "synthetic_trace.jsonl"
"""Mooncake's synthetic trace, checked in (data/traces/README.md names source and licence)."""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `override` laid over it, recursively for nested mappings."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@dataclass
class Workload:
    """The requests of an experiment and where they came from."""

    requests: list[TraceRequest]
    source: str
    stats: TraceStats

    def scaled(
        self, rate_scale: float = 1.0, context_cap: int | None = None, cap_mode: str = "truncate"
    ) -> list[TraceRequest]:
        requests = (
            cap_context(self.requests, context_cap, cap_mode) if context_cap else self.requests
        )
        return scale_arrivals(requests, rate_scale) if rate_scale != 1.0 else requests


def load_workload(spec: Mapping[str, Any]) -> Workload:
    """A trace file (Mooncake format), or a generated workload when there is none.

    `generator: {kind: conversation, ...}` generates the workload (see
    `kvrs.sim.generators`; it takes precedence over `trace`). `trace: default` means
    Mooncake's synthetic trace in data/traces; a trace file that is absent is replaced by
    the generator, with the parameters in `synthetic`, and the results say so.
    """
    trace = spec.get("trace")
    limit = spec.get("limit")
    generator = spec.get("generator")
    if generator:
        params = dict(generator)
        if limit:
            params["requests"] = min(int(params.get("requests", limit)), int(limit))
        requests = make_generator(params).generate()
        return Workload(requests, f"generated: {params}", TraceStats.of(requests))
    path = DEFAULT_TRACE if trace == "default" else (Path(trace) if trace else None)
    if path is not None and path.exists():
        requests = load_mooncake(path, limit=limit)
        source = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
    else:
        if path is not None:
            log.warning("trace %s not found: using the synthetic generator", path)
        params = dict(spec.get("synthetic") or {})
        if limit:
            params["requests"] = min(int(params.get("requests", limit)), int(limit))
        requests = SyntheticWorkload(**params).generate()
        source = f"generated: SyntheticWorkload({params})"
    return Workload(requests, source, TraceStats.of(requests))


def sim_config(overrides: Mapping[str, Any]) -> SimConfig:
    return SimConfig.from_dict(overrides)


def run(
    config: SimConfig,
    requests: Sequence[TraceRequest],
    policy: PolicySpec | Mapping,
    label: str = "",
    show_progress: bool = False,
) -> RunResult:
    """One simulated run, with a progress bar on stderr when asked."""
    spec = policy if isinstance(policy, PolicySpec) else PolicySpec.from_dict(policy)
    progress = Progress(len(requests), label or spec.name) if show_progress else None
    try:
        return run_policy(
            config, requests, spec, on_request_done=progress.advance if progress else None
        )
    finally:
        if progress is not None:
            progress.close()


def available_cores() -> int:
    """CPU cores this process may run on (the default number of parallel runs)."""
    return len(os.sched_getaffinity(0))


_TASK: Callable[[Any], Any] | None = None
"""The function `map_runs` applies, inherited by its forked workers (never pickled)."""


def _call_task(job: Any) -> Any:
    assert _TASK is not None
    return _TASK(job)


def map_runs(task: Callable[[Any], Any], jobs: Iterable[Any], workers: int = 1) -> list[Any]:
    """`task(job)` for every job, in the jobs' order, in up to `workers` processes.

    Runs are independent and each is deterministic given its config (its seed included),
    so the results do not depend on how many processes computed them. Workers are
    forked: they inherit `task` and what it closes over (the workload), and only the
    jobs and their results cross process boundaries, pickled, which keeps floats exact.
    """
    global _TASK
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        return [task(job) for job in jobs]
    _TASK = task
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
            return list(pool.map(_call_task, jobs))
    finally:
        _TASK = None


def attainment(records: Iterable[RequestRecord], slo: SloSpec) -> float:
    records = list(records)
    return sum(1 for r in records if slo.met(r)) / len(records) if records else math.nan


def summary_row(summary: RunSummary) -> dict[str, Any]:
    """The numbers of a run worth keeping in an experiment's JSON."""
    return {
        "requests": summary.requests,
        "completed": summary.completed,
        "aborted": summary.aborted,
        "lost": summary.lost,
        "ttft_s": summary.ttft_s,
        "tbt_s": summary.tbt_s,
        "tpot_s": summary.tpot_s,
        "transfer_s": summary.transfer_s,
        "slo_attainment": summary.slo_attainment,
        "tier_share": summary.tier_share,
        "prefill_hit_ratio": summary.prefill_hit_ratio,
        "decode_hit_ratio": summary.decode_hit_ratio,
        "recovery": summary.recovery,
        "recovery_restore": summary.recovery_restore,
        "aborted_by_reason": summary.aborted_by_reason,
        "wall_s": summary.wall_s,
        "sim_time_s": summary.sim_time_s,
        "events": summary.events,
    }


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "–"
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines.extend("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)
    return "\n".join(lines)


def pct_change(new: float, old: float) -> float:
    return 100.0 * (new - old) / old if old else math.nan


@dataclass
class Output:
    """Where an experiment writes `<name>.json`, `<name>.md` and `<name>_*.png`."""

    out_dir: Path
    name: str
    figures: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def write_json(self, data: Mapping[str, Any]) -> Path:
        path = self.out_dir / f"{self.name}.json"
        path.write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")
        return path

    def write_markdown(self, text: str) -> Path:
        path = self.out_dir / f"{self.name}.md"
        path.write_text(text.rstrip() + "\n")
        return path

    def figure(
        self, suffix: str, draw: Callable[[Any], None], size=(7.0, 4.0), ncols: int | None = None
    ) -> Path:
        """Draw with matplotlib's Agg backend (no display needed) and save a PNG.

        `draw` gets one axes, or a list of `ncols` axes side by side when ncols is given.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, ncols or 1, figsize=size, squeeze=False)
        draw(list(axes[0]) if ncols else axes[0][0])
        fig.tight_layout()
        path = self.out_dir / f"{self.name}_{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        self.figures.append(path)
        return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Path):
        return str(value)
    return value
