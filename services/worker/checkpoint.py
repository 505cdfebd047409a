"""Hugging Face checkpoint directories: what their config says, their weights, the embedded one.

A checkpoint is a directory with `config.json`, the weights in `*.safetensors` (one
file, or shards listed by `model.safetensors.index.json`) and `tokenizer.json`. Anything
the model code cannot run exactly — an architecture, a RoPE variant, a missing file or
tensor — is refused here, at start-up, with a message naming it: a worker that served a
subtly different model would be worse than one that does not start.

The embedded default (`kvrs.model.EMBEDDED_CHECKPOINTS`) is written on first use under
the cache directory with seeded weights, so every process derives the same bytes, and
then loaded like any other checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvrs.errors import InvalidArgument
from kvrs.model import (
    EMBEDDED_CHECKPOINTS,
    SUPPORTED_ARCHITECTURES,
    checkpoint_dir,
    read_checkpoint_config,
)
from services.common.tokenizer import byte_level_tokenizer

__all__ = [
    "Architecture",
    "Rope",
    "architecture_from_config",
    "cache_dir",
    "load_weights",
    "read_architecture",
    "resolve_checkpoint",
]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_EMBEDDED_FORMAT = 1
"""Bumped when the embedded checkpoint's weights are drawn differently (a new cache entry)."""


@dataclass(frozen=True)
class Rope:
    """Rotary embedding: inverse frequencies from `theta`, rescaled by `kind`."""

    theta: float
    kind: str = "default"
    """default, linear or llama3."""
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class Architecture:
    """What the model code needs from config.json (names as the worker uses them)."""

    name: str
    family: str
    """llama (Llama, Mistral, Qwen2, SmolLM, TinyLlama) or opt."""
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab_size: int
    max_positions: int
    norm_eps: float
    activation: str
    tie_word_embeddings: bool
    dtype: str
    """The checkpoint's own dtype (config torch_dtype/dtype), what a worker runs by default."""
    rope: Rope | None = None
    sliding_windows: tuple[int | None, ...] = ()
    """Per layer: attend to at most this many latest positions (None: all)."""
    pre_norm: bool = True
    """OPT: LayerNorm before each sublayer (do_layer_norm_before)."""
    embed_dim: int = 0
    """OPT: word embedding width when it differs from hidden (project_in/out)."""
    final_norm: bool = True


def _get(config: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None and default is None:
        raise InvalidArgument(f"config.{key}", "is required")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise InvalidArgument(f"config.{key}", f"must be a positive integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise InvalidArgument(f"config.{key}", f"must be a number, got {value!r}")
    return kind(value)


def _rope(config: dict[str, Any]) -> Rope:
    """RoPE from either form a config may use: transformers 5's `rope_parameters` or the
    older `rope_theta` with `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise InvalidArgument("config.partial_rotary_factor", "partial rotary is not supported")
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, kind, factor=float(params["factor"]))
    if kind == "llama3":
        return Rope(
            theta,
            kind,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
        )
    raise InvalidArgument(
        "config.rope_scaling",
        f"unsupported RoPE type {kind!r} (supported: default, linear, llama3)",
    )


def _sliding_windows(config: dict[str, Any], architecture: str, layers: int):
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if architecture == "Qwen2ForCausalLM":
        if not config.get("use_sliding_window", False):
            window = None
        elif types is None:
            first = int(config.get("max_window_layers", layers))
            types = ["full_attention"] * first + ["sliding_attention"] * (layers - first)
    if window is None:
        return (None,) * layers
    if types is None:
        return (int(window),) * layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def read_architecture(path: str | Path, name: str = "") -> Architecture:
    """The architecture of checkpoint directory `path`; InvalidArgument names what is
    unsupported or missing."""
    config = read_checkpoint_config(str(path))
    return architecture_from_config(config, name or os.path.basename(os.path.normpath(str(path))))


def architecture_from_config(config: dict[str, Any], name: str) -> Architecture:
    """The architecture a parsed config.json describes (see `read_architecture`)."""
    architectures = config.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise InvalidArgument(
            "config.architectures",
            f"unsupported architecture {', '.join(map(str, architectures)) or '(none)'} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    family = SUPPORTED_ARCHITECTURES[architecture]
    layers = _get(config, "num_hidden_layers", int)
    heads = _get(config, "num_attention_heads", int)
    hidden = _get(config, "hidden_size", int)
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise InvalidArgument("config.torch_dtype", f"unsupported dtype {dtype!r}")
    common = {
        "name": name,
        "family": family,
        "layers": layers,
        "heads": heads,
        "hidden": hidden,
        "vocab_size": _get(config, "vocab_size", int),
        "max_positions": _get(config, "max_position_embeddings", int),
        "dtype": dtype,
    }
    if family == "opt":
        if hidden % heads:
            raise InvalidArgument("config.hidden_size", "must be a multiple of the heads")
        if not config.get("enable_bias", True):
            raise InvalidArgument("config.enable_bias", "OPT without biases is not supported")
        if not config.get("layer_norm_elementwise_affine", True):
            raise InvalidArgument(
                "config.layer_norm_elementwise_affine", "OPT without affine norms is not supported"
            )
        pre_norm = bool(config.get("do_layer_norm_before", True))
        return Architecture(
            **common,
            kv_heads=heads,
            head_dim=hidden // heads,
            intermediate=_get(config, "ffn_dim", int),
            norm_eps=1e-5,
            activation=str(config.get("activation_function", "relu")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            pre_norm=pre_norm,
            embed_dim=int(config.get("word_embed_proj_dim") or hidden),
            final_norm=pre_norm and not config.get("_remove_final_layer_norm", False),
        )
    kv_heads = _get(config, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise InvalidArgument(
            "config.num_key_value_heads", f"{kv_heads} does not divide the {heads} heads"
        )
    return Architecture(
        **common,
        kv_heads=kv_heads,
        head_dim=_get(config, "head_dim", int, hidden // heads),
        intermediate=_get(config, "intermediate_size", int),
        norm_eps=_get(config, "rms_norm_eps", float, 1e-6),
        activation=str(config.get("hidden_act", "silu")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope=_rope(config),
        sliding_windows=_sliding_windows(config, architecture, layers),
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise InvalidArgument("model", f"checkpoint {path}: missing shard {file.name}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(
            "model",
            f"checkpoint {path}: missing file model.safetensors (or a sharded "
            "model.safetensors.index.json); only safetensors weights are loaded",
        )
    return files


def load_weights(path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, cast to `dtype`, by name without the `model.` prefix."""
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = key.removeprefix("model.")
                weights[name] = handle.get_tensor(key).to(dtype)
    return weights


def cache_dir() -> Path:
    """KVRS_CACHE_DIR, else ~/.cache/kvrs: where the embedded checkpoint is written."""
    configured = os.environ.get("KVRS_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kvrs"


def resolve_checkpoint(model: str) -> Path:
    """The checkpoint directory `model` names: itself, or the embedded checkpoint of that
    name (written on first use). InvalidArgument("model") otherwise."""
    path = checkpoint_dir(model)
    if path is not None:
        for required in ("config.json", "tokenizer.json"):
            if not os.path.isfile(os.path.join(path, required)):
                raise InvalidArgument("model", f"checkpoint {path}: missing file {required}")
        return Path(path)
    if model in EMBEDDED_CHECKPOINTS:
        return _embedded(model)
    if os.path.sep in model or model.startswith("."):
        raise InvalidArgument("model", f"checkpoint directory {model} does not exist")
    raise InvalidArgument(
        "model",
        f"{model!r} is neither a checkpoint directory nor an embedded checkpoint "
        f"({', '.join(EMBEDDED_CHECKPOINTS)})",
    )


def _embedded(name: str) -> Path:
    config = EMBEDDED_CHECKPOINTS[name]
    digest = hashlib.sha256(
        json.dumps([config, _EMBEDDED_FORMAT], sort_keys=True).encode()
    ).hexdigest()[:12]
    target = cache_dir() / "models" / f"{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        _write_embedded(staging, config)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's same result
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_embedded(path: Path, config: dict[str, Any]) -> None:
    """Seeded weights in float32 cast to the config's dtype, so the same name always
    yields the same bytes; projections scaled by 1/sqrt(fan in), norms near 1."""
    arch = architecture_from_config(config, path.name)
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[arch.dtype]

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    hidden, q_dim = arch.hidden, arch.heads * arch.head_dim
    kv_dim = arch.kv_heads * arch.head_dim
    tensors = {"model.embed_tokens.weight": draw(arch.vocab_size, hidden)}
    for i in range(arch.layers):
        prefix = f"model.layers.{i}."
        tensors[prefix + "input_layernorm.weight"] = 1 + draw(hidden, scale=0.1)
        tensors[prefix + "self_attn.q_proj.weight"] = draw(q_dim, hidden, scale=hidden**-0.5)
        tensors[prefix + "self_attn.k_proj.weight"] = draw(kv_dim, hidden, scale=hidden**-0.5)
        tensors[prefix + "self_attn.v_proj.weight"] = draw(kv_dim, hidden, scale=hidden**-0.5)
        tensors[prefix + "self_attn.o_proj.weight"] = draw(hidden, q_dim, scale=q_dim**-0.5)
        tensors[prefix + "post_attention_layernorm.weight"] = 1 + draw(hidden, scale=0.1)
        inter = arch.intermediate
        tensors[prefix + "mlp.gate_proj.weight"] = draw(inter, hidden, scale=hidden**-0.5)
        tensors[prefix + "mlp.up_proj.weight"] = draw(inter, hidden, scale=hidden**-0.5)
        tensors[prefix + "mlp.down_proj.weight"] = draw(hidden, inter, scale=1 / math.sqrt(inter))
    tensors["model.norm.weight"] = 1 + draw(hidden, scale=0.1)
    tensors["lm_head.weight"] = draw(arch.vocab_size, hidden, scale=hidden**-0.5)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
