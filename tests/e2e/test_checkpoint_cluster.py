"""`kvrs up --model DIR --block-tokens 64` on a checkpoint written by `transformers`:
the OpenAI adapter's greedy completion is what `transformers` generates from the same
directory, token for token, after a prefill, a KV transfer and a decode on different
worker processes, which allocate KV in blocks of 64; a chat completion starts from the
prompt the checkpoint's own chat template renders.

The checkpoint is a Llama with its own grouped-query layout, RoPE base and BPE
tokenizer, none of them the embedded default's, so nothing but the loader connects the
cluster to the files.
"""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from kvrs.cli.launcher import ClusterState
from kvrs.v1 import worker_pb2, worker_pb2_grpc
from services.common.tokenizer import load_codec
from tests.checkpoints import HEADERS_TEMPLATE, save_checkpoint
from tests.e2e.test_local_cluster import force_down, kvrs
from tests.hf_reference import chat_ids, greedy

PROMPT = "A decode worker that dies hands its requests to another one."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama-gqa-test"
    return save_checkpoint(
        path,
        "LlamaForCausalLM",
        dtype=torch.float32,
        seed=7,
        chat_template=HEADERS_TEMPLATE,
        vocab_size=400,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_theta=250000.0,
        max_position_embeddings=1024,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_openai_adapter_completes_as_transformers_generates(
    checkpoint, tmp_path, redis_url, redis_prefix
):
    run_dir = tmp_path / "cluster"
    env = {"REDIS_URL": redis_url, "KVRS_REDIS_PREFIX": redis_prefix}
    try:
        up = kvrs(
            "up",
            "--dir",
            str(run_dir),
            "--model",
            str(checkpoint),
            "--block-tokens",
            "64",
            env=env,
            timeout_s=180,
        )
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
        state = ClusterState.load(run_dir)
        for worker in ("prefill-0", "decode-0"):
            with grpc.insecure_channel(state.address(worker)) as channel:
                stats = worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                    worker_pb2.GetWorkerStatsRequest(), timeout=10
                )
            assert stats.block_tokens == 64, f"{worker} allocates blocks of {stats.block_tokens}"
        client = openai.OpenAI(
            base_url=f"http://{state.address('openai-http')}/v1",
            api_key="unused",
            max_retries=0,
            timeout=60,
        )
        assert [m.id for m in client.models.list()] == ["llama-gqa-test"]
        codec = load_codec(str(checkpoint))
        prompt_ids = codec.encode(PROMPT)
        assert prompt_ids[0] == 0, "the tokenizer's post-processor adds its BOS"
        expected = greedy(str(checkpoint), prompt_ids, 40, stop_at_eos=True)
        completion = client.completions.create(
            model="llama-gqa-test", prompt=PROMPT, max_tokens=40, temperature=0
        )
        (choice,) = completion.choices
        assert choice.text == codec.decode(expected)
        assert completion.usage.prompt_tokens == len(prompt_ids)
        # The checkpoint's path names the same model; token-id prompts skip the tokenizer.
        by_ids = client.completions.create(
            model=str(checkpoint), prompt=prompt_ids, max_tokens=40, temperature=0
        )
        assert by_ids.choices[0].text == choice.text
        stream = client.completions.create(
            model="llama-gqa-test", prompt=PROMPT, max_tokens=40, temperature=0, stream=True
        )
        assert "".join(c.text for chunk in stream for c in chunk.choices) == choice.text
        messages = [{"role": "user", "content": PROMPT}]
        chat_prompt = chat_ids(str(checkpoint), messages)
        reply = client.chat.completions.create(
            model="llama-gqa-test", messages=messages, max_tokens=24, temperature=0
        )
        assert reply.usage.prompt_tokens == len(chat_prompt)
        expected_reply = greedy(str(checkpoint), chat_prompt, 24, stop_at_eos=True)
        assert reply.choices[0].message.content == codec.decode(expected_reply)
    finally:
        kvrs("down", "--dir", str(run_dir), timeout_s=60)
        force_down(run_dir)


def test_up_refuses_a_directory_that_is_no_supported_checkpoint(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    up = kvrs("up", "--dir", str(tmp_path / "run"), "--model", str(tmp_path / "gpt2"))
    assert up.returncode == 1
    assert "GPT2LMHeadModel" in up.stderr
