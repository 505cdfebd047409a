"""How to recover a request whose decode instance died: MIGRATE, RECOMPUTE, HYBRID or ABORT.

For a request with prompt L, g tokens generated, prompt KV still on prefill p:

    MIGRATE to d          W(d) + T_x(p, d, S(L)) + T_ext(L, g)
    RECOMPUTE via p' to d W(p') + T_pf(L + g) + T_x(p', d, S(L + g)) + W(d)
    HYBRID to d           W(d) + max(T_pf(k), T_x(p, d, S(L − k))) + T_ext(L, g)

HYBRID recomputes blocks [0, k) on d while [k, L) streams from p; the KV of position i
depends only on tokens ≤ i, so the joined cache is exact. k = 0 is MIGRATE, so the best
split is never worse than migrating to the same target. RECOMPUTE's KV lands on d too,
where the last generated token is fed as an extend behind d's queue: W(d) counts there.
`Kvrs` takes the cheapest option over every action and target (ties go to MIGRATE), and
ABORTs early when even the cheapest misses the deadline. MIGRATE and HYBRID need the
source's KV and a migration slot; without either they are infeasible and the next option
wins. `Rom` reproduces the RecomputeOrMigrate rule; `AlwaysMigrate` and `AlwaysRecompute`
force one mode.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from kvrs._columns import Columns, WaitPlan
from kvrs.cluster import ClusterView
from kvrs.costmodel import CostModel, prefix_hit_tokens
from kvrs.errors import FailedPrecondition, InvalidArgument
from kvrs.profile import ComputeProfile
from kvrs.topology import LinkId

__all__ = [
    "NEEDS_SLOT",
    "RECOVERY_POLICY_NAMES",
    "Action",
    "AlwaysMigrate",
    "AlwaysRecompute",
    "Kvrs",
    "OptionCost",
    "RecoveryDecision",
    "RecoveryPolicy",
    "RecoveryRequest",
    "Rom",
    "assigned_work",
    "chosen_option",
    "decide_without_slot",
    "hybrid_split",
    "kv_tokens_moved",
    "make_recovery_policy",
]

if TYPE_CHECKING:
    import numpy as np

_INF = math.inf
_new = object.__new__
_COLUMNS_CACHE_MAX = 64
TIE_TOLERANCE_S = 1e-9
"""Costs closer than this are a tie (then MIGRATE, which moves no compute, wins)."""


class Action(Enum):
    """The way a request on a failed decode instance continues."""

    MIGRATE = "migrate"
    RECOMPUTE = "recompute"
    HYBRID = "hybrid"
    ABORT = "abort"


NEEDS_SLOT = frozenset({Action.MIGRATE, Action.HYBRID})
"""Actions that stream KV off a prefill instance, so hold one of the migration slots."""


@dataclass(frozen=True)
class RecoveryRequest:
    """A request stranded by a failed decode instance."""

    request_id: str
    prompt_tokens: int
    generated_tokens: int
    source_prefill_id: str
    """The prefill instance that holds the request's prompt KV."""
    deadline_s: float | None = None
    """Absolute SLO deadline on the decision's clock; None for no deadline."""
    source_kv_available: bool = True
    exclude_ids: frozenset[str] = frozenset()
    """Instances not to use (the failed one, typically)."""
    prefix_hashes: tuple[int, ...] = ()
    """The prompt's block hashes: a target already holding leading blocks is sent only the
    rest (MIGRATE and HYBRID; RECOMPUTE's KV is a fresh one)."""

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise InvalidArgument("prompt_tokens", f"must be >= 0, got {self.prompt_tokens}")
        if self.generated_tokens < 0:
            raise InvalidArgument("generated_tokens", f"must be >= 0, got {self.generated_tokens}")
        if not self.source_prefill_id:
            raise InvalidArgument("source_prefill_id", "must not be empty")


@dataclass(frozen=True)
class OptionCost:
    """One evaluated option: its predicted cost and the terms it is made of."""

    action: Action
    target_id: str
    source_id: str
    """Where the KV (or the recompute) comes from."""
    cost_s: float
    wait_s: float
    transfer_s: float
    compute_s: float
    split_tokens: int = 0
    """HYBRID: tokens [0, k) not streamed (recomputed on the target, or already held
    there), [k, L) migrated. MIGRATE: the leading tokens the target already holds."""
    feasible: bool = True
    infeasible_reason: str = ""
    target_wait_s: float = 0.0
    """RECOMPUTE: W(d), the target's queue before the final extend (`wait_s` is then the
    prefill instance's); MIGRATE and HYBRID: equal to `wait_s`."""


@dataclass(frozen=True)
class RecoveryDecision:
    """What to do with one request, and the options it was chosen from."""

    request_id: str
    action: Action
    target_id: str
    source_id: str
    cost_s: float
    split_tokens: int
    options: tuple[OptionCost, ...]
    """The best option of every action evaluated, feasible or not."""
    reason: str
    slack_s: float
    """deadline − now − cost; +inf without a deadline."""
    runner_up: OptionCost | None
    """The cheapest feasible option not chosen (for ABORT: the cheapest, which was late)."""
    policy: str
    planned_jobs: int = 1
    """Recoveries the price shares the target with, this one included (a batch plan's)."""


def chosen_option(decision: RecoveryDecision) -> OptionCost | None:
    """The option a decision carries out (None for ABORT)."""
    for option in decision.options:
        if (
            option.action is decision.action
            and option.target_id == decision.target_id
            and option.source_id == decision.source_id
            and option.feasible
        ):
            return option
    return None


def assigned_work(decision: RecoveryDecision) -> tuple[tuple[str, float], ...]:
    """(instance id, seconds) of the work carrying out `decision` puts on each instance,
    what a planner or a scheduler adds to their W(x) before any heartbeat reports it:
    RECOMPUTE's prefill on its prefill instance and the transfer the target drives;
    MIGRATE and HYBRID everything the target does, the pull and the compute."""
    option = chosen_option(decision)
    if option is None:
        return ()
    if decision.action is Action.RECOMPUTE:
        return (
            (decision.source_id, option.compute_s),
            (decision.target_id, option.transfer_s),
        )
    return ((decision.target_id, option.cost_s - option.wait_s),)


class RecoveryPolicy(Protocol):
    """Decides how one request recovers.

    `extra_flows` are transfers planned but not yet running (batch planning);
    `extra_wait_s` is work already assigned to an instance by the same plan.
    """

    name: str

    def decide(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        migration_slot_free: bool = True,
        extra_flows: Mapping[LinkId, int] | None = None,
        extra_wait_s: Mapping[str, float] | None = None,
    ) -> RecoveryDecision: ...


# -- HYBRID split -----------------------------------------------------------------------


def _split(
    profile: ComputeProfile, prompt_tokens: int, bits_per_token: float, bps: float, rtt_s: float
) -> tuple[int, float]:
    """The k in [0, L] minimising max(T_pf(k), T_x(S(L − k))) and that maximum.

    T_pf rises with k and T_x falls, so the optimum sits where they cross. With a
    fitted profile the crossing has a closed form (a quadratic); with a measured table
    it is found by bisection on the integer k.
    """
    if prompt_tokens == 0:
        return 0, 0.0
    # k = 0 is MIGRATE: computed with MIGRATE's arithmetic, so it costs exactly the same.
    best_k, best_s = 0, rtt_s + bits_per_token * prompt_tokens / bps
    if not math.isfinite(best_s):
        # A path too slow to carry even one token's KV in finite time: recompute it all.
        return prompt_tokens, profile.prefill_s(prompt_tokens)
    if profile.table:
        prefill_s = profile.prefill_s
        lo, hi = 0, prompt_tokens  # invariant: T_pf(hi) >= T_x(hi) (T_x(L) = 0)
        while lo < hi:
            mid = (lo + hi) // 2
            if prefill_s(mid) >= rtt_s + bits_per_token * (prompt_tokens - mid) / bps:
                hi = mid
            else:
                lo = mid + 1
        for k in (hi - 1, hi):
            if k > 0:
                # The router pulls at least one token, so even k = L pays a set-up.
                moved_s = rtt_s + bits_per_token * max(1, prompt_tokens - k) / bps
                term = max(prefill_s(k), moved_s)
                if term < best_s:
                    best_k, best_s = k, term
        return best_k, best_s
    # a + b·k + c·k² = rtt + s·(L − k) for k ≥ 1 (T_pf(0) = 0 sits below the curve).
    a, b, c = profile.a_s, profile.b_s_per_token, profile.c_s_per_token2
    seconds_per_token = bits_per_token / bps
    slope = b + seconds_per_token
    constant = a - rtt_s - seconds_per_token * prompt_tokens
    if constant >= 0.0:
        return best_k, best_s
    if c > 0.0:
        root = (math.sqrt(slope * slope - 4.0 * c * constant) - slope) / (2.0 * c)
    else:
        root = -constant / slope
    below = int(root)
    for k in (below, below + 1):
        if 0 < k <= prompt_tokens:
            # The fit exactly as ComputeProfile.prefill_s evaluates it.
            fit_s = a + k * (b + k * c)
            moved_s = rtt_s + bits_per_token * max(1, prompt_tokens - k) / bps
            term = fit_s if fit_s > moved_s else moved_s
            if term < best_s:
                best_k, best_s = k, term
    return best_k, best_s


def hybrid_split(
    cost: CostModel,
    source_id: str,
    target_id: str,
    prompt_tokens: int,
    now_s: float,
    extra_flows: Mapping[LinkId, int] | None = None,
) -> tuple[int, float]:
    """(k, max(T_pf(k), T_x(source, target, S(L − k)))) for the best split of a prompt."""
    if prompt_tokens < 0:
        raise InvalidArgument("prompt_tokens", f"must be >= 0, got {prompt_tokens}")
    bps, rtt_s = cost.network.rate_and_rtt(source_id, target_id, now_s, extra_flows)
    return _split(cost.compute, prompt_tokens, cost.kv_bits_per_token, bps, rtt_s)


# -- evaluation of the options of one request -------------------------------------------


def _columns(view: ClusterView, exclude_ids: Collection[str]) -> tuple[Columns, Columns]:
    """Columns of the view's alive decode and prefill instances minus `exclude_ids`.

    Every request stranded by one failure excludes the same instances, so the pair is
    kept on the view (one lookup per decision instead of two lists and two columns).
    """
    if not isinstance(exclude_ids, frozenset):
        exclude_ids = frozenset(exclude_ids)
    derived = view.derived
    key = (_columns, exclude_ids)
    found = derived.get(key)
    if found is None:
        if len(derived) >= _COLUMNS_CACHE_MAX:
            derived.clear()
        found = derived[key] = (
            Columns.of(view.decode_instances(exclude_ids)),
            Columns.of(view.prefill_instances(exclude_ids)),
        )
    return found


# A raw option: (cost_s, target_id, source_id, wait_s, transfer_s, compute_s, split_tokens,
# target_wait_s)
_Raw = tuple[float, str, str, float, float, float, int, float]


class _Options:
    """The best option per action for one request, evaluated once for every policy.

    Without extra flows, path terms come from per-list caches (one pass over flat
    lists). With the flows of a batch plan, every (prefill, decode) pair is priced at
    once from a `PathMatrix`, shared by the MIGRATE, HYBRID and RECOMPUTE searches.
    """

    __slots__ = (
        "request",
        "view",
        "cost",
        "now_s",
        "extra_flows",
        "extra_wait",
        "decode",
        "prefill",
        "targets",
        "migrate_block",
        "memory_block",
        "ext_s",
        "_priced",
    )

    def __init__(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        slot_free: bool,
        extra_flows: Mapping[LinkId, int] | None,
        extra_wait: Mapping[str, float] | None,
    ) -> None:
        self.request, self.view, self.cost, self.now_s = request, view, cost, now_s
        self.extra_flows = extra_flows or None
        self.extra_wait = extra_wait or None
        self.decode, self.prefill = _columns(view, request.exclude_ids)
        if not self.decode.ids:
            raise FailedPrecondition(
                "no alive decode instance to recover to", field="decode_instances"
            )
        need = request.prompt_tokens + request.generated_tokens
        free = self.decode.free
        self.targets: Sequence[int] = (
            range(len(free))
            if self.decode.min_free >= need
            else [i for i, tokens in enumerate(free) if tokens >= need]
        )
        self.memory_block = (
            "" if self.targets else (f"no decode instance has {need} tokens of free KV memory")
        )
        source = view.get(request.source_prefill_id)
        if not request.source_kv_available or (source is not None and not source.alive):
            self.migrate_block = "source KV lost"
        elif not slot_free:
            self.migrate_block = "no migration slot"
        else:
            self.migrate_block = self.memory_block
        self.ext_s = cost.compute.extend_s(request.prompt_tokens, request.generated_tokens)
        self._priced: tuple[np.ndarray, np.ndarray] | None = None

    def waits(self, columns: Columns) -> list[float]:
        """W(x) of every instance of `columns`, raised by the work a plan assigned."""
        extra = self.extra_wait
        if extra is None:
            return columns.wait
        if isinstance(extra, WaitPlan):
            return extra.waits_for(columns)
        return [w + extra.get(i, 0.0) for w, i in zip(columns.wait, columns.ids, strict=True)]

    def priced(self) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth_bps, rtt_s) of every prefill → decode pair under the extra flows."""
        if self._priced is None:
            matrix = self.decode.matrix(self.cost.network, self.prefill, self.now_s)
            self._priced = (matrix.bandwidth_bps(self.extra_flows), matrix.rtt_s)
        return self._priced

    def rates_from(self, src_id: str) -> tuple[Sequence[float], Sequence[float]]:
        """Exact (bandwidth_bps, rtt_s) from `src_id` to every decode instance."""
        network = self.cost.network
        if self.extra_flows is None:
            fan = self.decode.fan(network, src_id, self.now_s)
            return fan.bps, fan.rtt
        row = self.prefill.index(src_id)
        if row is not None:
            bps, rtt = self.priced()
            return bps[row].tolist(), rtt[row].tolist()
        pairs = [
            network.rate_and_rtt(src_id, dst_id, self.now_s, self.extra_flows)
            for dst_id in self.decode.ids
        ]
        return [bps for bps, _ in pairs], [rtt for _, rtt in pairs]

    def migrate_and_hybrid(
        self, with_hybrid: bool, targets: Sequence[int] | None = None
    ) -> tuple[_Raw | None, _Raw | None]:
        """Cheapest MIGRATE and HYBRID over the targets (None when none is computable).

        W(d) + T_ext bounds both options from below; with a fitted profile, so does the
        crossing of the split's two terms with T_pf linearised (c ≥ 0 dropped), so most
        targets are dismissed before their split is searched. The search keeps the best
        of each action as plain locals (index and cost) and builds the two results once.
        """
        request, cost = self.request, self.cost
        targets = self.targets if targets is None else targets
        if not targets or not request.source_kv_available:
            return None, None
        held = self.held_tokens(targets)
        if held is not None:
            return self._migrate_and_hybrid_held(with_hybrid, targets, held)
        source = request.source_prefill_id
        prompt_tokens = request.prompt_tokens
        bits_per_token = cost.kv_bits_per_token
        prompt_bits = bits_per_token * prompt_tokens
        ext_s = self.ext_s
        waits = self.decode.wait if self.extra_wait is None else self.waits(self.decode)
        bandwidths, rtts = self.rates_from(source)
        compute = cost.compute
        bounded = with_hybrid and not compute.table
        a_s, b_s = compute.a_s, compute.b_s_per_token
        recompute_all_s = a_s + b_s * prompt_tokens
        # Best so far of each action: target index (-1 for none yet) and cost. Without
        # HYBRID, h_s stays -inf, so MIGRATE's cost alone decides whether to skip a target.
        m_i, m_s, m_transfer = -1, _INF, 0.0
        h_i, h_s, h_k = -1, (_INF if with_hybrid else -_INF), 0
        splits: dict[tuple[float, float], tuple[int, float]] = {}
        for i in targets:
            floor = waits[i] + ext_s
            if floor >= m_s and floor >= h_s and m_i >= 0:
                continue
            bps, rtt_s = bandwidths[i], rtts[i]
            transfer = rtt_s + prompt_bits / bps if prompt_tokens else 0.0
            total = floor + transfer
            if total < m_s or m_i < 0:
                m_i, m_s, m_transfer = i, total, transfer
            if not with_hybrid:
                continue
            # k = 0 costs the transfer; k = L at least a + b·L; in between, at least where
            # a + b·k and rtt + s·(L − k) cross. (Rounding is monotone, so testing the sums
            # one by one, the costly crossing last, is testing floor + the least of them.)
            if bounded and h_i >= 0 and total >= h_s and floor + recompute_all_s >= h_s:
                per_token_s = bits_per_token / bps
                crossing = (a_s * per_token_s + b_s * (rtt_s + per_token_s * prompt_tokens)) / (
                    b_s + per_token_s
                )
                if floor + crossing >= h_s:
                    continue
            found = splits.get((bps, rtt_s))
            if found is None:
                found = splits[(bps, rtt_s)] = _split(
                    compute, prompt_tokens, bits_per_token, bps, rtt_s
                )
            k, term = found
            total = floor + term
            if total < h_s or h_i < 0:
                h_i, h_s, h_k = i, total, k
        ids = self.decode.ids
        best_m = (m_s, ids[m_i], source, waits[m_i], m_transfer, ext_s, 0, waits[m_i])
        if h_i < 0:
            return best_m, None
        moved = rtts[h_i] + bits_per_token * max(1, prompt_tokens - h_k) / bandwidths[h_i]
        return best_m, (
            h_s,
            ids[h_i],
            source,
            waits[h_i],
            moved,
            compute.prefill_s(h_k) + ext_s,
            h_k,
            waits[h_i],
        )

    def held_tokens(self, targets: Sequence[int]) -> dict[int, int] | None:
        """Target index -> leading prompt tokens it already holds (whole resident blocks,
        short of the whole prompt: a pull moves at least one token); None when no target
        holds any, so the plain search runs."""
        hashes = self.request.prefix_hashes
        if not hashes or not self.decode.has_resident:
            return None
        block = self.cost.model.block_tokens
        prompt_tokens = self.request.prompt_tokens
        cap = (prompt_tokens - 1) // block * block if prompt_tokens else 0
        held = {}
        for i in targets:
            resident = self.decode.states[i].resident_blocks
            if resident:
                tokens = min(cap, prefix_hit_tokens(hashes, resident, block, prompt_tokens))
                if tokens > 0:
                    held[i] = tokens
        return held or None

    def _migrate_and_hybrid_held(
        self, with_hybrid: bool, targets: Sequence[int], held: Mapping[int, int]
    ) -> tuple[_Raw | None, _Raw | None]:
        """`migrate_and_hybrid` where some targets hold leading blocks of the prompt: each
        target is sent only what it lacks, L − h, and HYBRID splits that rest (recomputing
        [h, h + k), streaming [h + k, L)); every target is priced, none is pruned."""
        request, cost = self.request, self.cost
        source = request.source_prefill_id
        bits_per_token = cost.kv_bits_per_token
        waits = self.decode.wait if self.extra_wait is None else self.waits(self.decode)
        bandwidths, rtts = self.rates_from(source)
        ids = self.decode.ids
        best_m: _Raw | None = None
        best_h: _Raw | None = None
        for i in targets:
            have = held.get(i, 0)
            rest = request.prompt_tokens - have
            bps, rtt_s = bandwidths[i], rtts[i]
            floor = waits[i] + self.ext_s
            transfer = rtt_s + bits_per_token * rest / bps if rest else 0.0
            if best_m is None or floor + transfer < best_m[0]:
                best_m = (
                    floor + transfer,
                    ids[i],
                    source,
                    waits[i],
                    transfer,
                    self.ext_s,
                    have,
                    waits[i],
                )
            if not with_hybrid:
                continue
            k, term = _split(cost.compute, rest, bits_per_token, bps, rtt_s)
            if best_h is None or floor + term < best_h[0]:
                moved = rtt_s + bits_per_token * max(1, rest - k) / bps
                compute_s = cost.compute.prefill_s(k) + self.ext_s
                best_h = (
                    floor + term,
                    ids[i],
                    source,
                    waits[i],
                    moved,
                    compute_s,
                    have + k,
                    waits[i],
                )
        return best_m, best_h

    def recompute(
        self, targets: Sequence[int] | None = None, only_prefill: int | None = None
    ) -> _Raw | None:
        """Cheapest RECOMPUTE over (prefill, target) pairs; None without either."""
        request, cost = self.request, self.cost
        targets = self.targets if targets is None else targets
        columns = self.prefill
        if not targets or not columns.ids:
            return None
        waits = columns.wait if self.extra_wait is None else self.waits(columns)
        target_waits = self.decode.wait if self.extra_wait is None else self.waits(self.decode)
        tokens = request.prompt_tokens + request.generated_tokens
        prefill_s = cost.compute.prefill_s(tokens)
        bits = cost.kv_bits_per_token * tokens
        if self.extra_flows is not None and tokens:
            return self._recompute_priced(
                targets, only_prefill, waits, target_waits, prefill_s, bits
            )
        least_target_wait = min(target_waits[i] for i in targets)
        order = columns.by_wait() if only_prefill is None else (only_prefill,)
        decode, network, now_s, reported = self.decode, cost.network, self.now_s, columns.wait
        # Best so far as plain locals: prefill index (-1 for none yet), target, cost, transfer.
        best_p, best_i, best_s, best_transfer = -1, -1, _INF, 0.0
        for p in order:
            # Prefill instances come in order of reported wait (a plan only adds to it):
            # once W(p') + T_pf alone loses, no later one can win.
            if reported[p] + prefill_s + least_target_wait >= best_s and best_p >= 0:
                break
            base = waits[p] + prefill_s
            fan = decode.fan(network, columns.ids[p], now_s)
            floor = base + least_target_wait
            if floor + fan.min_rtt + bits * fan.min_inv_bps >= best_s and best_p >= 0:
                continue
            if not tokens:
                # Nothing to move: the least-waiting target is the best.
                i = min(targets, key=target_waits.__getitem__)
                if floor < best_s or best_p < 0:
                    best_p, best_i, best_s, best_transfer = p, i, floor, 0.0
                continue
            rtt, bps = fan.rtt, fan.bps
            for i in targets:
                transfer = rtt[i] + bits / bps[i]
                total = base + transfer + target_waits[i]
                if total < best_s or best_p < 0:
                    best_p, best_i, best_s, best_transfer = p, i, total, transfer
        return (
            best_s,
            decode.ids[best_i],
            columns.ids[best_p],
            waits[best_p],
            best_transfer,
            prefill_s,
            0,
            target_waits[best_i],
        )

    def _recompute_priced(
        self,
        targets: Sequence[int],
        only_prefill: int | None,
        waits: list[float],
        target_waits: list[float],
        prefill_s: float,
        bits: float,
    ) -> _Raw:
        import numpy as np

        bps, rtt = self.priced()
        # (rtt + bits / bps) + (W(p') + T_pf) + W(d) built in one buffer; the winner's
        # transfer is then recomputed from its two scalars, which gives the bits numpy
        # computed.
        total = bits / bps
        total += rtt
        total += np.add(waits, prefill_s)[:, None]
        total += np.asarray(target_waits)[None, :]
        if not isinstance(targets, range):
            excluded = np.ones(total.shape[1], dtype=bool)
            excluded[list(targets)] = False
            total[:, excluded] = _INF
        if only_prefill is not None:
            p = only_prefill
            i = int(total[p].argmin())
        else:
            p, i = divmod(int(total.argmin()), total.shape[1])
        transfer = float(rtt[p, i]) + bits / float(bps[p, i])
        return (
            float(total[p, i]),
            self.decode.ids[i],
            self.prefill.ids[p],
            waits[p],
            transfer,
            prefill_s,
            0,
            target_waits[i],
        )

    def option(self, action: Action, raw: _Raw | None, block: str) -> OptionCost:
        """The OptionCost of a raw option; infeasible with `block` as reason when set.

        Filled in place like `kvrs._frozen.build`, without its call and keyword packing:
        a decision makes up to three of these.
        """
        option = _new(OptionCost)
        if raw is None:
            reason = block or self.memory_block or "no alive prefill instance"
            option.__dict__.update(
                action=action,
                target_id="",
                source_id="",
                cost_s=_INF,
                wait_s=_INF,
                transfer_s=_INF,
                compute_s=_INF,
                split_tokens=0,
                feasible=False,
                infeasible_reason=reason,
                target_wait_s=_INF,
            )
            return option
        total, target, source, wait, transfer, compute, split, target_wait = raw
        option.__dict__.update(
            action=action,
            target_id=target,
            source_id=source,
            cost_s=total,
            wait_s=wait,
            transfer_s=transfer,
            compute_s=compute,
            split_tokens=split,
            feasible=not block,
            infeasible_reason=block,
            target_wait_s=target_wait,
        )
        return option

    def decision(
        self,
        policy: str,
        chosen: OptionCost | None,
        options: tuple[OptionCost, ...],
        reason: str,
        check_deadline: bool,
        margin: float = 0.0,
    ) -> RecoveryDecision:
        """The decision for `chosen` (None: nothing feasible), ABORTing on a missed deadline.

        The deadline is checked against the upper end of the prediction, cost · (1 +
        margin): a request whose recovery will likely be late fails fast instead."""
        request = self.request
        if chosen is None:
            return RecoveryDecision(
                request.request_id,
                Action.ABORT,
                "",
                "",
                _INF,
                0,
                options,
                "no feasible option: " + "; ".join(o.infeasible_reason for o in options),
                -_INF,
                None,
                policy,
            )
        deadline = request.deadline_s
        slack = _INF if deadline is None else deadline - self.now_s - chosen.cost_s
        late = slack < 0.0 if not margin else slack - margin * chosen.cost_s < 0.0
        if check_deadline and late:
            return RecoveryDecision(
                request.request_id,
                Action.ABORT,
                "",
                "",
                chosen.cost_s,
                0,
                options,
                "no option meets the deadline"
                + (f" (with its measured error, {100 * margin:.0f} %)" if margin else ""),
                slack,
                chosen,
                policy,
            )
        runner_up = None
        for option in options:
            if (
                option is not chosen
                and option.feasible
                and (runner_up is None or option.cost_s < runner_up.cost_s)
            ):
                runner_up = option
        decision = _new(RecoveryDecision)  # as in `option`
        decision.__dict__.update(
            request_id=request.request_id,
            action=chosen.action,
            target_id=chosen.target_id,
            source_id=chosen.source_id,
            cost_s=chosen.cost_s,
            split_tokens=chosen.split_tokens,
            options=options,
            reason=reason,
            slack_s=slack,
            runner_up=runner_up,
            policy=policy,
            planned_jobs=1,
        )
        return decision


def _within_error(
    options: tuple[OptionCost, ...],
    chosen: OptionCost,
    reason: str,
    margins: Mapping[str, float],
) -> tuple[OptionCost, str]:
    """MIGRATE unless the cheaper option still wins with both predictions at the upper end
    of their measured errors.

    MIGRATE moves no compute; RECOMPUTE and HYBRID add work whose predictions have their
    own error, so a point estimate a hair below MIGRATE's is no reason to take them, when
    MIGRATE's predictions have proved closer. An action with no outcomes yet has no record
    to trust: it counts as uncertain as the least certain one measured, so learning the
    error of one option alone never tilts a decision towards another nobody has measured.
    """
    migrate = options[0]
    if chosen is migrate or not migrate.feasible or migrate.action is not Action.MIGRATE:
        return chosen, reason
    unmeasured = max(margins.values(), default=0.0)
    error = margins.get(chosen.action.value, unmeasured)
    migrate_error = margins.get(Action.MIGRATE.value, unmeasured)
    if chosen.cost_s * (1.0 + error) < migrate.cost_s * (1.0 + migrate_error):
        return chosen, (
            f"{reason}; wins by more than the measured errors ({100 * error:.0f} % against "
            f"MIGRATE's {100 * migrate_error:.0f} %)"
        )
    return migrate, (
        f"MIGRATE: {chosen.action.name} is cheaper by less than the measured errors "
        f"({chosen.cost_s:.4f} s · (1 + {error:.2f}) >= {migrate.cost_s:.4f} s · "
        f"(1 + {migrate_error:.2f}))"
    )


def _cheapest(options: tuple[OptionCost, ...]) -> OptionCost | None:
    """The cheapest feasible option; on a tie the earlier one (callers list MIGRATE first)."""
    best = None
    for option in options:
        if option.feasible and (best is None or option.cost_s < best.cost_s - TIE_TOLERANCE_S):
            best = option
    return best


# -- policies ---------------------------------------------------------------------------


class Kvrs:
    """Cheapest of MIGRATE, RECOMPUTE and HYBRID over every target; ABORT if all are late."""

    name = "kvrs"

    def decide(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        migration_slot_free: bool = True,
        extra_flows: Mapping[LinkId, int] | None = None,
        extra_wait_s: Mapping[str, float] | None = None,
    ) -> RecoveryDecision:
        ctx = _Options(request, view, cost, now_s, migration_slot_free, extra_flows, extra_wait_s)
        block = ctx.migrate_block
        # A blocked MIGRATE is still priced (a trace should show what the missing slot or
        # the lost KV cost); a blocked HYBRID would only repeat that, so it is not searched.
        migrate, hybrid = ctx.migrate_and_hybrid(with_hybrid=not block)
        options = (
            ctx.option(Action.MIGRATE, migrate, block),
            ctx.option(Action.RECOMPUTE, ctx.recompute(), ""),
            ctx.option(Action.HYBRID, hybrid, block),
        )
        chosen = _cheapest(options)
        if chosen is options[0] and options[0].cost_s >= options[2].cost_s - TIE_TOLERANCE_S:
            reason = "cheapest option (MIGRATE on a tie with the best split)"
        elif block and chosen is not None:
            reason = f"cheapest feasible option ({block})"
        else:
            reason = "cheapest option"
        margins = cost.margins
        if margins and chosen is not None:
            chosen, reason = _within_error(options, chosen, reason, margins)
        margin = margins.get(chosen.action.value, 0.0) if chosen is not None else 0.0
        return ctx.decision(self.name, chosen, options, reason, check_deadline=True, margin=margin)


class Rom:
    """The RecomputeOrMigrate rule: per request, to the least-waiting decode instance,
    MIGRATE if 8·S(L) / B_est(p, d) < T_pf(L), else RECOMPUTE; no HYBRID, no ABORT, and
    blind to the other requests of a batch when it chooses.
    """

    name = "rom"

    def decide(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        migration_slot_free: bool = True,
        extra_flows: Mapping[LinkId, int] | None = None,
        extra_wait_s: Mapping[str, float] | None = None,
    ) -> RecoveryDecision:
        ctx = _Options(request, view, cost, now_s, migration_slot_free, extra_flows, extra_wait_s)
        if not ctx.targets:
            options = (
                ctx.option(Action.MIGRATE, None, ctx.migrate_block),
                ctx.option(Action.RECOMPUTE, None, ctx.memory_block),
            )
            return ctx.decision(self.name, None, options, "", check_deadline=False)
        fits = set(ctx.targets)
        target = next(i for i in ctx.decode.by_wait() if i in fits)
        migrate, _ = ctx.migrate_and_hybrid(with_hybrid=False, targets=(target,))
        recompute = None
        if ctx.prefill.ids:
            recompute = ctx.recompute(targets=(target,), only_prefill=ctx.prefill.by_wait()[0])
        block = ctx.migrate_block
        options = (
            ctx.option(Action.MIGRATE, migrate, block),
            ctx.option(Action.RECOMPUTE, recompute, ""),
        )
        if block:
            chosen, reason = options[1], f"RECOMPUTE ({block})"
        else:
            bps, _ = cost.network.rate_and_rtt(
                request.source_prefill_id, ctx.decode.ids[target], now_s
            )
            migrate_s = cost.kv_bits_per_token * request.prompt_tokens / bps
            if migrate_s < cost.prefill_s(request.prompt_tokens):
                chosen, reason = options[0], "8·S(L)/B < T_pf(L)"
            else:
                chosen, reason = options[1], "8·S(L)/B >= T_pf(L)"
        return ctx.decision(
            self.name, chosen if chosen.feasible else None, options, reason, check_deadline=False
        )


class AlwaysMigrate:
    """MIGRATE to the cheapest target; RECOMPUTE only when migration is impossible."""

    name = "always_migrate"

    def decide(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        migration_slot_free: bool = True,
        extra_flows: Mapping[LinkId, int] | None = None,
        extra_wait_s: Mapping[str, float] | None = None,
    ) -> RecoveryDecision:
        ctx = _Options(request, view, cost, now_s, migration_slot_free, extra_flows, extra_wait_s)
        migrate, _ = ctx.migrate_and_hybrid(with_hybrid=False)
        block = ctx.migrate_block
        migrate_option = ctx.option(Action.MIGRATE, migrate, block)
        if migrate_option.feasible:
            return ctx.decision(
                self.name, migrate_option, (migrate_option,), "always MIGRATE", check_deadline=False
            )
        recompute = ctx.option(Action.RECOMPUTE, ctx.recompute(), "")
        return ctx.decision(
            self.name,
            recompute if recompute.feasible else None,
            (migrate_option, recompute),
            f"RECOMPUTE ({block})",
            check_deadline=False,
        )


class AlwaysRecompute:
    """RECOMPUTE via the cheapest (prefill, target) pair; MIGRATE only when there is no
    prefill instance left to recompute on.
    """

    name = "always_recompute"

    def decide(
        self,
        request: RecoveryRequest,
        view: ClusterView,
        cost: CostModel,
        now_s: float,
        migration_slot_free: bool = True,
        extra_flows: Mapping[LinkId, int] | None = None,
        extra_wait_s: Mapping[str, float] | None = None,
    ) -> RecoveryDecision:
        ctx = _Options(request, view, cost, now_s, migration_slot_free, extra_flows, extra_wait_s)
        recompute = ctx.option(Action.RECOMPUTE, ctx.recompute(), "")
        if recompute.feasible:
            return ctx.decision(
                self.name, recompute, (recompute,), "always RECOMPUTE", check_deadline=False
            )
        migrate, _ = ctx.migrate_and_hybrid(with_hybrid=False)
        migrate_option = ctx.option(Action.MIGRATE, migrate, ctx.migrate_block)
        return ctx.decision(
            self.name,
            migrate_option if migrate_option.feasible else None,
            (recompute, migrate_option),
            f"MIGRATE ({recompute.infeasible_reason})",
            check_deadline=False,
        )


def kv_tokens_moved(
    action: Action, prompt_tokens: int, generated_tokens: int, split_tokens: int = 0
) -> int:
    """Tokens of KV the decision streams to its target.

    MIGRATE moves the prompt's KV the target does not already hold, S(L − h) with h the
    decision's split_tokens (0 unless the target holds leading blocks); HYBRID the part it
    neither recomputes nor holds, S(L − k) with k clamped to [0, L]; RECOMPUTE the KV its
    prefill instance rebuilt, of the prompt and every generated token, S(L + g); ABORT
    nothing. The scheduler prices this, the
    batch planner re-prices it, and the router and the simulator move it.
    """
    if action is Action.MIGRATE or action is Action.HYBRID:
        return prompt_tokens - max(0, min(split_tokens, prompt_tokens))
    if action is Action.RECOMPUTE:
        return prompt_tokens + generated_tokens
    return 0


def decide_without_slot(
    policy: RecoveryPolicy,
    request: RecoveryRequest,
    view: ClusterView,
    cost: CostModel,
    now_s: float,
    why: str,
) -> RecoveryDecision:
    """The decision when the migration slot a MIGRATE or HYBRID needs was not granted.

    A decision is made on a view, and its slot is reserved afterwards; meanwhile other
    decisions may have taken the last slots (or the broker may not answer). The policy
    then decides again with no slot free, on the caller's view of now, and the reason
    says first why the slot was missing (`why`).
    """
    fallback = policy.decide(request, view, cost, now_s, migration_slot_free=False)
    return dataclasses.replace(fallback, reason=f"{why}; {fallback.reason}")


RECOVERY_POLICY_NAMES = ("always_migrate", "always_recompute", "rom", "kvrs")

_POLICIES: dict[str, Callable[[], RecoveryPolicy]] = {
    "always_migrate": AlwaysMigrate,
    "always_recompute": AlwaysRecompute,
    "rom": Rom,
    "kvrs": Kvrs,
}


def make_recovery_policy(name: str) -> RecoveryPolicy:
    """The recovery policy called `name` (see RECOVERY_POLICY_NAMES)."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise InvalidArgument(
            "policy",
            f"unknown recovery policy {name!r} (known: {', '.join(RECOVERY_POLICY_NAMES)})",
        ) from None
