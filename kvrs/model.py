"""Model shapes and their KV size: S(L) = L · 2 · layers · kv_heads · head_dim · dtype_bytes.

A model is named either by a preset (the shapes of models the simulator and the cost
model reason about) or by a Hugging Face checkpoint directory, whose `config.json` is
then the one source of its KV shape: the workers load the same file, so what the cost
model prices is what the workers hold. The embedded default (`DEFAULT_MODEL`) is a
checkpoint the workers write on first use from `EMBEDDED_CHECKPOINTS`, whose config is
also what its preset is derived from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrs.errors import InvalidArgument

__all__ = [
    "BLOCK_TOKENS_VARIABLE",
    "DEFAULT_BLOCK_TOKENS",
    "DEFAULT_MODEL",
    "EMBEDDED_CHECKPOINTS",
    "MODEL_PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "ModelSpec",
    "block_tokens_setting",
    "checkpoint_dir",
    "model_spec",
    "read_checkpoint_config",
    "served_model_name",
]

DEFAULT_MODEL = "tiny"
"""The model of every service when none is given (KVRS_MODEL unset): the embedded
checkpoint below, so the default path goes through the real checkpoint loader."""

EMBEDDED_CHECKPOINTS: dict[str, dict[str, Any]] = {
    # A two-layer Llama with grouped-query attention over the byte-level vocabulary of
    # kvrs.tokenizer (256 bytes, <bos>, <eos>). Its weights are random (seeded), so its
    # text is meaningless; float64 so that runs split across workers agree to the bit.
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "vocab_size": 258,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "float64",
    }
}
"""Config of each embedded checkpoint, exactly as its config.json is written."""

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "OPTForCausalLM": "opt",
}
"""Checkpoint architectures the workers run, by the family of model code that runs them."""

DEFAULT_BLOCK_TOKENS = 512
"""Prefix-block size when `KVRS_BLOCK_TOKENS` is unset."""

BLOCK_TOKENS_VARIABLE = "KVRS_BLOCK_TOKENS"
"""The cluster's prefix-block size, in tokens: workers allocate and budget KV in blocks
of it and hash resident prompts by it, routers and schedulers hash prompts by it. Every
process of a cluster must see the same value, or prefix hashes would never match."""

DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each dtype a checkpoint may name."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts that fix how many bytes of KV one token occupies."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    """Prefix-block granularity: prompts are hashed in blocks of this many tokens
    (`model_spec` sets it from KVRS_BLOCK_TOKENS)."""
    params: int = 0
    """Parameter count (0 = unknown): what a profile estimated without calibration scales by."""
    vocab_size: int = 0
    """Token ids are below this (0 = unknown)."""
    max_positions: int = 0
    """Longest sequence the model takes (0 = unknown)."""

    @classmethod
    def from_hf_config(cls, name: str, config: Mapping[str, Any]) -> ModelSpec:
        """The KV shape a Hugging Face `config.json` describes (InvalidArgument naming the
        key that is missing or of an unsupported value)."""
        family = _family(config)
        layers = _positive(config, "num_hidden_layers")
        heads = _positive(config, "num_attention_heads")
        hidden = _positive(config, "hidden_size")
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        if dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                "config.torch_dtype",
                f"unsupported dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})",
            )
        vocab = _positive(config, "vocab_size")
        if family == "opt":
            kv_heads, head_dim = heads, hidden // heads
            ffn = _positive(config, "ffn_dim")
            per_layer = 4 * hidden * hidden + 2 * hidden * ffn
            embed = vocab * int(config.get("word_embed_proj_dim") or hidden)
        else:
            kv_heads = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            inter = _positive(config, "intermediate_size")
            per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
            per_layer += 3 * hidden * inter
            embed = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(
            name,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=DTYPE_BYTES[dtype],
            params=embed + layers * per_layer,
            vocab_size=vocab,
            max_positions=int(config.get("max_position_embeddings") or 0),
        )

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes", "block_tokens"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(field, f"must be a positive integer, got {value!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value (the 2) for every layer and KV head of one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes(self, tokens: int) -> int:
        """S(L): bytes of KV cache for `tokens` tokens."""
        if tokens < 0:
            raise InvalidArgument("tokens", f"must be >= 0, got {tokens}")
        return tokens * self.kv_bytes_per_token


def _family(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[architecture]
    raise InvalidArgument(
        "config.architectures",
        f"unsupported architecture {', '.join(map(str, architectures)) or '(none)'} "
        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
    )


def _positive(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"config.{key}", f"must be a positive integer, got {value!r}")
    return value


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("opt-13b", layers=40, kv_heads=40, head_dim=128, dtype_bytes=2),
        ModelSpec("llama3-70b", layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
        ModelSpec("llama3-8b", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
        ModelSpec("opt-125m", layers=12, kv_heads=12, head_dim=64, dtype_bytes=2),
        *(ModelSpec.from_hf_config(name, c) for name, c in EMBEDDED_CHECKPOINTS.items()),
    )
}


def checkpoint_dir(model: str) -> str | None:
    """The checkpoint directory `model` names, or None for a preset or embedded name."""
    if model in MODEL_PRESETS:
        return None
    return model if os.path.isdir(model) else None


def read_checkpoint_config(path: str) -> dict[str, Any]:
    """The parsed config.json of checkpoint directory `path` (InvalidArgument("model")
    naming the file when it is missing or not JSON)."""
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except FileNotFoundError:
        raise InvalidArgument("model", f"checkpoint {path}: missing file config.json") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            "model", f"checkpoint {path}: config.json unreadable: {exc}"
        ) from None
    if not isinstance(config, dict):
        raise InvalidArgument("model", f"checkpoint {path}: config.json is not an object")
    return config


def served_model_name(model: str) -> str:
    """The name clients use for `model`: a checkpoint directory's base name, else `model`."""
    if checkpoint_dir(model) is None:
        return model
    return os.path.basename(os.path.normpath(os.path.abspath(model)))


def block_tokens_setting(env: Mapping[str, str] | None = None) -> int:
    """KVRS_BLOCK_TOKENS of `env` (default: this process's environment), else 512;
    InvalidArgument naming the variable unless it is a positive integer."""
    text = (os.environ if env is None else env).get(BLOCK_TOKENS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_BLOCK_TOKENS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidArgument(
            BLOCK_TOKENS_VARIABLE, f"must be a positive integer (tokens), got {text!r}"
        )
    return value


def model_spec(name: str) -> ModelSpec:
    """The preset called `name`, or the spec of the checkpoint directory `name` names,
    with the cluster's block size (`block_tokens_setting`); InvalidArgument("model")
    lists the known presets otherwise."""
    spec = _model_spec(name)
    block_tokens = block_tokens_setting()
    if block_tokens != spec.block_tokens:
        spec = dataclasses.replace(spec, block_tokens=block_tokens)
    return spec


def _model_spec(name: str) -> ModelSpec:
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    path = checkpoint_dir(name)
    if path is None:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise InvalidArgument(
            "model", f"unknown model {name!r} (known: {known}; or a checkpoint directory)"
        )
    try:
        return ModelSpec.from_hf_config(name, read_checkpoint_config(path))
    except InvalidArgument as exc:
        if exc.field == "model":
            raise
        raise InvalidArgument("model", f"checkpoint {path}: {exc}") from None
