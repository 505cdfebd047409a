"""`kvrs calibrate`: measure a worker model's prefill (and extend) time on this machine.

Runs the workers' own model code on the checkpoint they load (services.worker.model,
same dtype and threads as a worker) over a sweep of prompt lengths, fits
T_pf(L) = a + b·L + c·L², checks the fit's extend prediction T_ext(L0, g) against
measured extends, and writes the profile JSON (`kvrs.profile.ComputeProfile.save`)
that the scheduler, the cost oracle and the workers (WORKER_PROFILE_PATH) load.
The report goes to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvrs.errors import InvalidArgument, KvrsError
from kvrs.model import DEFAULT_MODEL
from kvrs.profile import ComputeProfile

DEFAULT_LENGTHS = "16,32,64,128,256,512,1024"


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


def _lengths(text: str, max_positions: int) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InvalidArgument(
            "lengths", f"must be comma-separated integers, got {text!r}"
        ) from None
    if not lengths or lengths[0] <= 0:
        raise InvalidArgument("lengths", "needs at least one length, every length > 0")
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
    }
