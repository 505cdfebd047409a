"""`--json FILE` for every bench: each figure it prints, machine-readable, so runs compare.

The file also records when it ran and how loaded the machine was (load average, CPUs):
on a shared machine the figures mean little without it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["add_json_argument", "write_json"]


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        metavar="FILE",
        type=Path,
        default=None,
        help="also write every printed figure to FILE (JSON)",
    )


def write_json(path: Path | None, bench: str, figures: dict[str, Any]) -> None:
    """Writes `figures` under a header naming the bench and the machine's load; no-op
    without a path."""
    if path is None:
        return
    payload = {
        "bench": bench,
        "measured_unix_s": time.time(),
        "load_average": list(os.getloadavg()),
        "cpus": os.cpu_count(),
        "figures": figures,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
