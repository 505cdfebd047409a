"""One batched forward pass over several sequences equals each sequence run alone, and
`transformers` on the same checkpoint: prefills, extends and decode steps mixed in one
batch, logits tight and greedy tokens exact."""

from __future__ import annotations

import pytest
import torch

from kvrs.errors import InvalidArgument
from kvrs.tokenizer import encode
from services.common.tokenizer import load_codec
from services.worker.model import Transformer
from tests.checkpoints import CORPUS, save_checkpoint
from tests.hf_reference import greedy, logits

TIGHT = {"rtol": 1e-12, "atol": 1e-12}
PROMPTS = [encode(text) for text in CORPUS[:4]]


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.load("tiny")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("batched")
    variants = {
        "llama-gqa": ("LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 2}),
        "mistral-window": ("MistralForCausalLM", {"sliding_window": 24}),
        "opt": ("OPTForCausalLM", {}),
    }
    return {
        name: str(save_checkpoint(root / name, architecture, **config))
        for name, (architecture, config) in variants.items()
    }


def test_a_batch_of_prefills_equals_each_prefill_alone(tiny):
    alone = [tiny.prefill(prompt) for prompt in PROMPTS]
    caches = [tiny.new_cache() for _ in PROMPTS]
    batched = tiny.forward_batch(list(zip(caches, PROMPTS, strict=True)))
    assert len(batched) == len(PROMPTS)
    for (cache, expected), got, batched_cache in zip(alone, batched, caches, strict=True):
        torch.testing.assert_close(got, expected, **TIGHT)
        for (ka, va), (kb, vb) in zip(cache.layers_kv(), batched_cache.layers_kv(), strict=True):
            torch.testing.assert_close(ka, kb, **TIGHT)
            torch.testing.assert_close(va, vb, **TIGHT)


def test_prefill_extend_and_decode_steps_mix_in_one_batch(tiny):
    """A fresh prefill, an extend on a cached prefix and two decode steps, one pass."""
    fresh = tiny.new_cache()
    extended, _ = tiny.prefill(PROMPTS[1][:9])
    decoding = [tiny.prefill(prompt)[0] for prompt in PROMPTS[2:]]
    work = [
        (fresh, PROMPTS[0]),
        (extended, PROMPTS[1][9:]),
        *((cache, [7]) for cache in decoding),
    ]
    got = tiny.forward_batch(work)
    expected = [
        tiny.prefill(PROMPTS[0])[1],
        tiny.prefill(PROMPTS[1])[1],
        *(tiny.prefill([*prompt, 7])[1] for prompt in PROMPTS[2:]),
    ]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **TIGHT)
    assert [cache.length for cache, _ in work] == [
        len(PROMPTS[0]),
        len(PROMPTS[1]),
        *(len(prompt) + 1 for prompt in PROMPTS[2:]),
    ]


def test_a_bad_sequence_is_refused_before_any_cache_changes(tiny):
    good = tiny.new_cache()
    with pytest.raises(InvalidArgument, match="token_ids"):
        tiny.forward_batch([(good, [1, 2, 3]), (tiny.new_cache(), [])])
    assert good.length == 0
    with pytest.raises(InvalidArgument, match="twice"):
        tiny.forward_batch([(good, [1]), (good, [2])])


def _batched_greedy(model: Transformer, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuation of every prompt, all of them in one forward pass per step."""
    caches = [model.new_cache() for _ in prompts]
    firsts = model.forward_batch(list(zip(caches, prompts, strict=True)))
    tokens = [[int(torch.argmax(row))] for row in firsts]
    for _ in range(steps - 1):
        rows = model.forward_batch(
            [(cache, [out[-1]]) for cache, out in zip(caches, tokens, strict=True)]
        )
        for out, row in zip(tokens, rows, strict=True):
            out.append(int(torch.argmax(row)))
    return tokens


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window", "opt"])
def test_batched_decoding_equals_transformers_token_for_token(checkpoints, name):
    path = checkpoints[name]
    codec = load_codec(path)
    prompts = [codec.encode(text) for text in CORPUS[:4]]
    model = Transformer.load(path, torch.float32)
    got = _batched_greedy(model, prompts, 64)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == greedy(path, prompt, 64)


@pytest.mark.parametrize("name", ["llama-gqa", "opt"])
def test_batched_logits_equal_transformers_to_float32_rounding(checkpoints, name):
    path = checkpoints[name]
    codec = load_codec(path)
    prompts = [codec.encode(text) for text in CORPUS[:3]]
    model = Transformer.load(path, torch.float32)
    rows = model.forward_batch([(model.new_cache(), prompt) for prompt in prompts])
    for prompt, row in zip(prompts, rows, strict=True):
        diff = float((row - logits(path, prompt)[-1]).abs().max())
        assert diff < 2e-5, f"{name}: logits differ by {diff}"
