"""The worker's model on the embedded checkpoint: extend equals prefill, split KV joins,
greedy is stable, the checkpoint is the same bytes wherever it is written."""

from __future__ import annotations

import pytest
import torch

from kvrs.errors import InvalidArgument
from kvrs.model import EMBEDDED_CHECKPOINTS, model_spec
from kvrs.tokenizer import encode
from services.worker.checkpoint import resolve_checkpoint
from services.worker.model import Transformer
from services.worker.paged_kv import KvCache

PROMPT = encode("Disaggregated inference moves KV caches across the network.")
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer.load("tiny")


def assert_close_kv(a: KvCache, b: KvCache, **tolerance) -> None:
    assert a.length == b.length
    for (ka, va), (kb, vb) in zip(a.layers_kv(), b.layers_kv(), strict=True):
        torch.testing.assert_close(ka, kb, **(tolerance or TIGHT))
        torch.testing.assert_close(va, vb, **(tolerance or TIGHT))


def test_the_embedded_default_is_a_float64_llama_with_gqa(tiny):
    assert tiny.config.family == "llama"
    assert (tiny.config.heads, tiny.config.kv_heads) == (4, 2)
    assert tiny.dtype == torch.float64


@pytest.mark.parametrize("split", [1, 7, 30, len(PROMPT) - 1])
def test_extend_equals_full_prefill(tiny, split):
    full, full_logits = tiny.prefill(PROMPT)
    cache, _ = tiny.prefill(PROMPT[:split])
    _, logits = tiny.extend(cache, PROMPT[split:])
    assert_close_kv(full, cache)
    torch.testing.assert_close(full_logits, logits, **TIGHT)


def test_decode_steps_equal_prefill_of_the_longer_sequence(tiny):
    cache, logits = tiny.prefill(PROMPT)
    generated = tiny.greedy(cache, int(torch.argmax(logits)), 12)
    sequence = PROMPT + [int(torch.argmax(logits))] + generated[:-1]
    reference, _ = tiny.prefill(sequence)
    assert_close_kv(reference, cache)


def test_kv_split_from_two_computations_joins(tiny):
    """KV [0, k) from a recompute of the prefix + KV [k, L) from the full prefill == full."""
    full, full_logits = tiny.prefill(PROMPT)
    k = 23
    prefix, _ = tiny.prefill(PROMPT[:k])
    joined = tiny.new_cache()
    joined.write_layers(0, prefix.layers_kv())
    joined.write_layers(k, full.layers_kv(k, len(PROMPT)))
    joined.commit(len(PROMPT))
    assert_close_kv(full, joined)
    first = int(torch.argmax(full_logits))
    assert tiny.greedy(joined, first, 16) == tiny.greedy(full, first, 16)


def test_the_embedded_checkpoint_is_the_same_bytes_wherever_it_is_written(
    tiny, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVRS_CACHE_DIR", str(tmp_path))
    fresh = resolve_checkpoint("tiny")
    assert str(fresh).startswith(str(tmp_path))
    monkeypatch.delenv("KVRS_CACHE_DIR")
    cached = resolve_checkpoint("tiny")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (fresh / name).read_bytes() == (cached / name).read_bytes()
    generated = tiny.complete(PROMPT, 20)
    assert len(set(generated)) > 3, "a degenerate model would repeat one token"


def test_bf16_extend_matches_prefill_to_rounding():
    model = Transformer.load("tiny", torch.bfloat16)
    full, _ = model.prefill(PROMPT)
    cache, _ = model.prefill(PROMPT[:20])
    model.extend(cache, PROMPT[20:])
    assert cache.gather(0)[0].dtype == torch.bfloat16
    for (fk, _), (ck, _) in zip(full.layers_kv(), cache.layers_kv(), strict=True):
        torch.testing.assert_close(ck, fk, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", sorted(EMBEDDED_CHECKPOINTS))
def test_the_cost_models_kv_shape_is_the_checkpoints(name):
    model = Transformer.load(name)
    spec = model_spec(name)
    config = model.config
    assert (config.layers, config.kv_heads, config.head_dim) == (
        spec.layers,
        spec.kv_heads,
        spec.head_dim,
    )
    assert model.new_cache().bytes_per_token == spec.kv_bytes_per_token


def test_kv_layout_and_bytes_per_token(tiny):
    cache, _ = tiny.prefill(PROMPT)
    key, value = cache.gather(1)
    assert key.shape == value.shape == (len(PROMPT), 2, 16)
    assert cache.bytes_per_token == model_spec("tiny").kv_bytes_per_token
    assert cache.resident_bytes() == model_spec("tiny").kv_bytes(len(PROMPT))


def test_bad_tokens_name_the_field(tiny):
    with pytest.raises(InvalidArgument) as info:
        tiny.prefill([1, 2, 9999])
    assert info.value.field == "token_ids[2]"
    with pytest.raises(InvalidArgument):
        tiny.prefill([])


def test_a_name_that_is_no_checkpoint_is_refused():
    with pytest.raises(InvalidArgument, match="opt-125m"):
        Transformer.load("opt-125m")
    with pytest.raises(InvalidArgument, match="does not exist"):
        Transformer.load("/no/such/checkpoint")
