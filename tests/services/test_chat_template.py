"""A checkpoint's chat template turns a conversation into the ids `transformers`'
`apply_chat_template` gives, for the adapter and the endpoint picker alike."""

from __future__ import annotations

import json

import pytest

from kvrs.errors import InvalidArgument
from services.common import openai_chat as chat
from services.common.tokenizer import load_codec
from tests.checkpoints import CHATML_TEMPLATE, HEADERS_TEMPLATE, save_checkpoint
from tests.hf_reference import chat_ids

CONVERSATION = [
    {"role": "system", "content": "Be brief. "},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Which worker "},
            {"type": "text", "text": "decodes?"},
        ],
    },
    {"role": "assistant", "content": "decode-0"},
    {"role": "user", "content": "And after it dies?"},
]


@pytest.fixture(
    scope="module", params=[HEADERS_TEMPLATE, CHATML_TEMPLATE], ids=["headers", "chatml"]
)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "llama-chat"
    return save_checkpoint(path, "LlamaForCausalLM", chat_template=request.param)


def reference_ids(path, messages) -> list[int]:
    """`transformers`' ids, the text parts of a message joined as the adapter joins them."""
    texts = [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    return chat_ids(str(path), texts)


@pytest.mark.parametrize("turns", [1, 2, 4])
def test_a_conversation_becomes_the_ids_transformers_renders(checkpoint, turns):
    messages = CONVERSATION[-turns:]
    codec = load_codec(str(checkpoint))
    assert codec.chat_template is not None
    assert chat.prompt_ids(messages, codec) == reference_ids(checkpoint, messages)


def test_a_role_the_template_refuses_names_messages(tmp_path):
    path = save_checkpoint(tmp_path / "chatml", "LlamaForCausalLM", chat_template=CHATML_TEMPLATE)
    with pytest.raises(InvalidArgument) as refused:
        chat.prompt_ids([{"role": "developer", "content": "hi"}], load_codec(str(path)))
    assert refused.value.field == "messages"
    assert "Only system, user and assistant roles are supported" in str(refused.value)


def test_a_named_default_template_in_tokenizer_config_is_the_one_used(tmp_path):
    """Older checkpoints keep templates in tokenizer_config.json, special tokens as
    AddedToken objects."""
    path = save_checkpoint(tmp_path / "named", "LlamaForCausalLM")
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "unused"},
                    {"name": "default", "template": HEADERS_TEMPLATE},
                ],
            }
        )
    )
    codec = load_codec(str(path))
    messages = [{"role": "user", "content": " hi "}]
    text = "<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert chat.prompt_ids(messages, codec) == codec.encode(text, special_tokens=False)


def test_a_template_that_does_not_parse_is_refused_naming_the_model(tmp_path):
    path = save_checkpoint(tmp_path / "broken", "LlamaForCausalLM", chat_template="{% for %}")
    with pytest.raises(InvalidArgument) as refused:
        load_codec(str(path))
    assert refused.value.field == "model"
    assert "chat_template.jinja" in str(refused.value)


def test_without_a_template_the_fixed_one_is_used(tmp_path):
    path = save_checkpoint(tmp_path / "plain", "LlamaForCausalLM")
    codec = load_codec(str(path))
    assert codec.chat_template is None
    assert chat.prompt_ids(CONVERSATION, codec) == codec.encode(chat.render(CONVERSATION))
