"""A checkpoint's own chat template: the Jinja text that turns a conversation into the
prompt the model was trained on.

Hugging Face checkpoints ship it as `chat_template.jinja`, or as the `chat_template`
entry of `tokenizer_config.json` (a string, or a list of named templates of which
"default" is the one). It is rendered the way `transformers`' `apply_chat_template`
renders it: a sandboxed environment with `trim_blocks` and `lstrip_blocks`, loop
controls, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text;
the variables `messages`, `add_generation_prompt` and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...). The text it produces already holds whatever special
tokens the template writes, so it is encoded without the post-processor's.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvrs.errors import InvalidArgument

__all__ = ["ChatTemplate", "load_chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateRefused(Exception):
    """What the template itself raised through `raise_exception` (a role it does not
    accept, messages out of order)."""


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it may write."""

    special_tokens: Mapping[str, str]
    _compiled: jinja2.Template

    @classmethod
    def compile(cls, source: str, special_tokens: Mapping[str, str], where: str) -> ChatTemplate:
        try:
            compiled = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(
                "model", f"{where}: the chat template does not parse: {exc}"
            ) from None
        return cls(dict(special_tokens), compiled)

    def render(self, messages: Sequence[Mapping[str, str]], field: str = "messages") -> str:
        """The prompt text of `messages` (each a role and its text content), the reply
        opened; InvalidArgument naming `field` where the template refuses them."""
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except TemplateRefused as exc:
            raise InvalidArgument(field, f"the model's chat template refused them: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise InvalidArgument(
                field, f"the model's chat template failed on them: {exc}"
            ) from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_entry(entry: Any, where: str) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise InvalidArgument("model", f"{where}: chat_template is neither text nor a default entry")


def load_chat_template(path: str) -> ChatTemplate | None:
    """The chat template of the checkpoint directory `path`, or None when it has none."""
    config_file = os.path.join(path, TOKENIZER_CONFIG)
    config: dict[str, Any] = {}
    if os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as handle:
                config = json.load(handle)
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument(
                "model", f"checkpoint {path}: {TOKENIZER_CONFIG}: {exc}"
            ) from None
    template_file = os.path.join(path, TEMPLATE_FILE)
    source: str | None
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as handle:
            source, where = handle.read(), f"checkpoint {path}: {TEMPLATE_FILE}"
    else:
        where = f"checkpoint {path}: {TOKENIZER_CONFIG}"
        source = _template_entry(config.get("chat_template"), where)
    if source is None:
        return None
    special = {
        key: text
        for key in SPECIAL_TOKEN_KEYS
        if (text := _token_text(config.get(key))) is not None
    }
    return ChatTemplate.compile(source, special, where)
