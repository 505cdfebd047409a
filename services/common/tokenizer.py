"""Text ↔ token ids with a checkpoint's own tokenizer (`tokenizer.json`, `tokenizers`).

The front doors (the OpenAI adapter, the endpoint picker) and the workers must cut text
into the same ids, so every one of them loads the tokenizer of the model they serve:

    codec = load_codec("/models/llama")      # its tokenizer.json
    ids = codec.encode("hello")               # what a Hugging Face pipeline would feed
    stream = codec.stream()                   # text as tokens arrive, never half a character
    "".join(stream.push(t) for t in ids) + stream.flush() == codec.decode(ids)

A model without a checkpoint (a cost-model preset) and the embedded default use the
byte-level vocabulary of `kvrs.tokenizer` (ids 0-255 are bytes, then <bos>, <eos>),
built here as a real `tokenizers` BPE so the embedded checkpoint ships it as its
tokenizer.json and loads it through the same path as any other.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvrs.errors import InvalidArgument
from kvrs.model import checkpoint_dir, read_checkpoint_config
from kvrs.tokenizer import BYTE_TOKENS, SPECIAL_TOKENS, validate_token_ids
from services.common.chat_template import ChatTemplate, load_chat_template

__all__ = ["TextCodec", "TokenStream", "byte_level_codec", "byte_level_tokenizer", "load_codec"]


def _byte_chars() -> list[str]:
    """The printable character standing for each byte in byte-level BPE vocabularies:
    printable Latin-1 bytes stand for themselves, the others for code points from 256 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {}
    extra = 0
    for byte in range(BYTE_TOKENS):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(BYTE_TOKENS + extra)
            extra += 1
    return [chars[byte] for byte in range(BYTE_TOKENS)]


def byte_level_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (id = byte value), then the special tokens of
    `kvrs.tokenizer` — the same ids as `kvrs.tokenizer.encode`, built deterministically."""
    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__))
    return tokenizer


@dataclass
class TokenStream:
    """Text of a token stream, one token at a time (see the module docstring).

    Each push decodes the tokens since the last clean cut, so a piece never ends inside
    a character that later tokens complete.
    """

    codec: TextCodec
    _ids: list[int] = field(default_factory=list)
    _emitted: str = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self.codec.decode(self._ids)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        piece, self._emitted = text[len(self._emitted) :], text
        if len(self._ids) > 8 and not piece.endswith("\ufffd"):
            # Cut: later tokens decode on their own from here (bounded work per token).
            self._ids, self._emitted = self._ids[-4:], self.codec.decode(self._ids[-4:])
        return piece

    def flush(self) -> str:
        text = self.codec.decode(self._ids)
        piece = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._ids, self._emitted = [], ""
        return piece


@dataclass(frozen=True)
class TextCodec:
    """A model's tokenizer and the ids that end its generations."""

    name: str
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None
    """The checkpoint's own; None: chat prompts use the adapter's fixed template."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """The ids a Hugging Face pipeline feeds for `text`: with the special tokens the
        tokenizer's post-processor adds (such as a BOS) unless `special_tokens` is False
        (text a chat template rendered, which writes its own)."""
        return self.tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, token_ids: Iterable[int]) -> str:
        """The text of `token_ids`, special tokens dropped."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self) -> TokenStream:
        return TokenStream(self)

    def validate(self, token_ids: Sequence[int], field: str) -> None:
        """InvalidArgument naming `field` unless every id is in the vocabulary."""
        validate_token_ids(token_ids, field, self.vocab_size)


def _eos_ids(config: dict) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


@functools.cache
def byte_level_codec() -> TextCodec:
    """The byte-level vocabulary's codec (shared: a tokenizer is immutable once built)."""
    return TextCodec("bytes", byte_level_tokenizer(), (SPECIAL_TOKENS["<eos>"],))


def load_codec(model: str) -> TextCodec:
    """The tokenizer of `model`: a checkpoint directory's tokenizer.json (with the EOS ids
    of its generation_config.json or config.json, and its chat template), else the
    byte-level vocabulary.

    InvalidArgument("model") names the missing or unreadable file.
    """
    path = checkpoint_dir(model)
    if path is None:
        return byte_level_codec()
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise InvalidArgument("model", f"checkpoint {path}: missing file tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as exc:  # noqa: BLE001 - the Rust library raises bare Exceptions
        raise InvalidArgument("model", f"checkpoint {path}: tokenizer.json: {exc}") from None
    config = read_checkpoint_config(path)
    generation = os.path.join(path, "generation_config.json")
    eos = _eos_ids(config)
    if os.path.isfile(generation):
        with open(generation, encoding="utf-8") as handle:
            eos = _eos_ids(json.load(handle)) or eos
    return TextCodec(model, tokenizer, eos, load_chat_template(path))
