"""The OpenAI-compatible HTTP front end to end: ``kvroute up --executor sim --http-port 0``
as a real process tree, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest
from e2e_procs import procs, wait_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MODEL = "kvroute-tiny"
SYSTEM = "You are a helpful support agent for ExampleCorp. Answer briefly and politely. "


def test_openai_client_against_kvroute_up():
    with procs() as p:
        up = p.start(
            "up",
            ["up", "--workers", "2", "--port", "0", "--http-port", "0", "--executor", "sim"],
            marker="router http listening on",
        )
        url = up.address
        assert url.startswith("http://127.0.0.1:")
        wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            assert [m.id for m in client.models.list().data] == [MODEL]

            kwargs = {"model": MODEL, "prompt": SYSTEM + "Hi?", "max_tokens": 8, "seed": 1}
            full = client.completions.create(**kwargs)
            assert full.choices[0].finish_reason == "length"
            assert full.usage.completion_tokens == 8
            streamed = list(client.completions.create(**kwargs, stream=True))
            assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
            # the shared prefix is served from cache on the second request
            again = client.completions.create(**{**kwargs, "prompt": SYSTEM + "Invoices?"})
            assert again.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM) - 4

            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            chat = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=5, seed=2
            )
            assert chat.choices[0].message.role == "assistant"
            chunks = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=5,
                    seed=2,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content == chat.choices[0].message.content
            assert chunks[-1].usage.completion_tokens == 5

            with pytest.raises(openai.BadRequestError, match="best_of: not supported"):
                client.completions.create(model=MODEL, prompt="x", best_of=2)
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                client.completions.create(model="gpt-4o", prompt="x")
        finally:
            client.close()


def test_worker_process_serves_http_and_stops_cleanly():
    with procs() as p:
        worker = p.worker("w-http", "--http-port", "0")
        deadline = time.monotonic() + 30
        while not any(line.startswith("http listening on ") for line in worker.lines):
            assert time.monotonic() < deadline, worker.lines
            time.sleep(0.05)  # another process: nothing to await
        line = next(x for x in worker.lines if x.startswith("http listening on "))
        url = "http://" + line.split()[-1]
        wait_healthy(url)
        body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 3}}).encode()
        request = urllib.request.Request(
            url + "/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            out = json.loads(r.read())
        assert out["meta_info"]["completion_tokens"] == 3
        assert out["meta_info"]["worker_id"] == "w-http"
        worker.popen.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
