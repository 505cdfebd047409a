"""The real `openai` client against a local kvrs cluster through `python -m services.openai_http`.

Every process is real: the cluster of tests/e2e/conftest.py (control plane, router, torch
workers on the tiny float64 model) and the HTTP adapter in front of its router. Decoding
is greedy and bit-exact, so every completion is checked against the model run in this
process: a stream that survived the death of its decode instance must still be exactly
the undisturbed text. The kill test leaves its victim dead; the cluster's users restart
what they need (`ensure_running`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from kvrs import tokenizer
from kvrs.cli.launcher import free_ports, is_running, log_tail
from kvrs.v1 import worker_pb2, worker_pb2_grpc
from services.common import GrpcSettings, open_channel
from services.common import openai_chat as chat
from tests.tiny_reference import reference

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "kvrs moves KV caches across the datacenter network. "
DECODE_INSTANCES = ("decode-0", "decode-1")

pytestmark = pytest.mark.timeout(180)


def reference_text(prompt: str, max_tokens: int) -> str:
    """The undisturbed greedy completion, computed here with the workers' model."""
    return tokenizer.decode(reference(tuple(tokenizer.encode(prompt)), max_tokens))


@pytest.fixture(scope="module")
def client(recovery_cluster, tmp_path_factory):
    """The HTTP adapter as its own process, and an `openai` client pointed at it."""
    (port,) = free_ports(1)
    log_file = tmp_path_factory.mktemp("openai-http") / "openai_http.log"
    env = {
        **os.environ,
        "OPENAI_HTTP_LISTEN_ADDR": f"127.0.0.1:{port}",
        "ROUTER_ADDR": recovery_cluster.address("router"),
        "KVRS_MODEL": "tiny",
        "OPENAI_HTTP_REQUEST_TIMEOUT_S": "60",
    }
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.openai_http"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"adapter exited:\n{log_tail(log_file)}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"adapter not up:\n{log_tail(log_file)}"
                time.sleep(0.1)
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=90
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == ["tiny"]


def test_completion_without_streaming(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24)
    (choice,) = completion.choices
    assert choice.text == reference_text(PROMPT, 24)
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(PROMPT.encode())
    assert completion.usage.completion_tokens == 24
    assert completion.id.startswith("cmpl-")


def test_streamed_text_equals_the_non_streamed_text(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48)
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.text for chunk in chunks for c in chunk.choices)
    assert text == whole.choices[0].text == reference_text(PROMPT, 48)
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == 48


def test_a_chat_completion_streamed_or_not_is_the_rendered_conversation_continued(client):
    messages = [
        {"role": "system", "content": "Answer in bytes."},
        {"role": "user", "content": "Where does the KV cache go?"},
    ]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=32
    )
    (choice,) = whole.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == reference_text(chat.render(messages), 32)
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 32
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=32, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == choice.message.content


def test_bad_parameters_raise_the_clients_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=2.5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT)


async def _busy_decode_instance(cluster, timeout_s: float) -> str:
    """The decode worker running a Decode stream right now (asked of the workers)."""
    settings = GrpcSettings()
    channels = {name: open_channel(cluster.address(name), settings) for name in DECODE_INSTANCES}
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, channel in channels.items():
                stats = await worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerStats(
                    worker_pb2.GetWorkerStatsRequest(), timeout=2
                )
                if stats.running_requests > 0:
                    return name
            await asyncio.sleep(0.01)
    finally:
        for channel in channels.values():
            await channel.close()
    raise AssertionError("no decode worker reported a running request")


def _recoveries(router_log: Path, request_id: str) -> list[tuple[int, str]]:
    """(tokens generated, instance lost) of each recovery the router ran for `request_id`."""
    found = []
    for line in router_log.read_text(errors="replace").splitlines():
        match = re.search(
            rf"recovering {re.escape(request_id)} after (\d+) tokens: (\S+) lost", line
        )
        if match:
            found.append((int(match.group(1)), match.group(2)))
    return found


def test_a_decode_worker_killed_mid_stream_does_not_break_the_stream(client, recovery_cluster):
    # Whichever decode worker serves the request dies; the other one must be up to take over.
    recovery_cluster.ensure_running()
    max_tokens = 1500
    request_id = f"openai-kill-{uuid.uuid4().hex[:8]}"
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": request_id},
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    victim = asyncio.run(_busy_decode_instance(recovery_cluster, timeout_s=10))
    recovery_cluster.kill(victim)
    usage, reasons = None, []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert not is_running(recovery_cluster.record(victim))
    # The victim was decoding this very request when it died; the client saw nothing.
    assert reasons[-1] == "length"
    assert usage.completion_tokens == max_tokens
    assert text == reference_text(PROMPT, max_tokens)
    # And it was recovered: the router moved this very stream off the victim, part-way
    # through (a stream that had ended before the kill would have no recovery).
    recoveries = _recoveries(recovery_cluster.run_dir / "logs" / "router.log", request_id)
    assert recoveries, f"the router never recovered {request_id}"
    generated, lost = recoveries[0]
    assert lost == victim and 0 < generated < max_tokens, recoveries


def test_a_sampled_stream_survives_a_kill_drawing_what_a_fault_free_run_draws(
    client, recovery_cluster
):
    """Temperature 0.8 with a seed: token i is drawn from (seed, i) on whichever worker
    computes it, so the stream recovered after its decode worker died is the text of
    an undisturbed run of the same request."""
    recovery_cluster.ensure_running()
    params = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1000,
        "temperature": 0.8,
        "top_p": 0.9,
    }
    # Seed 7 draws no end-of-sequence token in 1,000 tokens (others stop early), so the
    # stream is still running when its decode worker is killed.
    undisturbed = client.completions.create(**params, seed=7).choices[0]
    assert undisturbed.finish_reason == "length"
    assert undisturbed.text != reference_text(PROMPT, 1000)
    assert undisturbed.text != client.completions.create(**params, seed=1).choices[0].text
    request_id = f"openai-sampled-kill-{uuid.uuid4().hex[:8]}"
    stream = client.completions.create(
        **params, seed=7, stream=True, extra_headers={"x-request-id": request_id}
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    victim = asyncio.run(_busy_decode_instance(recovery_cluster, timeout_s=10))
    recovery_cluster.kill(victim)
    reasons = []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            reasons.append(choice.finish_reason)
    assert not is_running(recovery_cluster.record(victim))
    recoveries = _recoveries(recovery_cluster.run_dir / "logs" / "router.log", request_id)
    assert recoveries and recoveries[0][1] == victim, recoveries
    assert reasons[-1] == undisturbed.finish_reason
    assert text == undisturbed.text
