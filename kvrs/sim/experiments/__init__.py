"""Simulator experiments, each writing `<name>.json`, `<name>.md` and `<name>_*.png`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

# name -> (module, function, one-line description); modules load only when run.
EXPERIMENTS: dict[str, tuple[str, str, str]] = {
    "netkv": (
        "kvrs.sim.experiments.netkv",
        "run_experiment",
        "64-GPU fat-tree: placement policies under load, congestion, caps, staleness",
    ),
    "rom-crossover": (
        "kvrs.sim.experiments.rom",
        "run_crossover",
        "queue-depth crossover of local wait vs migration (Q* = 6.45)",
    ),
    "rom-goodput": (
        "kvrs.sim.experiments.rom",
        "run_goodput",
        "goodput under load skew: static, always-*, rom, kvrs",
    ),
    "recovery": (
        "kvrs.sim.experiments.recovery",
        "run_experiment",
        "HYBRID at the crossover; node failure: per-request rom vs batch plan",
    ),
}


PARALLEL_EXPERIMENTS = frozenset({"netkv", "rom-goodput", "recovery"})
"""Experiments whose runs are independent, taking `workers=N` to run N at a time."""


def experiment(name: str) -> Callable[..., dict]:
    module, function, _ = EXPERIMENTS[name]
    return getattr(importlib.import_module(module), function)
