"""The model code behind a worker: Llama-family and OPT decoders over a Hugging Face checkpoint.

Weights come from a checkpoint directory (`services.worker.checkpoint`), mapped from the
checkpoint's tensor names onto plain tensors, as serving engines do; the arithmetic
follows the reference implementation (`transformers`) step for step, including where it
computes in float32 (RMSNorm, rotary angles), so logits agree to rounding and greedy
tokens agree exactly.

KV lives in blocks of a pool (`services.worker.paged_kv`): each pass writes its new
positions' keys and values into their sequences' blocks and attends over the blocks'
slots. Position ``i``'s KV depends only on tokens ``≤ i`` (causal attention), so KV
``[0, k)`` computed in one place joined with KV ``[k, L)`` computed elsewhere is the KV
of the whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvrs.errors import InvalidArgument
from kvrs.tokenizer import validate_token_ids
from services.worker.checkpoint import (
    DTYPES,
    Architecture,
    Rope,
    load_weights,
    read_architecture,
    resolve_checkpoint,
)
from services.worker.paged_kv import KvCache, KvPool

__all__ = ["DTYPES", "Transformer", "resolve_dtype"]

SCRATCH_BLOCK_TOKENS = 16
"""Block size of the pool behind caches made outside a worker (tests, calibration, the
health canary); a worker's own pool uses the cluster's block size."""


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (float64, float32, bfloat16, float16)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            "dtype", f"unknown dtype {name!r} (known: {', '.join(DTYPES)})"
        ) from None


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _inverse_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """Per rotary pair, float32 as the reference computes them; rescaled per `rope.kind`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_positions / rope.low_freq_factor
        high_wavelen = rope.original_max_positions / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference does whatever the weights' dtype."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass
class _Weights:
    """One decoder block's tensors (None where the checkpoint has no such bias)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    norm1: torch.Tensor
    norm1_bias: torch.Tensor | None
    norm2: torch.Tensor
    norm2_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    gate: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None


class _Tensors:
    """The checkpoint's tensors by name; a missing or misshapen one is refused by name."""

    def __init__(self, path: str, weights: dict[str, torch.Tensor], device: torch.device):
        self._path = path
        self._weights = weights
        self._device = device
        self.used: set[str] = set()

    def get(self, name: str, *shape: int) -> torch.Tensor:
        tensor = self.optional(name, *shape)
        if tensor is None:
            raise InvalidArgument("model", f"checkpoint {self._path}: missing tensor {name}")
        return tensor

    def optional(self, name: str, *shape: int) -> torch.Tensor | None:
        tensor = self._weights.get(name)
        if tensor is None:
            return None
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(
                "model",
                f"checkpoint {self._path}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {shape}",
            )
        self.used.add(name)
        return tensor.to(self._device)


class Transformer:
    """A decoder-only model loaded from a checkpoint (the Llama family or OPT).

    Not an nn.Module: inference only, weights are plain tensors, no autograd.
    """

    def __init__(
        self,
        arch: Architecture,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        path: str = "",
    ) -> None:
        if arch.activation not in _ACTIVATIONS:
            raise InvalidArgument(
                "config.hidden_act", f"unsupported activation {arch.activation!r}"
            )
        self.config = arch
        self.name = arch.name
        self.dtype = dtype
        self.device = torch.device(device)
        self._scratch: KvPool | None = None
        self._act = _ACTIVATIONS[arch.activation]
        tensors = _Tensors(path or arch.name, weights, self.device)
        if arch.family == "opt":
            self._load_opt(tensors)
        else:
            self._load_llama(tensors)
        unused = sorted(set(weights) - tensors.used)
        if unused:
            raise InvalidArgument(
                "model",
                f"checkpoint {path or arch.name}: tensors the {arch.family} code does not "
                f"use: {', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}",
            )

    @classmethod
    def load(cls, model: str, dtype: torch.dtype | None = None, device: str = "cpu") -> Transformer:
        """The checkpoint `model` names (a directory or an embedded name), in `dtype`
        (default: the checkpoint's own)."""
        path = resolve_checkpoint(model)
        arch = read_architecture(path, name=model)
        dtype = dtype or DTYPES[arch.dtype]
        return cls(arch, load_weights(path, dtype), dtype, device, str(path))

    # -- weights ----------------------------------------------------------------------

    def _load_llama(self, t: _Tensors) -> None:
        a = self.config
        hidden, q_dim, kv_dim = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
        self.embed = t.get("embed_tokens.weight", a.vocab_size, hidden)
        self.blocks = []
        for i in range(a.layers):
            p = f"layers.{i}."
            self.blocks.append(
                _Weights(
                    q=t.get(p + "self_attn.q_proj.weight", q_dim, hidden),
                    k=t.get(p + "self_attn.k_proj.weight", kv_dim, hidden),
                    v=t.get(p + "self_attn.v_proj.weight", kv_dim, hidden),
                    o=t.get(p + "self_attn.o_proj.weight", hidden, q_dim),
                    q_bias=t.optional(p + "self_attn.q_proj.bias", q_dim),
                    k_bias=t.optional(p + "self_attn.k_proj.bias", kv_dim),
                    v_bias=t.optional(p + "self_attn.v_proj.bias", kv_dim),
                    o_bias=t.optional(p + "self_attn.o_proj.bias", hidden),
                    norm1=t.get(p + "input_layernorm.weight", hidden),
                    norm1_bias=None,
                    norm2=t.get(p + "post_attention_layernorm.weight", hidden),
                    norm2_bias=None,
                    gate=t.get(p + "mlp.gate_proj.weight", a.intermediate, hidden),
                    gate_bias=t.optional(p + "mlp.gate_proj.bias", a.intermediate),
                    up=t.get(p + "mlp.up_proj.weight", a.intermediate, hidden),
                    up_bias=t.optional(p + "mlp.up_proj.bias", a.intermediate),
                    down=t.get(p + "mlp.down_proj.weight", hidden, a.intermediate),
                    down_bias=t.optional(p + "mlp.down_proj.bias", hidden),
                )
            )
        self.final_norm: torch.Tensor | None = t.get("norm.weight", hidden)
        self.final_norm_bias: torch.Tensor | None = None
        head = t.optional("lm_head.weight", a.vocab_size, hidden)
        self.head = self.embed if head is None else head
        t.optional("rotary_emb.inv_freq", a.head_dim // 2)  # older exports; recomputed
        self._inv_freq = _inverse_frequencies(a.rope or Rope(10000.0), a.head_dim)

    def _load_opt(self, t: _Tensors) -> None:
        a = self.config
        hidden, embed = a.hidden, a.embed_dim
        self.embed = t.get("decoder.embed_tokens.weight", a.vocab_size, embed)
        self.positions = t.get("decoder.embed_positions.weight", a.max_positions + 2, hidden)
        self.project_in = t.optional("decoder.project_in.weight", hidden, embed)
        self.project_out = t.optional("decoder.project_out.weight", embed, hidden)
        if embed != hidden and (self.project_in is None or self.project_out is None):
            raise InvalidArgument("model", "checkpoint: missing tensor decoder.project_in.weight")
        self.blocks = []
        for i in range(a.layers):
            p = f"decoder.layers.{i}."
            self.blocks.append(
                _Weights(
                    q=t.get(p + "self_attn.q_proj.weight", hidden, hidden),
                    k=t.get(p + "self_attn.k_proj.weight", hidden, hidden),
                    v=t.get(p + "self_attn.v_proj.weight", hidden, hidden),
                    o=t.get(p + "self_attn.out_proj.weight", hidden, hidden),
                    q_bias=t.get(p + "self_attn.q_proj.bias", hidden),
                    k_bias=t.get(p + "self_attn.k_proj.bias", hidden),
                    v_bias=t.get(p + "self_attn.v_proj.bias", hidden),
                    o_bias=t.get(p + "self_attn.out_proj.bias", hidden),
                    norm1=t.get(p + "self_attn_layer_norm.weight", hidden),
                    norm1_bias=t.get(p + "self_attn_layer_norm.bias", hidden),
                    norm2=t.get(p + "final_layer_norm.weight", hidden),
                    norm2_bias=t.get(p + "final_layer_norm.bias", hidden),
                    up=t.get(p + "fc1.weight", a.intermediate, hidden),
                    up_bias=t.get(p + "fc1.bias", a.intermediate),
                    down=t.get(p + "fc2.weight", hidden, a.intermediate),
                    down_bias=t.get(p + "fc2.bias", hidden),
                )
            )
        self.final_norm = self.final_norm_bias = None
        if a.final_norm:
            self.final_norm = t.get("decoder.final_layer_norm.weight", hidden)
            self.final_norm_bias = t.get("decoder.final_layer_norm.bias", hidden)
        head = t.optional("lm_head.weight", a.vocab_size, embed)
        self.head = self.embed if head is None else head

    # -- requests ---------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value bytes of one position over every layer, in this model's dtype."""
        config = self.config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * config.layers * config.kv_heads * config.head_dim * element

    def new_pool(self, num_blocks: int, block_tokens: int, growable: bool = False) -> KvPool:
        """A pool of `num_blocks` KV blocks of this model's shape (a worker's KV memory)."""
        config = self.config
        return KvPool(
            config.layers,
            config.kv_heads,
            config.head_dim,
            self.dtype,
            block_tokens,
            num_blocks,
            self.device,
            growable,
        )

    def new_cache(self, capacity_tokens: int = 0) -> KvCache:
        """A sequence in this model's own growable pool, for forward passes outside a
        worker's budget (tests, calibration, the health canary)."""
        if self._scratch is None:
            self._scratch = self.new_pool(0, SCRATCH_BLOCK_TOKENS, growable=True)
        return self._scratch.new_cache(capacity_tokens)

    @torch.inference_mode()
    def prefill(
        self, token_ids: Sequence[int], cache: KvCache | None = None
    ) -> tuple[KvCache, torch.Tensor]:
        """KV of every prompt position and the logits of the last one.

        `cache`, when given, must be empty; it may have blocks reserved beyond the
        prompt (HYBRID receives the rest of the sequence into the same blocks).
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
        return self.forward_batch([(cache, token_ids)])[0]

    def check_extend(self, cached_tokens: int, token_ids: Sequence[int]) -> None:
        """Refuse `token_ids` appended after `cached_tokens` positions: empty, out of the
        vocabulary or past the model's positions (InvalidArgument("token_ids"))."""
        if len(token_ids) == 0:
            raise InvalidArgument("token_ids", "must not be empty")
        validate_token_ids(token_ids, "token_ids", self.config.vocab_size)
        end = cached_tokens + len(token_ids)
        if end > self.config.max_positions:
            raise InvalidArgument(
                "token_ids",
                f"sequence of {end} tokens exceeds the model's "
                f"{self.config.max_positions} positions",
            )

    @torch.inference_mode()
    def forward_batch(self, work: Sequence[tuple[KvCache, Sequence[int]]]) -> list[torch.Tensor]:
        """One forward pass over several sequences: each `(cache, token_ids)` appends the
        KV of its new tokens to its cache; the logits of each one's last new position.

        Every sequence's new tokens are packed into one `[tokens, hidden]` tensor, so each
        projection, MLP and norm runs once for the whole batch; attention runs per
        sequence (SDPA over that sequence's cached KV). A prefill, an extend and a decode
        step are all the same thing here: new tokens on top of a cache.
        """
        if not work:
            return []
        if len({id(cache) for cache, _ in work}) != len(work):
            raise InvalidArgument("work", "a sequence appears twice in one batch")
        for cache, token_ids in work:
            self.check_extend(cache.length, token_ids)
        spans = []
        for cache, token_ids in work:
            end = cache.length + len(token_ids)
            cache.reserve(end)
            spans.append(_Span(cache, cache.length, end))
        ids = torch.as_tensor(
            [token for _, token_ids in work for token in token_ids],
            dtype=torch.long,
            device=self.device,
        )
        if self.config.family == "opt":
            last = self._forward_opt(spans, ids)
        else:
            last = self._forward_llama(spans, ids)
        for span in spans:
            span.cache.commit(span.end)
        return list(F.linear(last, self.head))

    # -- forward ----------------------------------------------------------------------

    def _positions(self, spans: list[_Span]) -> torch.Tensor:
        return torch.cat([torch.arange(span.start, span.end, device=self.device) for span in spans])

    def _last_rows(self, spans: list[_Span]) -> torch.Tensor:
        """Row of each sequence's last new token in the packed batch."""
        ends = torch.tensor([span.end - span.start for span in spans], device=self.device)
        return torch.cumsum(ends, 0) - 1

    def _mask(self, start: int, end: int, window: int | None) -> torch.Tensor | None:
        """Which cached positions each new one attends to (None: all, one new position)."""
        if end - start == 1 and (window is None or end <= window):
            return None
        rows = torch.arange(start, end, device=self.device)[:, None]
        cols = torch.arange(end, device=self.device)[None, :]
        mask = cols <= rows
        if window is not None:
            mask &= cols > rows - window
        return mask

    def _plan(self, spans: list[_Span], window: int | None) -> _AttentionPlan:
        """How this pass attends, for layers of one attention window: sequences with
        several new positions (or a window cutting their view) attend one by one;
        decode steps that see their whole cache attend together, in one SDPA call per
        pool over their blocks' slots padded to the longest (on CPU the fixed cost of an
        SDPA call outweighs gathering a step's keys)."""
        plan = _AttentionPlan()
        steps: dict[int, list[tuple[int, _Span]]] = {}
        row = 0
        for span in spans:
            count = span.end - span.start
            mask = self._mask(span.start, span.end, window)
            if count == 1 and mask is None:
                steps.setdefault(id(span.cache.pool), []).append((row, span))
            else:
                plan.alone.append((slice(row, row + count), span, mask))
            row += count
        for group in steps.values():
            if len(group) == 1:
                row, span = group[0]
                plan.alone.append((slice(row, row + 1), span, None))
                continue
            pool = group[0][1].cache.pool
            longest = max(span.end for _, span in group)
            slots = torch.full((len(group), longest), pool.zero_slot, device=self.device)
            for i, (_, span) in enumerate(group):
                slots[i, : span.end] = span.cache.slots(0, span.end)
            lengths = torch.tensor([span.end for _, span in group], device=self.device)
            visible = torch.arange(longest, device=self.device)[None, :] < lengths[:, None]
            rows = torch.tensor([row for row, _ in group], device=self.device)
            plan.together.append(_Steps(pool, rows, slots, visible[:, None, None, :]))
        return plan

    def _attend(
        self,
        spans: list[_Span],
        plan: _AttentionPlan,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Store each sequence's new K/V in its blocks and attend over its whole KV."""
        gqa = self.config.kv_heads != self.config.heads
        row = 0
        for span in spans:
            count = span.end - span.start
            span.cache.write(index, span.start, k[row : row + count], v[row : row + count])
            row += count
        out = q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
        for rows, span, mask in plan.alone:
            if span.start == 0:  # nothing cached: the new KV is the whole KV
                keys, values = k[rows], v[rows]
            else:
                keys, values = span.cache.gather(index, span.end)
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[rows] = attended.transpose(0, 1).reshape(rows.stop - rows.start, -1)
        for steps in plan.together:
            attended = F.scaled_dot_product_attention(
                q[steps.rows][:, :, None, :],  # [steps, heads, 1, head_dim]
                steps.pool.flat_keys(index)[steps.slots].transpose(1, 2),
                steps.pool.flat_values(index)[steps.slots].transpose(1, 2),
                attn_mask=steps.visible,
                scale=scale,
                enable_gqa=gqa,
            )
            out[steps.rows] = attended.reshape(len(steps.rows), -1)
        return out

    def _forward_llama(self, spans: list[_Span], ids: torch.Tensor) -> torch.Tensor:
        a = self.config
        count = len(ids)
        positions = self._positions(spans).to(torch.float32)
        angles = positions[:, None] * self._inv_freq.to(self.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos = angles.cos().to(self.dtype)[:, None, :]
        sin = angles.sin().to(self.dtype)[:, None, :]
        plans: dict[int | None, _AttentionPlan] = {}
        hidden = self.embed[ids]
        for index, block in enumerate(self.blocks):
            window = a.sliding_windows[index] if a.sliding_windows else None
            if window not in plans:
                plans[window] = self._plan(spans, window)
            normed = _rms_norm(hidden, block.norm1, a.norm_eps)
            q = F.linear(normed, block.q, block.q_bias).view(count, a.heads, a.head_dim)
            k = F.linear(normed, block.k, block.k_bias).view(count, a.kv_heads, a.head_dim)
            v = F.linear(normed, block.v, block.v_bias).view(count, a.kv_heads, a.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            attended = self._attend(spans, plans[window], index, q, k, v)
            hidden = hidden + F.linear(attended, block.o, block.o_bias)
            normed = _rms_norm(hidden, block.norm2, a.norm_eps)
            assert block.gate is not None, "a gated MLP loads its gate"
            gate = self._act(F.linear(normed, block.gate, block.gate_bias))
            up = F.linear(normed, block.up, block.up_bias)
            hidden = hidden + F.linear(gate * up, block.down, block.down_bias)
        assert self.final_norm is not None, "a Llama checkpoint loads its final norm"
        return _rms_norm(hidden[self._last_rows(spans)], self.final_norm, a.norm_eps)

    def _forward_opt(self, spans: list[_Span], ids: torch.Tensor) -> torch.Tensor:
        a = self.config
        count = len(ids)
        width = (a.hidden,)
        hidden = self.embed[ids]
        if self.project_in is not None:
            hidden = F.linear(hidden, self.project_in)
        # OPT's learned positions are offset by two rows.
        hidden = hidden + self.positions[self._positions(spans) + 2]
        plan = self._plan(spans, None)
        for index, block in enumerate(self.blocks):
            residual = hidden
            if a.pre_norm:
                hidden = F.layer_norm(hidden, width, block.norm1, block.norm1_bias)
            # Scaled before attention, as OPT was trained (same value, its rounding).
            q = F.linear(hidden, block.q, block.q_bias) * a.head_dim**-0.5
            q = q.view(count, a.heads, a.head_dim)
            k = F.linear(hidden, block.k, block.k_bias).view(count, a.heads, a.head_dim)
            v = F.linear(hidden, block.v, block.v_bias).view(count, a.heads, a.head_dim)
            attended = self._attend(spans, plan, index, q, k, v, scale=1.0)
            hidden = residual + F.linear(attended, block.o, block.o_bias)
            if not a.pre_norm:
                hidden = F.layer_norm(hidden, width, block.norm1, block.norm1_bias)
            residual = hidden
            if a.pre_norm:
                hidden = F.layer_norm(hidden, width, block.norm2, block.norm2_bias)
            mlp = self._act(F.linear(hidden, block.up, block.up_bias))
            hidden = residual + F.linear(mlp, block.down, block.down_bias)
            if not a.pre_norm:
                hidden = F.layer_norm(hidden, width, block.norm2, block.norm2_bias)
        last = hidden[self._last_rows(spans)]
        if self.final_norm is not None:
            last = F.layer_norm(last, width, self.final_norm, self.final_norm_bias)
        if self.project_out is not None:
            last = F.linear(last, self.project_out)
        return last


@dataclass(frozen=True)
class _Span:
    """One sequence's new positions `[start, end)` in a batched pass."""

    cache: KvCache
    start: int
    end: int


@dataclass(frozen=True)
class _Steps:
    """Decode steps of one pool attended together: their rows in the batch, each one's
    slots padded with the pool's zero slot, and which of them it sees."""

    pool: KvPool
    rows: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor


@dataclass
class _AttentionPlan:
    """Which sequences of a pass attend alone (rows, span, mask) and which together."""

    alone: list[tuple[slice, _Span, torch.Tensor | None]] = field(default_factory=list)
    together: list[_Steps] = field(default_factory=list)
