"""`transformers` as the reference: what the workers must compute, token for token.

Only tests import this module (transformers is a development dependency); the workers
run their own model code.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch


@functools.cache
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    """The checkpoint at `path` loaded by transformers, in eval mode."""
    from transformers import AutoModelForCausalLM

    # One thread: the cluster's processes share the same cores.
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def greedy(
    path: str,
    prompt: Sequence[int],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    stop_at_eos: bool = False,
) -> list[int]:
    """One uninterrupted greedy `generate` of `max_new_tokens` after `prompt` (stopping
    early at the checkpoint's EOS only when `stop_at_eos`)."""
    model = hf_model(path, dtype)
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
        )
    return out[0, len(prompt) :].tolist()


def logits(path: str, token_ids: Sequence[int], dtype: torch.dtype = torch.float32):
    """Logits of every position of `token_ids`, shape [len, vocab]."""
    with torch.inference_mode():
        return hf_model(path, dtype)(torch.tensor([list(token_ids)])).logits[0]


def chat_ids(path: str, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The prompt ids `transformers` renders for `messages` (role and text content each)
    with the checkpoint's chat template, the reply opened."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(path).apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if isinstance(out, Mapping) else out)
