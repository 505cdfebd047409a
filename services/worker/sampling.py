"""Picking the next token from a model's logits, greedy or sampled (kvrs.sampling).

The choice is a function of the logits, the sampling parameters and the token's
position only (`kvrs.sampling.uniform`): the same request draws the same tokens on
whichever worker computes them. Probabilities are formed in float64 and ties are
ordered by token id, so rounding in a model's lower-precision logits moves a draw
only when it lands on a boundary between two tokens.
"""

from __future__ import annotations

import torch

from kvrs.sampling import Sampling, uniform

__all__ = ["choose"]


def choose(logits: torch.Tensor, sampling: Sampling, index: int) -> int:
    """The token for generated position `index` given the `logits` that predict it."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.to(torch.float64) / sampling.temperature, dim=-1)
    ordered, order = torch.sort(probs, descending=True, stable=True)
    if sampling.top_k:
        ordered = ordered[: sampling.top_k]
    if sampling.top_p < 1.0:
        # The smallest head whose mass reaches top_p: a token is kept while the mass
        # before it is still short of top_p (the most likely one always is).
        before = torch.cumsum(ordered, dim=0) - ordered
        ordered = ordered[: max(1, int((before < sampling.top_p).sum()))]
    cdf = torch.cumsum(ordered, dim=0)
    target = uniform(sampling.seed, index) * float(cdf[-1])
    pick = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    return int(order[min(pick, len(ordered) - 1)])
