"""Small random Hugging Face checkpoints for tests, written by `transformers` itself.

Each is what `save_pretrained` writes (config.json, model.safetensors) plus a BPE
tokenizer trained with `tokenizers` on a few sentences and saved as tokenizer.json, so
the workers load them exactly as they would load a downloaded model.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "kvrs moves KV caches across the datacenter network.",
    "Disaggregated inference splits prefill and decode across machines.",
    "A decode worker that dies hands its requests to another one.",
    "Recompute the prefix, migrate the rest, or do both at once.",
] * 8

HEADERS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
"""Shaped like Llama 3's: the BOS written by the template, headers, trimmed contents."""
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported') }}{% endif %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Shaped like Qwen2's: no BOS, a default system turn, unknown roles refused."""
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 2048}


def train_tokenizer(vocab_size: int, bos: bool = True):
    """A byte-level BPE trained on CORPUS, with <s> and </s> (ids 0 and 1); a BOS is
    prepended by its post-processor when `bos`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    return tokenizer


def save_checkpoint(
    path: Path,
    architecture: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    chat_template: str | None = None,
    **config,
) -> Path:
    """A random `architecture` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
    OPTForCausalLM) saved under `path` with a trained tokenizer; `config` overrides.
    With `chat_template`, the tokenizer is saved by `transformers` with that template
    and its <s> / </s> as BOS and EOS."""
    import transformers

    tokenizer = train_tokenizer(config.pop("vocab_size", 320))
    vocab_size = tokenizer.get_vocab_size()
    family = architecture.removesuffix("ForCausalLM")
    config_class = getattr(transformers, f"{family}Config")
    settings = {**TINY, "vocab_size": vocab_size, "bos_token_id": 0, "eos_token_id": 1}
    if family == "OPT":
        settings |= {"ffn_dim": 128, "num_attention_heads": 4, "pad_token_id": 1}
        settings["eos_token_id"] = 1
        settings["bos_token_id"] = 0
    else:
        settings |= {"intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_class(**(settings | config)))
    with torch.no_grad():
        # Wider than the library's 0.02 init, so greedy decoding does not collapse
        # onto one token and a wrong step shows.
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, parameter.shape[1] ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                parameter.normal_(1.0, 0.1)
            else:
                parameter.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    if chat_template is None:
        tokenizer.save(str(path / "tokenizer.json"))
    else:
        save_chat_tokenizer(path, tokenizer, chat_template)
    return path


def save_chat_tokenizer(path: Path, tokenizer, chat_template: str) -> None:
    """`tokenizer` written by `transformers`' own `save_pretrained`, with a chat template."""
    import transformers

    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>"
    )
    wrapped.chat_template = chat_template
    wrapped.save_pretrained(path)
