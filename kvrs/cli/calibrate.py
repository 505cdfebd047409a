"""`kvrs calibrate`: measure a worker model's prefill, extend and batched passes here.

Runs the workers' own model code on the checkpoint they load (services.worker.model,
same dtype and threads as a worker) over a sweep of prompt lengths, fits
T_pf(L) = a + b·L + c·L², checks the fit's extend prediction T_ext(L0, g) against
measured extends, then measures batched passes as the workers run them (continuous
batching): several prompts prefilled in one pass, and decode steps of 1 to 32 streams
over short and long contexts, and fits the batch cost
T = a + b·tokens + c·Σ new·(cached + new) + d·sequences + e·Σ cached
(`kvrs.profile.BatchCost`).
It writes the profile JSON (`kvrs.profile.ComputeProfile.save`) that the scheduler, the
cost oracle and the workers (WORKER_PROFILE_PATH) load. The report goes to stdout as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvrs.errors import InvalidArgument, KvrsError
from kvrs.model import DEFAULT_MODEL
from kvrs.profile import BatchCost, ComputeProfile

DEFAULT_LENGTHS = "16,32,64,128,256,512,1024"
DEFAULT_BATCH_SIZES = "1,2,4,8,16,32"
MAX_PREFILL_BATCH_TOKENS = 2048
"""Largest batch of prompts measured (batch size × length): a worker's default token
budget per pass (WORKER_MAX_BATCH_TOKENS), which also keeps calibration short."""


def register(parser: argparse.ArgumentParser) -> None:
    """Add the `kvrs calibrate` arguments."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"checkpoint directory, or an embedded checkpoint (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype",
        default="",
        help="float64, float32, bfloat16, float16 (default: the checkpoint's, as a worker)",
    )
    parser.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        help=f"comma-separated prompt lengths, tokens (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per length; the median is kept"
    )
    parser.add_argument(
        "--extend-new-tokens",
        type=int,
        default=16,
        help="tokens appended in each measured extend (g)",
    )
    parser.add_argument(
        "--batch-sizes",
        default=DEFAULT_BATCH_SIZES,
        help=f"comma-separated sequences per measured batched pass (default {DEFAULT_BATCH_SIZES})",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (as WORKER_TORCH_THREADS)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--output", required=True, help="where to write the profile JSON")


def run(args: argparse.Namespace) -> int:
    """Measure, fit, write the profile, print the report; exit 2 (naming the flag) on bad input."""
    try:
        report = calibrate(
            args.model,
            args.output,
            dtype=args.dtype,
            lengths=args.lengths,
            repeats=args.repeats,
            extend_new_tokens=args.extend_new_tokens,
            batch_sizes=args.batch_sizes,
            threads=args.threads,
            seed=args.seed,
        )
    except KvrsError as exc:
        flag = f"--{exc.field.replace('_', '-')}" if exc.field else ""
        print(f"kvrs calibrate: {flag + ': ' if flag else ''}{exc.message or exc}", file=sys.stderr)
        return 2
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _integers(text: str, field: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidArgument(field, f"must be comma-separated integers, got {text!r}") from None
    if not values or values[0] <= 0:
        raise InvalidArgument(field, "needs at least one value, every value > 0")
    return values


def _lengths(text: str, max_positions: int) -> list[int]:
    lengths = _integers(text, "lengths")
    if lengths[-1] > max_positions:
        raise InvalidArgument(
            "lengths", f"{lengths[-1]} exceeds the model's {max_positions} positions"
        )
    return lengths


def calibrate(
    model_name: str,
    output: str | Path,
    dtype: str = "",
    lengths: str = DEFAULT_LENGTHS,
    repeats: int = 3,
    extend_new_tokens: int = 16,
    batch_sizes: str = DEFAULT_BATCH_SIZES,
    threads: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """The measurements, the fit and the extend check; writes the profile to `output`.

    The arguments are the command's flags; `kvrs up --calibrate` and `kvrs demo` call it
    with the workers' model before they start the cluster.
    """
    import torch

    from services.worker.model import Transformer, resolve_dtype

    for field, value in (
        ("repeats", repeats),
        ("threads", threads),
        ("extend_new_tokens", extend_new_tokens),
    ):
        if value <= 0:
            raise InvalidArgument(field, f"must be > 0, got {value}")
    torch.set_num_threads(threads)
    model = Transformer.load(model_name, resolve_dtype(dtype) if dtype else None)
    config = model.config
    sweep = _lengths(lengths, config.max_positions)
    sizes = _integers(batch_sizes, "batch_sizes")
    dtype_name = str(model.dtype).removeprefix("torch.")
    generator = torch.Generator().manual_seed(seed)

    def prompt(tokens: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (tokens,), generator=generator).tolist()

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    model.prefill(prompt(min(sweep)))  # warm-up: first-call allocations and kernel choice
    table = []
    for tokens in sweep:
        samples = []
        for _ in range(repeats):
            tokens_in = prompt(tokens)
            samples.append(timed(lambda t=tokens_in: model.prefill(t)))
        table.append((tokens, statistics.median(samples)))
    profile = ComputeProfile.fit(model_name, table)
    batches = _measure_batches(model, sweep, sizes, repeats, prompt, timed)
    batch = BatchCost.fit((segments, seconds) for _, segments, seconds in batches)
    profile = dataclasses.replace(profile, batch=batch)
    profile.save(output)

    extend_check = []
    g = extend_new_tokens
    for cached in sorted({sweep[0], sweep[len(sweep) // 2]}):
        if cached + g > config.max_positions:
            continue
        samples = []
        for _ in range(repeats):
            cache, _ = model.prefill(prompt(cached))
            new = prompt(g)
            samples.append(timed(lambda c=cache, n=new: model.extend(c, n)))
        extend_check.append(
            {
                "cached_tokens": cached,
                "new_tokens": g,
                "measured_s": statistics.median(samples),
                "predicted_s": profile.extend_s(cached, g),
            }
        )
    return {
        "model": model_name,
        "dtype": dtype_name,
        "threads": threads,
        "output": str(output),
        "profile": profile.to_json(),
        "fit_vs_measured": [
            {"tokens": tokens, "measured_s": seconds, "fit_s": profile.fit_s(tokens)}
            for tokens, seconds in table
        ],
        "extend_check": extend_check,
        "batch_fit_vs_measured": [
            {
                "pass": kind,
                "sequences": len(segments),
                "cached_tokens": segments[0][0],
                "new_tokens": segments[0][1],
                "measured_s": seconds,
                "fit_s": batch.batch_s(segments),
                "one_at_a_time_s": profile.extend_s(*segments[0]) * len(segments),
            }
            for kind, segments, seconds in batches
        ],
    }


def _measure_batches(model, sweep: list[int], sizes: list[int], repeats: int, prompt, timed):
    """(kind, segments, median seconds) of batched passes: prompts prefilled together,
    and decode steps of several streams over a short, a middle and the longest context."""
    samples: list[tuple[str, list[tuple[int, int]], float]] = []
    lengths = [tokens for tokens in sweep if tokens <= 256] or sweep[:1]
    for tokens in lengths:
        for size in sizes:
            if size > 1 and size * tokens > MAX_PREFILL_BATCH_TOKENS:
                continue
            runs = []
            for _ in range(repeats):
                work = [(model.new_cache(), prompt(tokens)) for _ in range(size)]
                runs.append(timed(lambda w=work: model.forward_batch(w)))
            samples.append(("prefill", [(0, tokens)] * size, statistics.median(runs)))
    for context in sorted({sweep[0], sweep[len(sweep) // 2], sweep[-1]}):
        if context + 1 > model.config.max_positions:
            continue
        cache, _ = model.prefill(prompt(context))
        for size in sizes:
            caches = [_copy(model, cache) for _ in range(size)]
            runs = []
            for _ in range(repeats):
                runs.append(timed(lambda cs=caches: model.forward_batch([(c, [1]) for c in cs])))
                for c in caches:
                    c.truncate(context)
            samples.append(("decode", [(context, 1)] * size, statistics.median(runs)))
    return samples


def _copy(model, cache):
    """A cache holding the same KV as `cache`, with room for one more token."""
    copy = model.new_cache(cache.length + 1)
    copy.write_layers(0, cache.layers_kv())
    copy.commit(cache.length)
    return copy
