"""Discrete-event simulator of a disaggregated cluster driven by the kvrs core's decisions.

`run_policy(config, requests, policy)` replays a workload under one placement policy;
`SimConfig` holds every parameter; `kvrs sim` runs the experiments in
`kvrs.sim.experiments`. See docs/simulator.md.
"""

from kvrs.sim.config import (
    ClusterSpec,
    FailureSpec,
    PolicySpec,
    RecoverySpec,
    ServingSpec,
    SimConfig,
)
from kvrs.sim.generators import GENERATORS, GeneratedWorkload, make_generator
from kvrs.sim.metrics import RequestRecord, RunSummary, SloSpec, goodput_by_bisection
from kvrs.sim.simulator import RunResult, Simulator, run_policy
from kvrs.sim.trace import (
    SyntheticWorkload,
    TraceRequest,
    TraceStats,
    cap_context,
    load_mooncake,
    scale_arrivals,
    write_mooncake,
)

__all__ = [
    "ClusterSpec",
    "FailureSpec",
    "GENERATORS",
    "GeneratedWorkload",
    "PolicySpec",
    "RecoverySpec",
    "RequestRecord",
    "RunResult",
    "RunSummary",
    "ServingSpec",
    "SimConfig",
    "Simulator",
    "SloSpec",
    "SyntheticWorkload",
    "TraceRequest",
    "TraceStats",
    "cap_context",
    "goodput_by_bisection",
    "load_mooncake",
    "make_generator",
    "run_policy",
    "scale_arrivals",
    "write_mooncake",
]
