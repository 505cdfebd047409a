"""The worker's transformer: extend equals prefill, split KV joins exactly, greedy is stable."""

from __future__ import annotations

import pytest
import torch

from kvrs.errors import InvalidArgument
from kvrs.model import model_spec
from kvrs.tokenizer import encode
from services.worker.model import MODEL_CONFIGS, KvCache, Transformer

PROMPT = encode("Disaggregated inference moves KV caches across the network.")


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.from_preset("tiny", torch.float64, seed=0)


def assert_same_kv(a: KvCache, b: KvCache) -> None:
    assert a.length == b.length
    for (ka, va), (kb, vb) in zip(a.layers_kv(), b.layers_kv(), strict=True):
        assert torch.equal(ka, kb)
        assert torch.equal(va, vb)


@pytest.mark.parametrize("split", [1, 7, 30, len(PROMPT) - 1])
def test_extend_equals_full_prefill_exactly(tiny, split):
    full, full_logits = tiny.prefill(PROMPT)
    cache, _ = tiny.prefill(PROMPT[:split])
    _, logits = tiny.extend(cache, PROMPT[split:])
    assert_same_kv(full, cache)
    assert torch.equal(full_logits, logits)


def test_decode_steps_equal_prefill_of_the_longer_sequence(tiny):
    cache, logits = tiny.prefill(PROMPT)
    generated = tiny.greedy(cache, int(torch.argmax(logits)), 12)
    sequence = PROMPT + [int(torch.argmax(logits))] + generated[:-1]
    reference, _ = tiny.prefill(sequence)
    assert_same_kv(reference, cache)


def test_kv_split_from_two_computations_joins_exactly(tiny):
    """KV [0, k) from a recompute of the prefix + KV [k, L) from the full prefill == full."""
    full, full_logits = tiny.prefill(PROMPT)
    k = 23
    prefix, _ = tiny.prefill(PROMPT[:k])
    joined = tiny.new_cache(len(PROMPT))
    for (dk, dv), (pk, pv), (fk, fv) in zip(
        joined.views(0, len(PROMPT)), prefix.layers_kv(), full.layers_kv(), strict=True
    ):
        dk[:k], dv[:k] = pk, pv
        dk[k:], dv[k:] = fk[k:], fv[k:]
    joined.commit(len(PROMPT))
    assert_same_kv(full, joined)
    first = int(torch.argmax(full_logits))
    assert tiny.greedy(joined, first, 16) == tiny.greedy(full, first, 16)


def test_greedy_is_deterministic_across_model_instances():
    a = Transformer.from_preset("tiny", torch.float64, seed=3)
    b = Transformer.from_preset("tiny", torch.float64, seed=3)
    other = Transformer.from_preset("tiny", torch.float64, seed=4)
    outputs = []
    for model in (a, b, other):
        cache, logits = model.prefill(PROMPT)
        outputs.append(model.greedy(cache, int(torch.argmax(logits)), 20))
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert len(set(outputs[0])) > 3, "a degenerate model would repeat one token"


def test_batched_fast_path_agrees_with_exact_path_to_rounding(tiny):
    fast = Transformer.from_preset("tiny", torch.float64, seed=0, exact=False)
    exact_cache, exact_logits = tiny.prefill(PROMPT)
    fast_cache, fast_logits = fast.prefill(PROMPT)
    torch.testing.assert_close(fast_logits, exact_logits, rtol=1e-10, atol=1e-10)
    for (ek, ev), (fk, fv) in zip(exact_cache.layers_kv(), fast_cache.layers_kv(), strict=True):
        torch.testing.assert_close(fk, ek, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(fv, ev, rtol=1e-10, atol=1e-10)


def test_bf16_extend_matches_prefill_to_rounding():
    model = Transformer.from_preset("tiny", torch.bfloat16, seed=0)
    full, _ = model.prefill(PROMPT)
    cache, _ = model.prefill(PROMPT[:20])
    model.extend(cache, PROMPT[20:])
    assert cache.keys[0].dtype == torch.bfloat16
    for (fk, _), (ck, _) in zip(full.layers_kv(), cache.layers_kv(), strict=True):
        torch.testing.assert_close(ck, fk, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_presets_have_the_cost_models_kv_shape(name):
    config = MODEL_CONFIGS[name]
    spec = model_spec(name)
    assert (config.layers, config.kv_heads, config.head_dim) == (
        spec.layers,
        spec.kv_heads,
        spec.head_dim,
    )


def test_kv_layout_and_bytes_per_token(tiny):
    cache, _ = tiny.prefill(PROMPT)
    key, value = cache.layer(1)
    assert key.shape == value.shape == (len(PROMPT), 2, 16)
    assert cache.bytes_per_token == model_spec("tiny").kv_bytes_per_token
    assert cache.resident_bytes() == model_spec("tiny").kv_bytes(len(PROMPT))


def test_bad_tokens_name_the_field(tiny):
    with pytest.raises(InvalidArgument) as info:
        tiny.prefill([1, 2, 9999])
    assert info.value.field == "token_ids[2]"
    with pytest.raises(InvalidArgument):
        tiny.prefill([])
