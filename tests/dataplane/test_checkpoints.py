"""Checkpoints loaded by the workers' model code equal `transformers` on the same files:
logits to float32 rounding and 64 greedy tokens exactly, for every supported family."""

from __future__ import annotations

import json

import pytest
import torch

from kvrs.errors import InvalidArgument
from kvrs.model import model_spec
from services.common.tokenizer import load_codec
from services.worker.model import Transformer
from tests.checkpoints import CORPUS, save_checkpoint
from tests.hf_reference import greedy, logits

VARIANTS = {
    "llama-gqa": ("LlamaForCausalLM", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama-rope-base": (
        "LlamaForCausalLM",
        {"rope_theta": 500000.0, "num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
    "llama3-scaling": (
        "LlamaForCausalLM",
        {
            "head_dim": 32,
            "rope_scaling": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-scaling": (
        "LlamaForCausalLM",
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    ),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 24}),
    "qwen2-bias": ("Qwen2ForCausalLM", {"rope_theta": 1000000.0}),
    "opt": ("OPTForCausalLM", {}),
    "opt-post-norm": (
        "OPTForCausalLM",
        {"do_layer_norm_before": False, "word_embed_proj_dim": 32},
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: str(save_checkpoint(root / name, architecture, **config))
        for name, (architecture, config) in VARIANTS.items()
    }


def _prompt(path: str) -> list[int]:
    return load_codec(path).encode(" ".join(CORPUS[:3]))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_equal_transformers_to_float32_rounding(checkpoints, name):
    path = checkpoints[name]
    prompt = _prompt(path)
    model = Transformer.load(path, torch.float32)
    expected = logits(path, prompt)
    split = len(prompt) // 2
    cache, first = model.prefill(prompt[:split])
    _, last = model.extend(cache, prompt[split:])
    diff = max(
        float((first - expected[split - 1]).abs().max()), float((last - expected[-1]).abs().max())
    )
    assert diff < 2e-5, f"{name}: logits differ by {diff}"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_64_greedy_tokens_equal_transformers_generate(checkpoints, name):
    path = checkpoints[name]
    prompt = _prompt(path)
    model = Transformer.load(path, torch.float32)
    expected = greedy(path, prompt, 64)
    assert len(set(expected)) > 2, "a degenerate model would not test much"
    assert model.complete(prompt, 64) == expected


def test_sharded_bf16_checkpoint_loads_and_is_priced_by_its_config(tmp_path):
    path = save_checkpoint(tmp_path / "bf16", "LlamaForCausalLM", dtype=torch.bfloat16)
    # Reshard into two files, as large checkpoints come.
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = Transformer.load(str(path))
    assert model.dtype == torch.bfloat16
    cache, _ = model.prefill(_prompt(str(path)))
    spec = model_spec(str(path))
    assert (spec.layers, spec.kv_heads, spec.head_dim, spec.dtype_bytes) == (2, 2, 16, 2)
    assert cache.bytes_per_token == spec.kv_bytes_per_token


def test_unsupported_architecture_and_missing_files_are_refused_by_name(checkpoints, tmp_path):
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidArgument, match="GPT2LMHeadModel"):
        Transformer.load(str(path))
    with pytest.raises(InvalidArgument, match="GPT2LMHeadModel"):
        model_spec(str(path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidArgument, match="config.json"):
        Transformer.load(str(empty))
    (empty / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    with pytest.raises(InvalidArgument, match="tokenizer.json"):
        Transformer.load(str(empty))
    (empty / "config.json").write_text(open(f"{checkpoints['opt']}/config.json").read())
    (empty / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidArgument, match="model.safetensors"):
        Transformer.load(str(empty))
    config = json.loads(open(f"{checkpoints['llama-gqa']}/config.json").read())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match="yarn"):
        Transformer.load(str(empty))
