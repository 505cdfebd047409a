"""An OPT-125m-shaped checkpoint with random weights for the benches that run real workers.

Written once by `transformers` (bf16, as deployed) under the kvrs cache directory with
the byte-level tokenizer: the benches measure compute and transfer sizes, which depend
on the shape alone, so the weights need not be trained.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def opt_125m() -> str:
    """The checkpoint directory (created on first call)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from services.common.tokenizer import byte_level_tokenizer

    root = Path(os.environ.get("KVRS_CACHE_DIR") or Path.home() / ".cache" / "kvrs")
    path = root / "bench" / "opt-125m-random"
    if not (path / "tokenizer.json").is_file():
        torch.manual_seed(0)
        model = OPTForCausalLM(OPTConfig(dtype="bfloat16")).to(torch.bfloat16)
        model.save_pretrained(path)
        byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return str(path)
