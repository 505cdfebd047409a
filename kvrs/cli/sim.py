"""`kvrs sim <experiment> [--config file] [--out dir]`: run a simulator experiment.

`kvrs sim run --trace file --policy netkv` simulates one trace under one policy and
prints the summary as JSON. Experiments write JSON, a markdown table and PNG figures, and
print that markdown (the headline numbers and the table) on stdout, figures named by path,
so the answer is on the terminal and not only in a file.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from kvrs.errors import InvalidArgument, KvrsError
from kvrs.sim.experiments import EXPERIMENTS, PARALLEL_EXPERIMENTS, experiment
from kvrs.sim.telemetry import NETWORK_VIEWS
from kvrs.yamlfile import load_yaml

log = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    names = [*EXPERIMENTS, "run"]
    parser.add_argument(
        "experiment",
        choices=names,
        metavar="EXPERIMENT",
        help="; ".join(f"{n}: {d}" for n, (_, _, d) in EXPERIMENTS.items())
        + "; run: one trace under one policy",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML/JSON laid over the experiment's defaults (for run: a SimConfig)",
    )
    parser.add_argument("--out", type=Path, help="output directory (default runs/sim/NAME)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="simulations run side by side, each in its own process (default: the cores "
        f"available); experiments: {', '.join(sorted(PARALLEL_EXPERIMENTS))}",
    )
    parser.add_argument("--trace", type=Path, help="run: a Mooncake-format trace")
    parser.add_argument("--policy", default="netkv", help="run: a placement policy")
    parser.add_argument(
        "--network-view",
        default="telemetry",
        choices=NETWORK_VIEWS,
        help="run: what it knows",
    )
    parser.add_argument(
        "--prefill",
        default="router",
        choices=("router", "joint"),
        help="run: joint lets the placement policy choose the prefill too (kvrs)",
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="run: arrival speed-up")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    params: dict[str, Any] = {}
    if args.config is not None:
        params = load_yaml(args.config) or {}
    try:
        if args.experiment == "run":
            return _single_run(args, params)
        out = args.out or Path("runs") / "sim" / args.experiment
        if args.jobs < 0:
            raise InvalidArgument("jobs", f"must be >= 1 (0: the cores available), got {args.jobs}")
        extra = {}
        if args.experiment in PARALLEL_EXPERIMENTS:
            from kvrs.sim.experiments.common import available_cores

            extra["workers"] = args.jobs or available_cores()
        experiment(args.experiment)(params, out, not args.no_progress, **extra)
    except KvrsError as exc:
        print(f"kvrs sim: {exc}", file=sys.stderr)
        return 2
    print(headline(out / f"{args.experiment}.md"))
    print(f"kvrs sim {args.experiment}: results in {out}", file=sys.stderr)
    return 0


def headline(markdown_file: Path) -> str:
    """The experiment's markdown as a terminal shows it: text and tables as they are, each
    figure's image link replaced by the path of its PNG."""
    lines = []
    for line in markdown_file.read_text().splitlines():
        image = _IMAGE.fullmatch(line.strip())
        lines.append(f"figure: {markdown_file.parent / image.group(1)}" if image else line)
    return "\n".join(lines)


_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)]+)\)")


def _single_run(args: argparse.Namespace, params: dict) -> int:
    from kvrs.sim.config import PolicySpec, SimConfig
    from kvrs.sim.experiments.common import load_workload, summary_row
    from kvrs.sim.experiments.common import run as run_one

    workload = load_workload({"trace": str(args.trace) if args.trace else "default"})
    config = SimConfig.from_dict(params)
    policy = PolicySpec(
        args.policy, args.policy, network_view=args.network_view, prefill=args.prefill
    )
    result = run_one(
        config, workload.scaled(args.rate_scale), policy, show_progress=not args.no_progress
    )
    print(
        json.dumps(
            {
                "workload": workload.source,
                "summary": summary_row(result.summary),
                "stats": result.stats,
            },
            indent=2,
            default=str,
        )
    )
    return 0
