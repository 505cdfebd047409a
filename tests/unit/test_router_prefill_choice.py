"""The router's prefill choice: which instance, and what it adds to its in-flight work."""

from __future__ import annotations

import pytest

from kvrs.profile import compute_profile
from kvrs.tokenizer import prefix_block_hashes
from services.common.membership import Instance
from services.router.prefill_choice import choose_prefill

PROFILE = compute_profile("opt-125m")
BLOCK = 16
PROMPT = list(range(2048))


def prefill(instance_id: str, queued_work_s: float = 0.0, held: int = 0) -> Instance:
    hashes = prefix_block_hashes(PROMPT[:held], BLOCK)
    return Instance(
        instance_id,
        "prefill",
        f"{instance_id}:1",
        queued_work_s=queued_work_s,
        resident_prefix_hashes=frozenset(hashes),
    )


def choose(candidates, inflight, options=False):
    hashes = prefix_block_hashes(PROMPT, BLOCK)
    return choose_prefill(candidates, len(PROMPT), hashes, BLOCK, PROFILE, inflight, options)


def test_the_work_a_choice_adds_is_the_prompts_compute_not_its_finish():
    choice = choose([prefill("p0", queued_work_s=0.5)], {"p0": 0.2})
    assert choice.work_s == pytest.approx(PROFILE.prefill_s(len(PROMPT)))
    held = choose([prefill("p0", queued_work_s=0.5, held=1024)], {})
    assert held.work_s == pytest.approx(PROFILE.extend_s(1024, len(PROMPT) - 1024))


def test_a_burst_to_one_instance_counts_each_prompt_once():
    """The router adds each choice's work to its in-flight map until the prefill ends: a
    burst of k prompts to one instance is k prompts of work, not a sum of finishes that
    each count the ones before again."""
    inflight: dict[str, float] = {}
    for _ in range(5):
        choice = choose([prefill("p0")], inflight)
        inflight["p0"] = inflight.get("p0", 0.0) + choice.work_s
    assert inflight["p0"] == pytest.approx(5 * PROFILE.prefill_s(len(PROMPT)))


def test_a_burst_spreads_over_two_idle_instances_and_a_held_prefix_pulls_its_prompt():
    inflight: dict[str, float] = {}
    picked = []
    for _ in range(4):
        choice = choose([prefill("p0"), prefill("p1")], inflight)
        picked.append(choice.instance.instance_id)
        inflight[picked[-1]] = inflight.get(picked[-1], 0.0) + choice.work_s
    assert picked == ["p0", "p1", "p0", "p1"]
    choice = choose([prefill("p0"), prefill("p1", held=1536)], {"p1": 0.01})
    assert choice.instance.instance_id == "p1"


def test_options_list_every_candidate_with_its_finish_and_hit():
    choice = choose([prefill("p1", held=1024), prefill("p0", queued_work_s=0.3)], {}, True)
    (p0, p1) = choice.options
    assert (p0.instance_id, p1.instance_id) == ("p0", "p1")
    assert p0.finish_s == pytest.approx(0.3 + PROFILE.prefill_s(len(PROMPT)))
    assert (p0.prefix_hit_tokens, p1.prefix_hit_tokens) == (0, 1024)
    assert choose([prefill("p0"), prefill("p1")], {}).options == ()
