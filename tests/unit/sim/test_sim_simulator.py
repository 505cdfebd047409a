"""Whole runs: determinism for a seed, conservation with failures, recovery, telemetry."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest

from kvrs.errors import InvalidArgument
from kvrs.sim.config import PolicySpec, SimConfig
from kvrs.sim.metrics import ABORTED, COMPLETED
from kvrs.sim.simulator import Simulator, run_policy
from kvrs.sim.trace import TraceRequest, load_mooncake, scale_arrivals
from tests.unit.sim.workloads import busy_chat

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
NETKV = PolicySpec("netkv", "netkv")
KVRS = PolicySpec("kvrs", "netkv", network_view="live")


def _fingerprint(result):
    return [
        (
            r.index,
            r.status,
            r.decode_id,
            round(r.first_token_s, 9),
            round(r.finish_s, 9),
            None if math.isnan(r.tbt_s) else round(r.tbt_s, 9),
        )
        for r in result.records
    ]


def test_same_seed_same_run_even_with_background_and_failures():
    requests = scale_arrivals(load_mooncake(SAMPLE), 3.0)
    config = SimConfig.from_dict(
        {
            "background": {"utilisation": 0.3},
            "seed": 5,
            "failures": [{"at_s": 8.0, "instance": "decode-3"}, {"at_s": 12.0, "node": "n5"}],
        }
    )
    first = run_policy(config, requests, KVRS)
    second = run_policy(config, requests, KVRS)
    assert _fingerprint(first) == _fingerprint(second)
    assert first.stats["background_toggles"] > 0
    other_seed = run_policy(config.replace(seed=6), requests, KVRS)
    assert _fingerprint(other_seed) != _fingerprint(first)


@pytest.mark.parametrize(
    "planner,policy",
    [
        ("batch", "kvrs"),
        ("per_request", "rom"),
        ("batch", "always_migrate"),
        ("per_request", "always_recompute"),
    ],
)
def test_every_request_ends_completed_or_aborted_through_failures(planner, policy):
    requests = busy_chat()
    config = SimConfig.from_dict(
        {
            "cluster": {"layout": "segregated"},
            "failures": [
                {"at_s": 4.0, "node": "n2"},
                {"at_s": 5.0, "instance": "decode-7"},
                {"at_s": 6.0, "instance": "prefill-0"},
                {"at_s": 6.5, "node": "n4"},
            ],
            "recovery": {"policy": policy, "planner": planner},
        }
    )
    result = run_policy(config, requests, KVRS)
    summary = result.summary
    assert summary.lost == 0
    assert summary.completed + summary.aborted == summary.requests == len(requests)
    recovered = [r for r in result.records if r.recoveries]
    assert len(recovered) > 20
    assert all(r.status == COMPLETED for r in recovered)
    assert all(r.generated_tokens == r.output_tokens for r in recovered)
    # The last recovery of each resumed it (an earlier one may have been cut short by a
    # later failure, e.g. of the prefill its migration was reading from).
    assert all(r.recoveries[-1].resumed_s >= r.recoveries[-1].started_s for r in recovered)
    topology = config.cluster.build()
    dead = {i for i, spec in topology.instances.items() if spec.location.node in ("n2", "n4")}
    dead |= {"decode-7", "prefill-0"}
    assert result.stats["failed_instances"] == len(dead) == 6
    # Nothing finishes on a dead decode instance after the failures.
    assert not {r.decode_id for r in result.records if r.finish_s > 7.0} & dead


@pytest.mark.parametrize("planner,policy", [("batch", "kvrs"), ("per_request", "rom")])
def test_a_run_makes_no_reference_cycles(planner, policy):
    """Runs pause the cycle collector, so what a run drops must be freed by reference
    counting; a cycle made per request would be held to the end of a long run."""
    config = SimConfig.from_dict(
        {
            "cluster": {"layout": "segregated"},
            "background": {"utilisation": 0.3},
            "failures": [{"at_s": 4.0, "node": "n2"}, {"at_s": 6.0, "instance": "prefill-0"}],
            "recovery": {"policy": policy, "planner": planner},
        }
    )
    run_policy(config, busy_chat(40), KVRS)  # modules imported on first use leave cycles
    simulator = Simulator(config, busy_chat(), KVRS)  # itself a cycle: kept alive
    gc.collect()
    gc.disable()  # nothing collected behind the test's back
    try:
        result = simulator.run()
        assert not _kvrs_cycles(), "the run left reference cycles"
    finally:
        gc.enable()
    assert result.stats["recovery_recompute"] + result.stats.get("recovery_migrate", 0) > 0


def _kvrs_cycles() -> list[str]:
    """The types of kvrs objects (instances, or functions kvrs defines) in the garbage a
    collection finds now. Other threads of the test process (servers and clients left by
    earlier tests) may drop cycles of their own meanwhile; those are not the run's."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = []
        for obj in gc.garbage:
            module = type(obj).__module__
            if module == "builtins":
                module = getattr(obj, "__module__", None) if callable(obj) else None
            if isinstance(module, str) and module.startswith("kvrs"):
                found.append(f"{module}.{type(obj).__qualname__}")
        return sorted(set(found))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def test_a_recovery_deadline_aborts_early_and_still_conserves():
    requests = busy_chat()
    config = SimConfig.from_dict(
        {
            "cluster": {"layout": "segregated"},
            "failures": [{"at_s": 4.0, "node": "n2"}],
            "recovery": {"policy": "kvrs", "planner": "batch", "deadline_s": 0.05},
        }
    )
    result = run_policy(config, requests, KVRS)
    assert result.summary.lost == 0
    aborted = [r for r in result.records if r.status == ABORTED]
    assert aborted and all(r.abort_reason.startswith("recovery") for r in aborted)
    assert result.summary.completed + len(aborted) == len(requests)


def test_batch_plan_spreads_a_node_failure_and_shares_links():
    requests = busy_chat(400, 40.0)
    results = {}
    for planner, policy in (("per_request", "rom"), ("batch", "kvrs")):
        config = SimConfig.from_dict(
            {
                "cluster": {"layout": "segregated"},
                "failures": [{"at_s": 6.0, "node": "n2"}],
                "recovery": {"policy": policy, "planner": planner},
            }
        )
        results[planner] = run_policy(config, requests, KVRS)
    targets = {
        planner: {rec.target_id for r in res.records for rec in r.recoveries}
        for planner, res in results.items()
    }
    assert len(targets["batch"]) > len(targets["per_request"])
    mean = {p: res.summary.recovery for p, res in results.items()}
    assert mean["batch"] and mean["per_request"]
    assert results["batch"].recovery_batches[0]["requests"] > 30


def test_stale_telemetry_reaches_decisions():
    requests = scale_arrivals(load_mooncake(SAMPLE), 4.0)
    fresh = run_policy(SimConfig.from_dict({"telemetry": {"state_period_s": 0.0}}), requests, NETKV)
    stale = run_policy(SimConfig.from_dict({"telemetry": {"state_period_s": 5.0}}), requests, NETKV)
    assert stale.stats["telemetry_samples"] < fresh.stats["telemetry_samples"]
    assert _fingerprint(stale) != _fingerprint(fresh)
    assert stale.summary.lost == fresh.summary.lost == 0


def test_lazy_instance_sampling_matches_eager_sampling(monkeypatch):
    # Views reuse an instance's state while it cannot have changed; forcing a fresh read
    # of every instance at every tick must give the very same run.
    requests = scale_arrivals(load_mooncake(SAMPLE), 3.0)
    config = SimConfig.from_dict({"background": {"utilisation": 0.3}})
    lazy = run_policy(config, requests, NETKV)
    monkeypatch.setattr("kvrs.sim.telemetry.Telemetry._busy", lambda self, i, t: True)
    eager = run_policy(config, requests, NETKV)
    assert _fingerprint(lazy) == _fingerprint(eager)


@pytest.mark.parametrize(("scope", "hit_tokens"), [("node", 0), ("global", 2047)])
def test_the_prefix_pool_scope_decides_whether_another_node_hits(scope, hit_tokens):
    # The same four-block prompt twice, prefilled on two nodes (round robin): a global
    # pool serves the second from the first's blocks (all but the one token always
    # computed), per-node pools do not. An empty pool once counted as no pool at all,
    # and "global" ran as "node".
    config = SimConfig.from_dict(
        {"serving": {"prefix_pool_scope": scope, "prefill_router": "round_robin"}}
    )
    prompt = (1, 2, 3, 4)
    requests = [TraceRequest(0, 0.0, 2048, 8, prompt), TraceRequest(1, 30.0, 2048, 8, prompt)]
    first, second = sorted(run_policy(config, requests, NETKV).records, key=lambda r: r.index)
    assert first.prefill_id != second.prefill_id
    assert (first.prefix_hit_tokens, second.prefix_hit_tokens) == (0, hit_tokens)


def test_kvrs_placement_with_joint_prefill_is_deterministic_and_moves_prefills():
    requests = scale_arrivals(load_mooncake(SAMPLE), 3.0)
    config = SimConfig.from_dict(
        {
            "background": {"utilisation": 0.3},
            "cluster": {"layout": "segregated"},
            "seed": 3,
            "failures": [{"at_s": 8.0, "instance": "decode-3"}],
        }
    )
    spec = PolicySpec("kvrs", "kvrs", network_view="trend", prefill="joint")
    first = run_policy(config, requests, spec)
    assert _fingerprint(first) == _fingerprint(run_policy(config, requests, spec))
    assert first.summary.lost == 0
    assert first.summary.completed + first.summary.aborted == len(requests)
    # The joint choice moves some prefills off the cache-aware router's pick.
    routed = run_policy(config, requests, PolicySpec("kvrs", "kvrs", network_view="trend"))
    assert [r.prefill_id for r in routed.records] != [r.prefill_id for r in first.records]
    with pytest.raises(InvalidArgument, match="policy.prefill"):
        PolicySpec("kvrs", "kvrs", prefill="both")


def test_a_joint_prefill_needs_a_placement_policy_that_chooses_it():
    config = SimConfig.from_dict({"cluster": {"layout": "segregated"}})
    requests = [TraceRequest(0, 0.0, 512, 8, (1,))]
    for spec in (
        PolicySpec("netkv", "netkv", prefill="joint"),
        PolicySpec("kvrs", "kvrs", mode="recovery", prefill="joint"),
    ):
        with pytest.raises(InvalidArgument, match="policy.prefill.*chooses the prefill"):
            run_policy(config, requests, spec)
