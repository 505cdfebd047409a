"""Model shapes and their KV size: S(L) = L · 2 · layers · kv_heads · head_dim · dtype_bytes."""

from __future__ import annotations

from dataclasses import dataclass

from kvrs.errors import InvalidArgument

__all__ = ["MODEL_PRESETS", "ModelSpec", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts that fix how many bytes of KV one token occupies."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int = 512
    """Prefix-block granularity: prompts are hashed in blocks of this many tokens."""

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


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("opt-13b", layers=40, kv_heads=40, head_dim=128, dtype_bytes=2),
        ModelSpec("llama3-70b", layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
        ModelSpec("llama3-8b", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
        ModelSpec("opt-125m", layers=12, kv_heads=12, head_dim=64, dtype_bytes=2),
        # float64 so that KV moved between CPU workers can be compared bit for bit.
        ModelSpec("tiny", layers=2, kv_heads=2, head_dim=16, dtype_bytes=8),
    )
}


def model_spec(name: str) -> ModelSpec:
    """The preset called `name`; InvalidArgument("model") lists the known ones otherwise."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(MODEL_PRESETS))
        raise InvalidArgument("model", f"unknown model {name!r} (known: {known})") from None
