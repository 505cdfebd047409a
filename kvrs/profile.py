"""Compute-time model of a worker: prefill T_pf(L), extend T_ext(L0, g), one decode step,
and one batched forward pass over several sequences.

A profile is a table measured on the real worker (tokens → prefill seconds) plus a
least-squares fit `a + b·L + c·L²` (a, b, c ≥ 0). Inside the table the time is
interpolated piecewise-linearly over a monotone envelope of the measurements, so noise
can never make a longer prompt look cheaper; beyond it the fitted quadratic continues
from the last measured point. Never a flat clamp: prompts in real traces reach 100k+
tokens, where attention's quadratic term dominates.

Workers batch (continuous batching): each forward pass computes the new tokens of
several sequences at once — prefills, extends and one decode token per running stream.
`ComputeProfile.batch_s` prices such a pass, `BatchCost`:

    T(batch) = a + b · Σ new_i + c · Σ new_i · (cached_i + new_i) + d · sequences
               + e · Σ cached_i

a fixed cost per pass (weights read once), a cost per new token (projections, MLP), a
cost per (new token × attended token) pair (attention), a cost per sequence in the
batch (its own attention call, bookkeeping) and a cost per cached token of every
sequence in it (reading its resident KV). The last is what a decode step over a long
context pays: one new token attends to thousands of cached ones, read from their blocks,
at a cost per token that a prefill's dense attention (c) does not show; with c alone a
step of 32 streams over 1,500 tokens each was priced 4× too cheap. Eight recomputes of
L tokens each sent to one prefill worker cost `batch_s([(0, L)] * 8)` when they fit one
pass (the worker's token budget), against `8 · prefill_s(L)` one at a time. `kvrs
calibrate` measures the five terms; a profile without them (older files, presets) prices
a batch with its single-pass fit and no per-sequence or per-cached-token term, which for
one sequence equals `fit_s`.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrs.errors import InvalidArgument
from kvrs.model import ModelSpec, checkpoint_dir, model_spec

__all__ = [
    "BatchCost",
    "DECODE_PRESETS",
    "PROFILE_PRESETS",
    "ComputeProfile",
    "DecodeProfile",
    "compute_profile",
    "decode_profile",
]


_BATCH_FIELDS = (
    "a_s",
    "b_s_per_token",
    "c_s_per_token2",
    "d_s_per_sequence",
    "e_s_per_cached_token",
)


@dataclass(frozen=True)
class BatchCost:
    """Seconds of one batched forward pass (see the module docstring for the terms)."""

    a_s: float = 0.0
    """Fixed cost of a pass."""
    b_s_per_token: float = 0.0
    """Per new token in the batch."""
    c_s_per_token2: float = 0.0
    """Per (new token × attended token): a prefill of L from scratch has L·L."""
    d_s_per_sequence: float = 0.0
    """Per sequence in the batch."""
    e_s_per_cached_token: float = 0.0
    """Per token already cached in a sequence of the batch (its KV read by the pass)."""

    def __post_init__(self) -> None:
        for field in _BATCH_FIELDS:
            if not getattr(self, field) >= 0.0:
                raise InvalidArgument(
                    f"batch.{field}", f"must be >= 0, got {getattr(self, field)!r}"
                )

    def batch_s(self, segments: Iterable[tuple[int, int]]) -> float:
        """Seconds of one pass computing, per sequence, `new` tokens on top of `cached`
        resident ones (`segments` of (cached_tokens, new_tokens)); 0 for an empty batch."""
        tokens = pairs = sequences = resident = 0
        for cached, new in segments:
            if cached < 0:
                raise InvalidArgument("cached_tokens", f"must be >= 0, got {cached}")
            if new <= 0:
                raise InvalidArgument("new_tokens", f"must be > 0, got {new}")
            tokens += new
            pairs += new * (cached + new)
            sequences += 1
            resident += cached
        if not sequences:
            return 0.0
        return (
            self.a_s
            + self.b_s_per_token * tokens
            + self.c_s_per_token2 * pairs
            + self.d_s_per_sequence * sequences
            + self.e_s_per_cached_token * resident
        )

    def to_json(self) -> dict[str, float]:
        return {field: getattr(self, field) for field in _BATCH_FIELDS}

    @classmethod
    def from_json(cls, d: Any) -> BatchCost:
        if not isinstance(d, Mapping):
            raise InvalidArgument("batch", "must be a JSON object")
        values: dict[str, float] = {}
        for field in _BATCH_FIELDS:
            try:
                values[field] = float(d.get(field, 0.0))
            except (TypeError, ValueError):
                raise InvalidArgument(f"batch.{field}", "must be a number") from None
        return cls(**values)

    @classmethod
    def fit(cls, samples: Iterable[tuple[Sequence[tuple[int, int]], float]]) -> BatchCost:
        """Non-negative least squares over measured passes: (segments, seconds) each,
        minimising the relative error like `ComputeProfile.fit`."""
        import numpy as np

        rows, seconds = [], []
        for segments, measured in samples:
            if not measured > 0:
                raise InvalidArgument("samples", "needs seconds > 0 in every sample")
            segments = list(segments)
            rows.append(
                [
                    1.0,
                    sum(new for _, new in segments),
                    sum(new * (cached + new) for cached, new in segments),
                    len(segments),
                    sum(cached for cached, _ in segments),
                ]
            )
            seconds.append(measured)
        if not rows:
            raise InvalidArgument("samples", "needs at least one measured pass")
        design, y = np.array(rows, dtype=float), np.array(seconds, dtype=float)
        return cls(*_nonnegative_fit(design, y))


def _nonnegative_fit(design: Any, seconds: Any) -> list[float]:
    """Coefficients >= 0 minimising Σ ((design · x − s) / s)²: every subset of the
    columns is solved by least squares, the best non-negative one kept (exact for the
    three to five terms a profile has)."""
    import numpy as np

    scale = np.maximum(np.abs(design).max(axis=0), 1e-300)
    weight = 1.0 / seconds
    wd, wy = design / scale * weight[:, None], seconds * weight
    columns = design.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(wy**2))
    for size in range(1, columns + 1):
        for cols in itertools.combinations(range(columns), size):
            coef, *_ = np.linalg.lstsq(wd[:, cols], wy, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((wd[:, cols] @ coef - wy) ** 2))
            if residual < best_residual:
                best = np.zeros(columns)
                best[list(cols)] = coef
                best_residual = residual
    return [float(v) for v in best / scale]


@dataclass(frozen=True)
class ComputeProfile:
    """Prefill, extend and batched-pass time of one model on one kind of hardware."""

    model: str
    table: tuple[tuple[int, float], ...] = ()
    """Measured (tokens, prefill seconds), tokens strictly increasing."""
    a_s: float = 0.0
    """Fixed cost of a forward pass (launch, weights read once)."""
    b_s_per_token: float = 0.0
    """Per-token cost (MLP and projections)."""
    c_s_per_token2: float = 0.0
    """Per-token-pair cost (attention)."""
    batch: BatchCost | None = None
    """Measured cost of a batched pass; None: priced by the single-pass fit."""

    def __post_init__(self) -> None:
        table = tuple((int(tokens), float(seconds)) for tokens, seconds in self.table)
        for i, (tokens, seconds) in enumerate(table):
            if tokens <= 0 or seconds < 0.0:
                raise InvalidArgument(f"table[{i}]", "needs tokens > 0 and seconds >= 0")
            if i and tokens <= table[i - 1][0]:
                raise InvalidArgument(f"table[{i}]", "tokens must be strictly increasing")
        for field in ("a_s", "b_s_per_token", "c_s_per_token2"):
            if not getattr(self, field) >= 0.0:
                raise InvalidArgument(field, f"must be >= 0, got {getattr(self, field)!r}")
        object.__setattr__(self, "table", table)
        # The monotone envelope used for interpolation (the measured table stays as is).
        object.__setattr__(self, "_xs", [tokens for tokens, _ in table])
        object.__setattr__(
            self, "_ys", list(itertools.accumulate((seconds for _, seconds in table), max))
        )

    def fit_s(self, tokens: float) -> float:
        """The fitted quadratic alone, a + b·L + c·L² (no table)."""
        return self.a_s + tokens * (self.b_s_per_token + tokens * self.c_s_per_token2)

    def prefill_s(self, tokens: int) -> float:
        """T_pf(L): seconds to prefill `tokens` tokens from scratch; 0 for 0 tokens."""
        if tokens <= 0:
            if tokens < 0:
                raise InvalidArgument("tokens", f"must be >= 0, got {tokens}")
            return 0.0
        xs: list[int] = self._xs  # type: ignore[attr-defined]
        if not xs:
            return self.a_s + tokens * (self.b_s_per_token + tokens * self.c_s_per_token2)
        ys: list[float] = self._ys  # type: ignore[attr-defined]
        if tokens >= xs[-1]:
            return ys[-1] + self.fit_s(tokens) - self.fit_s(xs[-1])
        if tokens <= xs[0]:
            # Shrink towards (0, 0) along the fit's shape: monotone and never negative.
            first_fit = self.fit_s(xs[0])
            if first_fit > 0.0:
                return ys[0] * self.fit_s(tokens) / first_fit
            return ys[0] * tokens / xs[0]
        i = bisect.bisect_right(xs, tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def extend_s(self, cached_tokens: int, new_tokens: int) -> float:
        """T_ext(L0, g): KV for `new_tokens` computed on top of `cached_tokens` cached ones.

        The work is the prefill of L0 + g minus the prefill of L0 that is already done,
        plus the fixed cost of the extra forward pass; `extend_s(0, L) == prefill_s(L)`.
        """
        if cached_tokens < 0:
            raise InvalidArgument("cached_tokens", f"must be >= 0, got {cached_tokens}")
        if new_tokens <= 0:
            if new_tokens < 0:
                raise InvalidArgument("new_tokens", f"must be >= 0, got {new_tokens}")
            return 0.0
        if cached_tokens == 0:
            return self.prefill_s(new_tokens)
        return self.prefill_s(cached_tokens + new_tokens) - self.prefill_s(cached_tokens) + self.a_s

    def scaled(self, factor: float) -> ComputeProfile:
        """This profile with every time `factor` times as long: the same model on
        hardware (or under a load) that runs it `factor` times slower."""
        if not factor > 0.0:
            raise InvalidArgument("factor", f"must be > 0, got {factor!r}")
        if factor == 1.0:
            return self
        batch = self.batch
        return ComputeProfile(
            model=self.model,
            table=tuple((tokens, seconds * factor) for tokens, seconds in self.table),
            a_s=self.a_s * factor,
            b_s_per_token=self.b_s_per_token * factor,
            c_s_per_token2=self.c_s_per_token2 * factor,
            batch=None
            if batch is None
            else BatchCost(**{field: getattr(batch, field) * factor for field in _BATCH_FIELDS}),
        )

    def batch_cost(self) -> BatchCost:
        """The cost of a batched pass: measured, else the single-pass fit (no d term)."""
        if self.batch is not None:
            return self.batch
        return BatchCost(self.a_s, self.b_s_per_token, self.c_s_per_token2, 0.0)

    def batch_s(self, segments: Iterable[tuple[int, int]]) -> float:
        """Seconds of one batched forward pass over `segments` of (cached_tokens,
        new_tokens), one per sequence: what a worker running them together spends."""
        return self.batch_cost().batch_s(segments)

    def pass_s(self, segments: Sequence[tuple[int, int]]) -> float:
        """A worker's forward pass over `segments`: the batch cost, but never less than
        its longest piece takes alone. The batch cost is fitted over many passes, most of
        them small; a pass of one long prompt or extend is priced better by the measured
        table (`extend_s`), which the fit undershoots by about 2× at 1,000 tokens on a
        CPU worker."""
        if not segments:
            return 0.0
        # One lookup, not one per piece: workers price every queued pass at each submit.
        cached, new = max(segments, key=lambda segment: (segment[1], segment[0]))
        return max(self.batch_s(segments), self.extend_s(cached, new))

    @classmethod
    def fit(cls, model: str, table: Iterable[tuple[int, float]]) -> ComputeProfile:
        """Fit a, b, c ≥ 0 to a measured table, minimising the *relative* squared error.

        Relative, because a table spans 16 to 16k tokens and an absolute fit would ignore
        the short prompts that dominate real traffic. The non-negativity constraint is
        solved exactly by trying every subset of the three terms (2³ − 1 least squares).
        """
        import numpy as np  # only fitting needs it; `kvrs cost` starts faster without

        rows = tuple((int(tokens), float(seconds)) for tokens, seconds in table)
        if not rows:
            raise InvalidArgument("table", "needs at least one (tokens, seconds) row")
        tokens = np.array([r[0] for r in rows], dtype=float)
        seconds = np.array([r[1] for r in rows], dtype=float)
        if np.any(tokens <= 0) or np.any(seconds <= 0):
            raise InvalidArgument("table", "needs tokens > 0 and seconds > 0 in every row")
        design = np.stack([np.ones_like(tokens), tokens, tokens**2], axis=1)
        a_s, b_s, c_s = _nonnegative_fit(design, seconds)
        return cls(model=model, table=rows, a_s=a_s, b_s_per_token=b_s, c_s_per_token2=c_s)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_json(to_json())` gives an equal profile."""
        data: dict[str, Any] = {
            "model": self.model,
            "table": [[tokens, seconds] for tokens, seconds in self.table],
            "a_s": self.a_s,
            "b_s_per_token": self.b_s_per_token,
            "c_s_per_token2": self.c_s_per_token2,
        }
        if self.batch is not None:
            data["batch"] = self.batch.to_json()
        return data

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ComputeProfile:
        """Parse `to_json`'s dict; missing or mistyped keys raise InvalidArgument naming them.
        A profile written before batches were measured (no "batch") loads as one priced
        by its single-pass fit."""
        if not isinstance(d, Mapping):
            raise InvalidArgument("profile", "must be a JSON object")
        try:
            model = d["model"]
        except KeyError:
            raise InvalidArgument("model", "missing") from None
        if not isinstance(model, str) or not model:
            raise InvalidArgument("model", "must be a non-empty string")
        values: dict[str, float] = {}
        for field in ("a_s", "b_s_per_token", "c_s_per_token2"):
            try:
                values[field] = float(d.get(field, 0.0))
            except (TypeError, ValueError):
                raise InvalidArgument(field, "must be a number") from None
        table = d.get("table", [])
        try:
            rows = tuple((int(tokens), float(seconds)) for tokens, seconds in table)
        except (TypeError, ValueError):
            raise InvalidArgument("table", "must be a list of [tokens, seconds] pairs") from None
        batch = BatchCost.from_json(d["batch"]) if d.get("batch") is not None else None
        return cls(model=model, table=rows, batch=batch, **values)

    @classmethod
    def load(cls, path: str | Path) -> ComputeProfile:
        """Read a profile saved by `save` (JSON)."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise InvalidArgument("profile", f"{path}: not JSON ({exc})") from None
        return cls.from_json(data)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (what `kvrs calibrate` produces)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


@dataclass(frozen=True)
class DecodeProfile:
    """One decode step for a running batch: a + b · (context tokens of the batch) + c · batch."""

    a_s: float
    b_s_per_context_token: float
    c_s_per_request: float

    def step_s(self, batch: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch` requests holding `context_tokens` in all."""
        if batch < 0:
            raise InvalidArgument("batch", f"must be >= 0, got {batch}")
        if context_tokens < 0:
            raise InvalidArgument("context_tokens", f"must be >= 0, got {context_tokens}")
        return self.a_s + self.b_s_per_context_token * context_tokens + self.c_s_per_request * batch


# Where each preset comes from (docs/simulator.md lists them with the experiments):
# - opt-13b: DistServe's fitted OPT-13B latency model on one A100 (published).
# - llama3-70b: assumed; a FLOP-count estimate for a 70B model on four H100s at 50 % MFU
#   (about 0.97 s for 12k tokens), not a measurement nor a published fit.
# - llama3-8b: assumed; the same kind of estimate for one GPU.
# - opt-125m, tiny: assumed rough CPU figures; `kvrs calibrate` measures the real worker.
PROFILE_PRESETS: dict[str, ComputeProfile] = {
    profile.model: profile
    for profile in (
        ComputeProfile("opt-13b", a_s=16.46e-3, b_s_per_token=0.0926e-3, c_s_per_token2=6.47e-9),
        ComputeProfile("llama3-70b", a_s=20e-3, b_s_per_token=0.0708e-3, c_s_per_token2=6.63e-10),
        ComputeProfile("llama3-8b", a_s=8e-3, b_s_per_token=0.0205e-3, c_s_per_token2=1.6e-10),
        ComputeProfile("opt-125m", a_s=10e-3, b_s_per_token=0.195e-3, c_s_per_token2=2.5e-8),
        ComputeProfile("tiny", a_s=1e-3, b_s_per_token=2e-6, c_s_per_token2=1e-10),
    )
}

# - opt-13b: DistServe's published OPT-13B step, 20.3 ms at batch 1 with 512 tokens of
#   context; how it splits into a, b and c is assumed.
# - llama3-70b, llama3-8b: assumed (HBM-bandwidth estimates).
# - opt-125m, tiny: assumed rough CPU figures.
DECODE_PRESETS: dict[str, DecodeProfile] = {
    "opt-13b": DecodeProfile(a_s=17.2e-3, b_s_per_context_token=5.0e-6, c_s_per_request=0.54e-3),
    "llama3-70b": DecodeProfile(a_s=30e-3, b_s_per_context_token=2.0e-6, c_s_per_request=0.3e-3),
    "llama3-8b": DecodeProfile(a_s=8e-3, b_s_per_context_token=0.8e-6, c_s_per_request=0.1e-3),
    "opt-125m": DecodeProfile(a_s=20e-3, b_s_per_context_token=2e-6, c_s_per_request=1e-3),
    "tiny": DecodeProfile(a_s=1e-3, b_s_per_context_token=1e-7, c_s_per_request=1e-4),
}


CPU_FLOPS = 20e9
"""Sustained FLOP/s assumed for a checkpoint nobody calibrated (one CPU core's order)."""


def estimated_profile(spec: ModelSpec) -> ComputeProfile:
    """A rough profile of a checkpoint from its shape alone: 2 FLOPs per parameter per
    token, and attention's 4 · layers · heads · head_dim FLOPs per token pair. Only a
    stand-in until `kvrs calibrate` measures the model on its hardware."""
    per_pair = 4 * spec.layers * spec.kv_heads * spec.head_dim
    return ComputeProfile(
        spec.name,
        a_s=1e-3,
        b_s_per_token=2 * spec.params / CPU_FLOPS,
        c_s_per_token2=per_pair / CPU_FLOPS,
    )


def compute_profile(model: str) -> ComputeProfile:
    """The preset compute profile of `model`, estimated from the shape of a checkpoint
    directory without one; InvalidArgument("model") when there is neither."""
    try:
        return PROFILE_PRESETS[model]
    except KeyError:
        pass
    if checkpoint_dir(model) is not None:
        return estimated_profile(model_spec(model))
    known = ", ".join(sorted(PROFILE_PRESETS))
    raise InvalidArgument(
        "model", f"no compute profile for {model!r} (known: {known}; or a checkpoint directory)"
    )


def decode_profile(model: str) -> DecodeProfile:
    """The preset decode-step profile of `model`; InvalidArgument("model") when there is none."""
    try:
        return DECODE_PRESETS[model]
    except KeyError:
        known = ", ".join(sorted(DECODE_PRESETS))
        raise InvalidArgument(
            "model", f"no decode profile for {model!r} (known: {known})"
        ) from None
