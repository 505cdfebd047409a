"""The embedded default checkpoint run by `transformers` in the test process: what a
cluster streams must equal `reference` token for token, whatever failed in between."""

from __future__ import annotations

import functools

import torch

from tests.hf_reference import greedy


@functools.cache
def reference(prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """The undisturbed greedy continuation of `prompt` (one `generate`, no stop token)."""
    from services.worker.checkpoint import resolve_checkpoint

    return greedy(str(resolve_checkpoint("tiny")), prompt, max_new_tokens, torch.float64)
