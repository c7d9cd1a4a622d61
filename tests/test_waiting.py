"""Requests that wait: SSE keep-alives while a stream has nothing to send, and the queue-wait
timeout, on the server's configuration, engine, HTTP app and uvicorn in the test process
(``tests/inprocess.py``; tiny random llama, one request at a time): the streams and the
queue are what is checked, not the process."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from inprocess import InProcessServer

from kvserve.bench.soak import metrics

KEEPALIVE = ": keep-alive"
BLOCKER = {"model": "default", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
           "stream": True}


def start_server(model_dir, tmp_path, *flags: str, keepalive_s: float = 0.05) -> InProcessServer:
    """Batch size 1, so a second request waits while one runs; keep-alives every ``keepalive_s``."""
    config = tmp_path / "waiting.toml"
    config.write_text(f"[http]\nsse_keepalive_s = {keepalive_s}\n")
    return InProcessServer(model_dir, "--cache-dir", str(tmp_path), "--config", str(config),
                           "--max-batch-size", "1", *flags).wait_ready()


def sse_body(base_url: str, route: str, body: dict) -> str:
    """A whole streamed response body, as sent."""
    with httpx.stream("POST", f"{base_url}{route}", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return "".join(response.iter_text())


def events(text: str) -> list[str]:
    """The body split into SSE events, each shown as 'keep-alive', 'done', or the JSON's kind."""
    out = []
    for block in text.split("\n\n")[:-1]:
        if block == KEEPALIVE:
            out.append("keep-alive")
        elif block == "data: [DONE]":
            out.append("done")
        else:
            assert block.startswith("data: ") and "\n" not in block, block
            payload = json.loads(block[6:])
            out.append("error" if "error" in payload else "chunk")
    assert text.endswith("\n\n")
    return out


class Blocker:
    """A long stream holding the only batch slot; ``started`` once its first token arrived."""

    def __init__(self, base_url: str):
        self.started, self.text = threading.Event(), None
        self._thread = threading.Thread(target=self._run, args=(base_url,), daemon=True)
        self._thread.start()
        assert self.started.wait(120)

    def _run(self, base_url: str) -> None:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=BLOCKER, timeout=120) as response:
            chunks = []
            for chunk in response.iter_text():
                chunks.append(chunk)
                if '"text"' in chunk:
                    self.started.set()
            self.text = "".join(chunks)

    def finish(self) -> list[str]:
        self._thread.join(120)
        return events(self.text)


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    proc = start_server(tiny_model_dir, tmp_path)
    yield proc
    assert proc.stop() == 0, proc.output()


def payloads(text: str) -> list[dict]:
    return [json.loads(block[6:]) for block in text.split("\n\n")
            if block.startswith("data: {")]


def test_a_queued_stream_gets_keep_alive_comments_until_its_tokens_come(server):
    blocker = Blocker(server.base_url)
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, "stream": True}
    text = sse_body(server.base_url, "/v1/chat/completions", chat)
    kinds = events(text)
    # The role chunk goes out at once, then comments while the blocker holds the only slot,
    # then the tokens and [DONE].
    first_token = kinds.index("chunk", 1)
    assert kinds[0] == "chunk" and first_token > 1 and set(kinds[1:first_token]) == {"keep-alive"}
    assert "\n\n: keep-alive\n\n" in text
    assert kinds[-1] == "done" and "error" not in kinds
    assert payloads(text)[-1]["choices"][0]["finish_reason"] == "length"
    assert blocker.finish()[-1] == "done"


def test_the_openai_client_reads_a_stream_with_keep_alives(server):
    blocker = Blocker(server.base_url)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="default", prompt="Hello there", max_tokens=5, temperature=0)
    streamed = list(client.completions.create(**kwargs, stream=True))  # queued: keep-alives first
    blocker.finish()
    whole = client.completions.create(**kwargs)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_request_waiting_past_the_queue_timeout_gets_503_or_an_error_event(tiny_model_dir, tmp_path):
    from together import together

    proc = start_server(tiny_model_dir, tmp_path, "--queue-timeout", "0.2", "--max-queued-requests", "4")
    body = {"model": "default", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    try:
        blocker = Blocker(proc.base_url)
        refused, text = together([
            lambda: httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=120),
            lambda: sse_body(proc.base_url, "/v1/completions", {**body, "stream": True})])
        finished = blocker.finish()
        values = metrics(proc.base_url)
    finally:
        assert proc.stop() == 0, proc.output()
    assert refused.status_code == 503 and refused.json() == {"error": {
        "message": "the request waited more than 0.2 s in the queue; retry later",
        "type": "server_error", "param": None, "code": "queue_timeout"}}
    # The stream had started (status 200, perhaps keep-alives): it ends with the error as an
    # event, then [DONE].
    kinds = events(text)
    assert kinds[-2:] == ["error", "done"] and set(kinds[:-2]) <= {"keep-alive"}
    assert payloads(text)[-1] == refused.json()
    # The request holding the slot ran to its end, nothing cut short.
    assert finished[-1] == "done" and "error" not in finished
    assert payloads(blocker.text)[-1]["choices"][0]["finish_reason"] is not None
    assert values['kvserve_requests_finished_total{reason="timeout"}'] == 2
