"""Learning from outcomes: each correction moves with its own term only, stays bounded,
ignores outliers and old outcomes, and decisions keep MIGRATE unless a more complex
option wins by more than its measured error."""

from __future__ import annotations

import dataclasses

import pytest

from kvrs.cluster import ClusterView, InstanceState
from kvrs.costmodel import CostModel
from kvrs.errors import InvalidArgument
from kvrs.learning import (
    AssignedWork,
    Corrections,
    LearningConfig,
    Outcome,
    Terms,
    error_stats,
    fit,
    relative_error,
)
from kvrs.model import model_spec
from kvrs.network import NetworkModel
from kvrs.profile import BatchCost, ComputeProfile
from kvrs.recovery import Action, Kvrs, RecoveryRequest
from kvrs.topology import InstanceSpec, Location, Role, Tier, TierSpec, Topology

BASE = ComputeProfile("tiny", a_s=1e-3, b_s_per_token=1e-4)
NOW_S = 1_000_000.0
MB = 1_000_000


def transfer(kv_bytes: int, fixed_s: float, bps: float, at_s: float = NOW_S, **kw) -> Outcome:
    """A placement that moved `kv_bytes` over p0 -> d0 in fixed_s + 8·bytes / bps."""
    stream_s = 8 * kv_bytes / bps
    return Outcome(
        kind="placement",
        request_id=f"r-{kv_bytes}-{at_s}",
        source_id="p0",
        target_id="d0",
        at_s=at_s,
        predicted=Terms(
            setup_s=1e-3, stream_s=8 * kv_bytes / 1e11, total_s=1e-3 + 8 * kv_bytes / 1e11
        ),
        measured=Terms(setup_s=fixed_s, stream_s=stream_s, total_s=fixed_s + stream_s),
        kv_bytes=kv_bytes,
        **kw,
    )


def prefill(tokens: int, factor: float, at_s: float = NOW_S) -> Outcome:
    """A RECOMPUTE whose prefill took `factor` times the base profile's time."""
    return Outcome(
        kind="recompute",
        request_id=f"r-pf-{tokens}-{at_s}",
        source_id="p0",
        target_id="d0",
        at_s=at_s,
        predicted=Terms(prefill_s=BASE.prefill_s(tokens), total_s=BASE.prefill_s(tokens)),
        measured=Terms(prefill_s=factor * BASE.prefill_s(tokens), total_s=1.0),
        prefill_tokens=tokens,
    )


def test_transfers_of_many_sizes_fit_the_links_fixed_cost_and_rate_and_nothing_else() -> None:
    outcomes = [transfer(n * MB, fixed_s=0.005, bps=2e9) for n in (1, 2, 3, 5, 8, 13)]
    corrections = fit(outcomes, BASE, NOW_S)
    link = corrections.link("p0", "d0")
    assert link is not None and link.samples == 6
    assert link.fixed_s == pytest.approx(0.005, rel=1e-6)
    assert link.bandwidth_bps == pytest.approx(2e9, rel=1e-6)
    assert corrections.link("d0", "p0") is None
    assert corrections.compute_factor == 1.0
    assert corrections.wait_per_decode_s == 0.0


def test_a_transfer_streamed_under_its_prefill_fits_no_link() -> None:
    """Its measured stream is only what the prefill left of it: a link fitted on it would
    look far faster than it is."""
    outcomes = [transfer(n * MB, fixed_s=0.0, bps=1e13, streamed=True) for n in (1, 2, 3, 5)]
    assert fit(outcomes, BASE, NOW_S).link("p0", "d0") is None
    plain = [transfer(n * MB, fixed_s=0.005, bps=2e9) for n in (1, 2, 3, 5)]
    link = fit([*plain, *outcomes], BASE, NOW_S).link("p0", "d0")
    assert link is not None and link.samples == 4
    assert link.bandwidth_bps == pytest.approx(2e9, rel=1e-6)


def test_transfers_of_one_size_fit_only_the_fixed_cost_at_the_predicted_rate() -> None:
    outcomes = [transfer(4 * MB, fixed_s=0.02, bps=1e11) for _ in range(5)]
    outcomes = [dataclasses.replace(o, request_id=f"r{i}") for i, o in enumerate(outcomes)]
    link = fit(outcomes, BASE, NOW_S).link("p0", "d0")
    assert link is not None
    assert link.bandwidth_bps == pytest.approx(1e11)
    assert link.fixed_s == pytest.approx(0.02, rel=1e-6)


def test_slow_forward_passes_move_the_compute_factor_and_no_link() -> None:
    outcomes = [prefill(tokens, factor=2.5) for tokens in (100, 400, 900, 1600)]
    corrections = fit(outcomes, BASE, NOW_S)
    assert corrections.compute_factor == pytest.approx(2.5)
    assert corrections.links == {}
    scaled = corrections.compute_profile(BASE)
    assert scaled.prefill_s(500) == pytest.approx(2.5 * BASE.prefill_s(500))
    assert scaled.extend_s(500, 20) == pytest.approx(2.5 * BASE.extend_s(500, 20))


def test_a_decode_targets_excess_wait_per_decoding_request_is_its_interference() -> None:
    outcomes = [
        dataclasses.replace(
            transfer(MB, 0.001, 1e11),
            request_id=f"r-{running}",
            measured=Terms(setup_s=0.001, target_wait_s=0.003 * running),
            target_running=running,
        )
        for running in (1, 2, 4, 8)
    ]
    corrections = fit(outcomes, BASE, NOW_S)
    assert corrections.wait_per_decode_s == pytest.approx(0.003)
    assert corrections.compute_factor == 1.0


def test_one_absurd_measurement_moves_no_correction_much() -> None:
    normal = [prefill(tokens, factor=2.0) for tokens in (100, 200, 300, 400, 500, 600, 700)]
    normal += [transfer(n * MB, fixed_s=0.005, bps=2e9) for n in (1, 2, 3, 5, 8, 13)]
    absurd = [
        dataclasses.replace(prefill(250, factor=1e6), request_id="stalled"),
        dataclasses.replace(transfer(4 * MB, fixed_s=30.0, bps=2e9), request_id="stalled-x"),
    ]
    clean, dirty = fit(normal, BASE, NOW_S), fit(normal + absurd, BASE, NOW_S)
    assert dirty.compute_factor == pytest.approx(clean.compute_factor, rel=0.05)
    link, dirty_link = clean.link("p0", "d0"), dirty.link("p0", "d0")
    assert link is not None and dirty_link is not None
    assert dirty_link.fixed_s == pytest.approx(link.fixed_s, abs=0.01)
    assert dirty_link.bandwidth_bps == pytest.approx(link.bandwidth_bps, rel=0.3)


def test_a_links_rate_stays_in_its_band_around_the_predicted_rate() -> None:
    outcomes = [transfer(n * MB, fixed_s=0.005, bps=1e6) for n in (1, 2, 3, 5, 8, 13)]
    link = fit(outcomes, BASE, NOW_S, LearningConfig(max_rate_factor=10.0)).link("p0", "d0")
    assert link is not None and link.bandwidth_bps == pytest.approx(1e10)


def test_corrections_stay_in_their_band_and_need_enough_outcomes() -> None:
    config = LearningConfig(max_factor=4.0, min_samples=3)
    assert fit([prefill(100, 100.0), prefill(200, 100.0)], BASE, NOW_S, config).compute_factor == 1
    many = [prefill(100 * i, 100.0) for i in range(1, 6)]
    assert fit(many, BASE, NOW_S, config).compute_factor == 4.0
    fast = [prefill(100 * i, 1e-3) for i in range(1, 6)]
    assert fit(fast, BASE, NOW_S, config).compute_factor == 0.25


def test_old_outcomes_age_out_and_the_window_keeps_the_newest() -> None:
    config = LearningConfig(max_age_s=60.0, window=5)
    old = [prefill(100 * i, 3.0, at_s=NOW_S - 120.0) for i in range(1, 6)]
    new = [prefill(100 * i, 1.5, at_s=NOW_S - 1.0) for i in range(1, 6)]
    assert fit(old, BASE, NOW_S, config).compute_factor == 1.0
    assert fit(old + new, BASE, NOW_S, config).compute_factor == pytest.approx(1.5)
    assert fit(new + old, BASE, NOW_S - 100.0, config).samples == 5


def test_error_statistics_per_kind_and_term() -> None:
    outcomes = [
        Outcome(
            kind="migrate",
            request_id=f"m{i}",
            source_id="p0",
            target_id="d0",
            at_s=NOW_S,
            predicted=Terms(total_s=1.0),
            measured=Terms(total_s=measured),
        )
        for i, measured in enumerate((1.0, 1.25, 2.0, 4.0, 0.5))
    ]
    stats = error_stats(outcomes, last_n=64)
    total = stats[("migrate", "total_s")]
    assert total.samples == 5
    assert total.p50 == pytest.approx(0.5)  # errors 0, 0.2, 0.5, 0.75, 1.0
    assert ("migrate", "setup_s") not in stats
    assert relative_error(0.0, 0.0) == 0.0 and relative_error(1.0, 0.0) == 1.0


def test_a_bad_outcome_names_its_field() -> None:
    with pytest.raises(InvalidArgument) as raised:
        Outcome("teleport", "r", "p0", "d0", NOW_S, Terms(), Terms())
    assert raised.value.field == "kind"
    with pytest.raises(InvalidArgument) as raised:
        Outcome("migrate", "r", "p0", "d0", NOW_S, Terms(), Terms(total_s=float("nan")))
    assert raised.value.field == "measured.total_s"
    outcome = transfer(MB, 0.001, 1e9)
    assert Outcome.from_json(outcome.to_json()) == outcome


def test_assigned_work_counts_until_a_newer_heartbeat_or_done() -> None:
    work = AssignedWork()
    work.add("d0", at_s=10.0, work_s=0.5)
    work.add("d0", at_s=10.1, work_s=0.5)
    assert work.pending_s("d0", now_s=10.2, reported_at_s=9.9) == pytest.approx(0.8)
    assert work.pending_s("d1", now_s=10.2, reported_at_s=9.9) == 0.0
    # A heartbeat taken after the first assignment already counts it.
    assert work.pending_s("d0", now_s=10.2, reported_at_s=10.05) == pytest.approx(0.4)
    assert work.pending_s("d0", now_s=20.0, reported_at_s=10.05) == 0.0


def _cluster(margins: dict[str, float] | None = None) -> tuple[CostModel, ClusterView]:
    """p0 and d0 on one node: MIGRATE and a HYBRID that saves very little."""
    tiers = {tier: TierSpec(capacity_bps=8e9, hop_latency_s=0.0) for tier in Tier}
    topology = Topology(tiers, setup_latency_s=0.0)
    topology.add_instance(InstanceSpec("p0", Role.PREFILL, Location("n0", "r0")))
    topology.add_instance(InstanceSpec("d0", Role.DECODE, Location("n0", "r0", gpu_index=1)))
    profile = ComputeProfile("tiny", a_s=0.0, b_s_per_token=4e-4)
    cost = CostModel(model_spec("tiny"), profile, NetworkModel(topology), margins=margins)
    view = ClusterView(
        {"p0": InstanceState("p0", Role.PREFILL), "d0": InstanceState("d0", Role.DECODE)}, 0.0
    )
    return cost, view


def test_a_more_complex_option_must_beat_migrate_by_more_than_its_measured_error() -> None:
    request = RecoveryRequest("r", prompt_tokens=4000, generated_tokens=10, source_prefill_id="p0")
    cost, view = _cluster()
    plain = Kvrs().decide(request, view, cost, 0.0)
    migrate = next(o for o in plain.options if o.action is Action.MIGRATE)
    assert plain.action is Action.HYBRID and plain.cost_s < migrate.cost_s
    gain = 1.0 - plain.cost_s / migrate.cost_s
    cautious_cost, _ = _cluster({"hybrid": 2 * gain, "migrate": 0.0})
    cautious = Kvrs().decide(request, view, cautious_cost, 0.0)
    assert cautious.action is Action.MIGRATE and "measured error" in cautious.reason
    bold_cost, _ = _cluster({"hybrid": gain / 2, "migrate": 0.0})
    assert Kvrs().decide(request, view, bold_cost, 0.0).action is Action.HYBRID
    # MIGRATE's own error counts too: as unsure as HYBRID, it no longer wins.
    even_cost, _ = _cluster({"hybrid": 2 * gain, "migrate": 2 * gain})
    assert Kvrs().decide(request, view, even_cost, 0.0).action is Action.HYBRID


def test_an_option_nobody_measured_is_not_taken_for_an_exact_one() -> None:
    """Only HYBRID's error is known (MIGRATE was never chosen): MIGRATE counts as that
    uncertain too, so the measured error alone does not turn the HYBRID into a MIGRATE."""
    request = RecoveryRequest("r", prompt_tokens=4000, generated_tokens=10, source_prefill_id="p0")
    cost, view = _cluster({"hybrid": 1.0})
    decision = Kvrs().decide(request, view, cost, 0.0)
    assert decision.action is Action.HYBRID, decision.reason


def test_abort_checks_the_upper_end_of_the_prediction() -> None:
    cost, view = _cluster()
    probe = RecoveryRequest("r", prompt_tokens=4000, generated_tokens=10, source_prefill_id="p0")
    predicted_s = Kvrs().decide(probe, view, cost, 0.0).cost_s
    request = dataclasses.replace(probe, deadline_s=1.2 * predicted_s)
    assert Kvrs().decide(request, view, cost, 0.0).action is not Action.ABORT
    wary, _ = _cluster({"migrate": 0.5, "hybrid": 0.5, "recompute": 0.5})
    aborted = Kvrs().decide(request, view, wary, 0.0)
    assert aborted.action is Action.ABORT and "measured error" in aborted.reason


def test_margins_need_enough_outcomes_and_are_capped() -> None:
    outcomes = [
        Outcome("hybrid", f"h{i}", "p0", "d0", NOW_S, Terms(total_s=0.1), Terms(total_s=1.0))
        for i in range(3)
    ]
    corrections = fit(outcomes, BASE, NOW_S)
    assert corrections.margins() == {"hybrid": 0.9}
    assert corrections.margins(cap=0.5) == {"hybrid": 0.5}
    assert fit(outcomes[:2], BASE, NOW_S).margins() == {}
    assert Corrections().margins() == {}


def test_a_workers_wait_beyond_its_reported_queue_is_its_own_correction() -> None:
    outcomes = [
        dataclasses.replace(
            prefill(100 * i, factor=1.0),
            predicted=Terms(source_wait_s=0.01, prefill_s=BASE.prefill_s(100 * i)),
            measured=Terms(source_wait_s=0.03, prefill_s=BASE.prefill_s(100 * i)),
        )
        for i in range(1, 5)
    ]
    corrections = fit(outcomes, BASE, NOW_S)
    assert corrections.worker_wait_s == {"p0": pytest.approx(0.02)}
    assert corrections.compute_factor == pytest.approx(1.0)
    assert corrections.wait_per_decode_s == 0.0 and corrections.links == {}


def test_a_simulated_runs_recoveries_replay_into_the_next_runs_margins() -> None:
    from kvrs.sim.config import SimConfig
    from kvrs.sim.metrics import RecoveryRecord, RequestRecord, recovery_outcomes

    records = []
    for i, restored_s in enumerate((1.2, 1.5, 2.0, 1.1)):
        record = RequestRecord(i, 0.0, 1000, 100)
        record.recoveries.append(
            RecoveryRecord("hybrid", started_s=10.0, restored_s=10.0 + restored_s, predicted_s=1.0)
        )
        records.append(record)
    unfinished = RequestRecord(9, 0.0, 1000, 100)
    unfinished.recoveries.append(RecoveryRecord("migrate", started_s=10.0, predicted_s=1.0))
    outcomes = recovery_outcomes([*records, unfinished])
    assert [o.kind for o in outcomes] == ["hybrid"] * 4
    margins = fit(outcomes, BASE, 10.0).margins()
    assert set(margins) == {"hybrid"} and 0.4 < margins["hybrid"] < 0.5
    config = SimConfig.from_dict({"recovery": {"margins": margins}})
    assert config.recovery.margins == margins
    with pytest.raises(InvalidArgument) as raised:
        SimConfig.from_dict({"recovery": {"margins": {"hybrid": -1.0}}})
    assert raised.value.field == "recovery.margins.hybrid"


def queued(jobs: int, fixed_s: float, at_s: float, request_id: str) -> Outcome:
    """A recovery carried out beside `jobs` − 1 others on its target, predicted with a
    1 ms set-up: its transfer took `jobs` times its own (its set-up really cost fixed_s),
    and its extend then waited 30 ms for each of the others' (queued, not set-up)."""
    stream_s = 8 * MB / 1e11
    transfer_s = jobs * (fixed_s + stream_s)
    return Outcome(
        kind="migrate",
        request_id=request_id,
        source_id="p0",
        target_id="d0",
        at_s=at_s,
        predicted=Terms(
            setup_s=1e-3,
            stream_s=stream_s,
            target_wait_s=(jobs - 1) * 1e-3,
            total_s=jobs * 1e-3 + stream_s,
        ),
        measured=Terms(
            setup_s=transfer_s - stream_s,
            stream_s=stream_s,
            target_wait_s=(jobs - 1) * 0.03,
            total_s=transfer_s + (jobs - 1) * 0.03,
        ),
        kv_bytes=MB,
        target_jobs=jobs,
    )


def test_a_links_fixed_cost_is_a_transfers_share_of_those_run_beside_it() -> None:
    """Beside others on its target, a decision's share of its transfer as measured is its
    fixed cost (the target serves pulls started together in turn); the queue of their
    work its total also holds is not set-up."""
    outcomes = [queued(jobs, 0.02, NOW_S, f"r{jobs}") for jobs in (1, 4, 8, 12)]
    corrections = fit(outcomes, BASE, NOW_S)
    link = corrections.link("p0", "d0")
    assert link is not None
    assert link.fixed_s == pytest.approx(0.02, rel=1e-6)
    # A pair no decision has used yet is priced with the measured pairs' fixed cost.
    assert corrections.new_link_fixed_s == pytest.approx(0.02, rel=1e-6)
    assert corrections.unmeasured_rtt_s(0.001) == pytest.approx(0.02, rel=1e-6)
    assert corrections.unmeasured_rtt_s(0.5) == 0.5
    # Queued recoveries are not interference, nor a worker's own excess wait.
    assert corrections.wait_per_decode_s == 0.0
    assert corrections.worker_wait_s == {}


def test_an_outcome_must_count_its_own_job() -> None:
    with pytest.raises(InvalidArgument) as info:
        queued(0, 0.02, NOW_S, "r")
    assert info.value.field == "target_jobs"


def test_passes_shared_with_other_decisions_do_not_move_the_compute_factor() -> None:
    """A batching worker reports the whole batch's pass to each decision in it."""
    solo = [prefill(tokens, factor=2.0) for tokens in (100, 400, 900)]
    shared = [
        dataclasses.replace(prefill(tokens, factor=12.0), request_id=f"b{tokens}", target_jobs=8)
        for tokens in (200, 300, 500, 700, 800)
    ]
    corrections = fit(solo + shared, BASE, NOW_S)
    assert corrections.compute_factor == pytest.approx(2.0)
    # The batched-pass cost scales with the rest of the profile.
    batched = dataclasses.replace(BASE, batch=BatchCost(a_s=1e-3, b_s_per_token=1e-4))
    scaled = corrections.compute_profile(batched)
    segments = [(0, 100), (50, 10)]
    assert scaled.batch_s(segments) == pytest.approx(2.0 * batched.batch_s(segments))


def test_a_slow_prefill_moves_the_compute_factor_not_the_links_fixed_cost() -> None:
    """RECOMPUTEs over p0 -> d0 whose prefill ran 3× slower than the base profile and
    whose transfer cost what was predicted: the compute factor moves, the link does not."""
    outcomes = []
    for tokens in (100, 300, 600, 900):
        predicted_pf = BASE.prefill_s(tokens)
        stream_s = 8 * tokens * 1000 / 1e11
        outcomes.append(
            Outcome(
                kind="recompute",
                request_id=f"slow-{tokens}",
                source_id="p0",
                target_id="d0",
                at_s=NOW_S,
                predicted=Terms(
                    prefill_s=predicted_pf,
                    setup_s=0.004,
                    stream_s=stream_s,
                    total_s=predicted_pf + 0.004 + stream_s,
                ),
                measured=Terms(
                    prefill_s=3 * predicted_pf,
                    setup_s=0.004,
                    stream_s=stream_s,
                    total_s=3 * predicted_pf + 0.004 + stream_s,
                ),
                kv_bytes=tokens * 1000,
                prefill_tokens=tokens,
            )
        )
    corrections = fit(outcomes, BASE, NOW_S)
    assert corrections.compute_factor == pytest.approx(3.0)
    link = corrections.link("p0", "d0")
    assert link is not None and link.fixed_s == pytest.approx(0.004, rel=1e-3)


def test_a_placements_prefill_is_not_in_its_links_fixed_cost() -> None:
    """A placement's total starts once its prompt is prefilled: how much faster or slower
    the prefill ran than predicted says nothing about the transfer's set-up."""
    outcomes = []
    for n, prefill_error_s in zip((1, 2, 3, 5), (-0.010, -0.020, 0.015, -0.005), strict=True):
        o = transfer(n * MB, fixed_s=0.003, bps=1e11)
        outcomes.append(
            dataclasses.replace(
                o,
                predicted=dataclasses.replace(o.predicted, prefill_s=0.050),
                measured=dataclasses.replace(o.measured, prefill_s=0.050 + prefill_error_s),
            )
        )
    link = fit(outcomes, BASE, NOW_S).link("p0", "d0")
    assert link is not None
    assert link.fixed_s == pytest.approx(0.003, rel=1e-6)


def test_a_wait_is_fitted_against_its_prediction_without_the_corrections_in_it() -> None:
    """Placements on an idle d0 waited 3 ms more than its W(x) says; the ones predicted
    with 2 ms of worker wait already in `target_wait_s` still teach 3 ms, not the 1 ms
    left over (which the next fit would halve again)."""
    corrections = Corrections(worker_wait_s={"d0": 0.002}, wait_per_decode_s=0.0005)
    outcomes = []
    for n in (1, 2, 3, 5):
        o = transfer(n * MB, 0.001, 1e11)
        reported = dataclasses.replace(
            o,
            predicted=dataclasses.replace(o.predicted, target_wait_s=0.004 + 0.002),
            measured=dataclasses.replace(o.measured, target_wait_s=0.004 + 0.003),
            extend_tokens=1,
        )
        noted = corrections.applied_to(reported)
        assert noted.learned_target_wait_s == pytest.approx(0.002)
        outcomes.append(noted)
    assert fit(outcomes, BASE, NOW_S).worker_wait_s == {"d0": pytest.approx(0.003)}
    # Interference is noted per request decoding on the target, the prefill instance's
    # worker wait for a RECOMPUTE only.
    busy = corrections.applied_to(dataclasses.replace(outcomes[0], target_running=4))
    assert busy.learned_target_wait_s == pytest.approx(0.002 + 4 * 0.0005)
    assert busy.learned_source_wait_s == 0.0
    recompute = Corrections(worker_wait_s={"p0": 0.01}).applied_to(prefill(100, 1.0))
    assert recompute.learned_source_wait_s == pytest.approx(0.01)
    assert Outcome.from_json(recompute.to_json()) == recompute


def test_a_placement_alone_leaves_its_predicted_queue_out_of_its_links_fixed_cost() -> None:
    """Placed alone, its total holds the queue at the target that the next prediction
    prices again beside the fixed cost: counted in both, it would be priced twice."""
    outcomes = []
    for n in (1, 2, 3, 5):
        o = transfer(n * MB, fixed_s=0.003, bps=1e11)
        outcomes.append(
            dataclasses.replace(
                o,
                predicted=dataclasses.replace(
                    o.predicted, target_wait_s=0.004, total_s=o.predicted.total_s + 0.004
                ),
                measured=dataclasses.replace(
                    o.measured, target_wait_s=0.004, total_s=o.measured.total_s + 0.004
                ),
            )
        )
    link = fit(outcomes, BASE, NOW_S).link("p0", "d0")
    assert link is not None
    assert link.fixed_s == pytest.approx(0.003, rel=1e-6)


def test_a_queue_longer_than_predicted_is_the_workers_wait_not_the_links_fixed_cost() -> None:
    """Placed alone on an idle target, each waited 20 ms more for its first step than
    predicted: the worker's own wait takes that, and the link's fixed cost stays what
    the transfers took (counted in both, it would be priced twice, and in a recovery
    batch once per recovery sharing the target)."""
    outcomes = []
    for n in (1, 2, 3, 5):
        o = transfer(n * MB, fixed_s=0.003, bps=1e11, extend_tokens=1)
        outcomes.append(
            dataclasses.replace(
                o,
                measured=dataclasses.replace(
                    o.measured, target_wait_s=0.02, total_s=o.measured.total_s + 0.02
                ),
            )
        )
    corrections = fit(outcomes, BASE, NOW_S)
    link = corrections.link("p0", "d0")
    assert link is not None
    assert link.fixed_s == pytest.approx(0.003, rel=1e-6)
    assert corrections.worker_wait_s == {"d0": pytest.approx(0.02)}
