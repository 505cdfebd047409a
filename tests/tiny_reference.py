"""The tiny float64 model run in the test process: greedy decoding is bit-exact, so what a
cluster streams must equal `reference` token for token, whatever failed in between."""

from __future__ import annotations

import functools

import torch

from services.worker.model import Transformer


@functools.cache
def model() -> Transformer:
    # One thread: the cluster's processes share the same two cores.
    torch.set_num_threads(1)
    return Transformer.from_preset("tiny", dtype=torch.float64)


@functools.cache
def reference(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """The undisturbed greedy continuation of `prompt`."""
    return model().complete(prompt, max_new_tokens)
