"""A small decoder-only transformer with deterministic weights: the compute behind a worker.

The model is written here (no downloads) so that workers, tests and the calibration tool
run the same code on any machine. Weights are drawn from a seeded generator, so two
processes that build the same preset with the same seed hold identical weights.

KV layout, per layer: key and value tensors of shape ``[tokens, kv_heads, head_dim]``.
Position ``i``'s KV depends only on tokens ``≤ i`` (causal attention, absolute learned
positions), so KV ``[0, k)`` computed in one place joined with KV ``[k, L)`` computed
elsewhere is the KV of the whole sequence.

Exact mode (the default for float64) runs every token's forward pass on its own, so each
position goes through the same kernels on the same inputs however tokens are grouped
into prefill, extend and decode calls: results are then bit-identical, which lets tests
compare KV moved between processes bit for bit. Batched BLAS kernels do not promise
that (their reduction order depends on the number of rows), so the fast mode used for
bf16/float32 is equal only up to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvrs.errors import InvalidArgument
from kvrs.tokenizer import VOCAB_SIZE, validate_token_ids

__all__ = [
    "DTYPES",
    "MODEL_CONFIGS",
    "KvCache",
    "Transformer",
    "TransformerConfig",
    "resolve_dtype",
]


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture of one preset."""

    name: str
    """Preset name, shared with `kvrs.model.MODEL_PRESETS` (the cost model's shapes)."""
    layers: int
    heads: int
    """Attention heads; every head has its own key/value head (kv_heads == heads)."""
    head_dim: int
    vocab_size: int
    max_positions: int
    """Longest sequence the learned position table covers."""
    mlp_ratio: int = 4

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.heads


MODEL_CONFIGS: dict[str, TransformerConfig] = {
    config.name: config
    for config in (
        # The byte-level vocabulary (kvrs.tokenizer): any text is a prompt.
        TransformerConfig(
            "tiny", layers=2, heads=2, head_dim=16, vocab_size=VOCAB_SIZE, max_positions=8192
        ),
        TransformerConfig(
            "opt-125m", layers=12, heads=12, head_dim=64, vocab_size=50272, max_positions=2048
        ),
    )
}

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (float64, float32, bfloat16, float16)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            "dtype", f"unknown dtype {name!r} (known: {', '.join(DTYPES)})"
        ) from None


class KvCache:
    """The KV of one sequence: per layer, key and value buffers with spare capacity.

    Buffers grow by doubling, so appending one decode token is amortised O(1); `views`
    hands out slices of the buffers that a transfer can receive into directly.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        capacity_tokens: int = 0,
    ) -> None:
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        shape = (capacity_tokens, kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(layers)]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def capacity_tokens(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * element

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` positions in total (existing views become stale)."""
        if tokens <= self.capacity_tokens:
            return
        capacity = max(tokens, 2 * self.capacity_tokens, 16)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.empty(
                    (capacity, self.kv_heads, self.head_dim), dtype=self.dtype, device=self.device
                )
                new[: self.length] = old[: self.length]
                buffers[i] = new

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value of layer `index` over the resident positions `[0, length)`."""
        return self.keys[index][: self.length], self.values[index][: self.length]

    def layers_kv(
        self, start: int = 0, end: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (key, value) views of positions `[start, end)` (default: all resident)."""
        end = self.length if end is None else end
        if not 0 <= start <= end <= self.length:
            raise InvalidArgument("token_range", f"[{start}, {end}) is outside [0, {self.length})")
        return [(k[start:end], v[start:end]) for k, v in zip(self.keys, self.values, strict=True)]

    def views(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Writable per-layer views of positions `[start, end)`, which may lie past `length`.

        Call `reserve(end)` first; writing the views and then `commit(end)` appends KV
        computed or received elsewhere without a copy.
        """
        if not 0 <= start <= end <= self.capacity_tokens:
            raise InvalidArgument(
                "token_range",
                f"[{start}, {end}) is outside the reserved [0, {self.capacity_tokens})",
            )
        return [(k[start:end], v[start:end]) for k, v in zip(self.keys, self.values, strict=True)]

    def commit(self, length: int) -> None:
        """Declare positions `[0, length)` resident (after writing them through `views`)."""
        if not 0 <= length <= self.capacity_tokens:
            raise InvalidArgument("length", f"{length} is outside [0, {self.capacity_tokens}]")
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (the buffers keep their capacity)."""
        if not 0 <= length <= self.length:
            raise InvalidArgument("length", f"{length} is outside [0, {self.length}]")
        self.length = length

    def resident_bytes(self) -> int:
        return self.length * self.bytes_per_token


class _Layer:
    """Weights of one pre-LayerNorm decoder block."""

    def __init__(self, hidden: int, mlp: int, draw) -> None:
        self.ln1_weight, self.ln1_bias = 1.0 + 0.1 * draw(hidden), 0.1 * draw(hidden)
        self.qkv_weight, self.qkv_bias = (
            draw(3 * hidden, hidden, fan_in=hidden),
            0.02 * draw(3 * hidden),
        )
        self.out_weight, self.out_bias = draw(hidden, hidden, fan_in=hidden), 0.02 * draw(hidden)
        self.ln2_weight, self.ln2_bias = 1.0 + 0.1 * draw(hidden), 0.1 * draw(hidden)
        self.fc1_weight, self.fc1_bias = draw(mlp, hidden, fan_in=hidden), 0.02 * draw(mlp)
        self.fc2_weight, self.fc2_bias = draw(hidden, mlp, fan_in=mlp), 0.02 * draw(hidden)


class Transformer:
    """A decoder-only transformer (OPT-like: learned positions, pre-LN, GELU MLP).

    Not an nn.Module: inference only, weights are plain tensors, no autograd.
    """

    def __init__(
        self,
        config: TransformerConfig,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: torch.device | str = "cpu",
        exact: bool | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed
        self.exact = dtype == torch.float64 if exact is None else exact
        generator = torch.Generator().manual_seed(seed)
        hidden = config.hidden

        def draw(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            # Drawn in float32 on the CPU whatever the target, so every dtype and device
            # gets the same weights from the same seed.
            scale = 1.0 / math.sqrt(fan_in) if fan_in else 1.0
            values = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
            return values.to(device=self.device, dtype=dtype)

        self.embed = draw(config.vocab_size, hidden)
        self.positions = 0.5 * draw(config.max_positions, hidden)
        self.blocks = [
            _Layer(hidden, config.mlp_ratio * hidden, draw) for _ in range(config.layers)
        ]
        self.lnf_weight, self.lnf_bias = 1.0 + 0.1 * draw(hidden), 0.1 * draw(hidden)
        # Untied: a head tied to the embedding makes a random model copy its input token.
        self.head = draw(config.vocab_size, hidden, fan_in=hidden)

    @classmethod
    def from_preset(
        cls,
        name: str,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: torch.device | str = "cpu",
        exact: bool | None = None,
    ) -> Transformer:
        """The preset called `name` (`MODEL_CONFIGS`); InvalidArgument("model") otherwise."""
        try:
            config = MODEL_CONFIGS[name]
        except KeyError:
            known = ", ".join(MODEL_CONFIGS)
            raise InvalidArgument("model", f"unknown model {name!r} (known: {known})") from None
        return cls(config, dtype=dtype, seed=seed, device=device, exact=exact)

    def new_cache(self, capacity_tokens: int = 0) -> KvCache:
        config = self.config
        return KvCache(
            config.layers,
            config.kv_heads,
            config.head_dim,
            self.dtype,
            self.device,
            capacity_tokens,
        )

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[int], cache: KvCache | None = None
    ) -> tuple[KvCache, torch.Tensor]:
        """KV of every prompt position and the logits of the last one.

        `cache`, when given, must be empty; it may have capacity reserved beyond the
        prompt (HYBRID receives the rest of the sequence into the same buffers).
        """
        cache = self.new_cache(len(token_ids)) if cache is None else cache
        if cache.length:
            raise InvalidArgument("cache", "prefill needs an empty cache; use extend")
        return cache, self._extend(cache, token_ids)

    @torch.inference_mode()
    def extend(self, cache: KvCache, token_ids: Sequence[int]) -> tuple[KvCache, torch.Tensor]:
        """Append KV for `token_ids` on top of the cache; logits of the last new position."""
        return cache, self._extend(cache, token_ids)

    @torch.inference_mode()
    def decode_step(self, cache: KvCache, token_id: int) -> torch.Tensor:
        """Feed one token (append its KV); the logits that predict the next one."""
        return self._extend(cache, [token_id])

    def complete(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """The undisturbed greedy continuation of `prompt`: the prefill's token, then
        greedy decoding — what a request must stream, however often it was recovered."""
        cache, logits = self.prefill(list(prompt))
        first = int(torch.argmax(logits))
        return [first, *self.greedy(cache, first, max_new_tokens - 1)]

    def greedy(
        self,
        cache: KvCache,
        next_token_id: int,
        max_new_tokens: int,
        stop_token_id: int | None = None,
    ) -> list[int]:
        """Greedy tokens after `next_token_id` (fed first); its KV and theirs are appended
        except for the last token returned, which is left pending like `next_token_id` was."""
        out: list[int] = []
        token = next_token_id
        while len(out) < max_new_tokens:
            token = int(torch.argmax(self.decode_step(cache, token)))
            out.append(token)
            if token == stop_token_id:
                break
        return out

    def _extend(self, cache: KvCache, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise InvalidArgument("token_ids", "must not be empty")
        validate_token_ids(token_ids, "token_ids", self.config.vocab_size)
        end = cache.length + len(token_ids)
        if end > self.config.max_positions:
            raise InvalidArgument(
                "token_ids",
                f"sequence of {end} tokens exceeds the model's "
                f"{self.config.max_positions} positions",
            )
        cache.reserve(end)
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        if self.exact:
            for i in range(len(ids)):
                logits = self._forward(cache, ids[i : i + 1])
            return logits
        return self._forward(cache, ids)

    def _forward(self, cache: KvCache, ids: torch.Tensor) -> torch.Tensor:
        """One batched pass over new positions `[cache.length, cache.length + len(ids))`."""
        config = self.config
        start, count = cache.length, len(ids)
        end = start + count
        hidden = self.embed[ids] + self.positions[start:end]
        mask = None
        if count > 1:
            rows = torch.arange(start, end, device=self.device)[:, None]
            mask = torch.arange(end, device=self.device)[None, :] <= rows
        for index, block in enumerate(self.blocks):
            normed = F.layer_norm(hidden, (config.hidden,), block.ln1_weight, block.ln1_bias)
            qkv = F.linear(normed, block.qkv_weight, block.qkv_bias)
            q, k, v = qkv.view(count, 3, config.heads, config.head_dim).unbind(1)
            cache.keys[index][start:end] = k
            cache.values[index][start:end] = v
            keys = cache.keys[index][:end].transpose(0, 1)
            values = cache.values[index][:end].transpose(0, 1)
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys, values, attn_mask=mask
            )
            attended = attended.transpose(0, 1).reshape(count, config.hidden)
            hidden = hidden + F.linear(attended, block.out_weight, block.out_bias)
            normed = F.layer_norm(hidden, (config.hidden,), block.ln2_weight, block.ln2_bias)
            mlp = F.gelu(F.linear(normed, block.fc1_weight, block.fc1_bias))
            hidden = hidden + F.linear(mlp, block.fc2_weight, block.fc2_bias)
        cache.commit(end)
        last = F.layer_norm(hidden[-1], (config.hidden,), self.lnf_weight, self.lnf_bias)
        return F.linear(last, self.head)
