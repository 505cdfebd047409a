"""Generated workloads the simulator tests share."""

from __future__ import annotations

from kvrs.sim.trace import SyntheticWorkload, TraceRequest


def busy_chat(
    requests: int = 300, rate: float = 30.0, input_tokens: float = 2000.0, seed: int = 1
) -> list[TraceRequest]:
    """Independent chat requests (no shared prefixes), log-normal around the medians."""
    return SyntheticWorkload(
        requests=requests,
        rate_per_s=rate,
        input_median_tokens=input_tokens,
        input_sigma=0.5,
        output_median_tokens=300.0,
        output_sigma=0.3,
        continue_prob=0.0,
        system_prompt_prob=0.0,
        seed=seed,
    ).generate()
