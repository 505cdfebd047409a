"""Choosing a token from logits: greedy, temperature, top-k and top-p as OpenAI means them,
each draw fixed by (seed, position)."""

from __future__ import annotations

import collections

import torch

from kvrs.sampling import Sampling
from services.worker.sampling import choose

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float32)


def frequencies(sampling: Sampling, draws: int = 4000) -> dict[int, float]:
    counts = collections.Counter(choose(LOGITS, sampling, i) for i in range(draws))
    return {token: count / draws for token, count in counts.items()}


def test_greedy_takes_the_argmax():
    assert {choose(LOGITS, Sampling(), i) for i in range(20)} == {0}


def test_temperature_draws_follow_the_softmax():
    expected = torch.softmax(LOGITS.double() / 0.8, dim=0)
    seen = frequencies(Sampling(temperature=0.8, seed=11))
    for token, p in enumerate(expected.tolist()):
        assert abs(seen.get(token, 0.0) - p) < 0.03, (token, seen, p)


def test_top_k_and_top_p_cut_the_tail():
    assert set(frequencies(Sampling(temperature=1.0, top_k=2, seed=5))) == {0, 1}
    # p = [0.53, 0.20, 0.12, 0.07, 0.03]: 0.6 needs the two most likely tokens.
    assert set(frequencies(Sampling(temperature=1.0, top_p=0.6, seed=5))) == {0, 1}
    assert set(frequencies(Sampling(temperature=1.0, top_p=0.5, seed=5))) == {0}


def test_the_same_seed_and_position_choose_the_same_token_from_bf16_logits_too():
    sampling = Sampling(temperature=0.8, seed=42)
    tokens = [choose(LOGITS, sampling, i) for i in range(200)]
    assert tokens == [choose(LOGITS.to(torch.bfloat16), sampling, i) for i in range(200)]
    assert tokens != [choose(LOGITS, Sampling(temperature=0.8, seed=43), i) for i in range(200)]
