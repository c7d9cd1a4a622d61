"""Hardening: malformed requests, limits, API key, CORS, health and the SIGTERM drain.

The corpus, the API key and CORS, and the full queue run the server's configuration, engine,
HTTP app and uvicorn in the test process (``tests/inprocess.py``) on the tiny random llama
(context 512): the routes and the HTTP layer are what they check. The SIGTERM lifecycle tests
run the real ``kvserve serve`` process (its signal handler, its drain, its exit code). The
guard and health mappings also run on a stub engine.
"""

from __future__ import annotations

import json
import signal
import threading
from types import SimpleNamespace

import httpx
import pytest

from malformed_corpus import ANY, CORPUS, Case
from inprocess import InProcessServer
from servers import ServerProcess, make_tiny_llama, wait_for

from kvserve.bench.soak import metrics

ERROR_KEYS = {"message", "type", "param", "code"}
KEY = "sk-test-0123456789"


def assert_openai_error(response: httpx.Response, status: int, err_type: str | None = None) -> dict:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
    if err_type is not None:
        assert error["type"] == err_type
    return error


def send(base_url: str, case: Case, headers: dict | None = None) -> httpx.Response:
    all_headers = {"content-type": "application/json", **dict(case.headers), **(headers or {})}
    return httpx.request(case.method, f"{base_url}{case.path}", content=case.content() or None,
                         headers=all_headers, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = InProcessServer(tiny_model_dir, "--cache-dir", str(tmp_path_factory.mktemp("cache")),
                           "--max-tokens", "8")
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


# --- the corpus: every malformed request gets its exact status and an OpenAI error -------------

@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_malformed_request_gets_exact_openai_error(server, case):
    response = send(server.base_url, case)
    error = assert_openai_error(response, case.status)
    expected_type = {404: "not_found_error"}.get(case.status, "invalid_request_error")
    assert error["type"] == expected_type
    if case.param is not ANY:
        assert error["param"] == case.param
    if case.code is not ANY:
        assert error["code"] == case.code
    assert len(response.content) < 2048  # nothing of a large input is echoed back
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_corpus_leaves_the_server_serving(server):
    """After the corpus (and whatever order pytest ran it in), a valid request still works."""
    body = {"model": "default", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("seed, n", [(-1, 1), (-(2**63), 2), (2**64 - 1, 3)])
def test_extreme_seeds_wrap_instead_of_failing(server, seed, n):
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2, "seed": seed, "n": n}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == n


def test_a_body_labelled_form_encoded_is_read_as_json(server):
    """``curl -d`` labels JSON as a form; the body is a JSON object, so it is served."""
    body = b'{"model": "default", "prompt": "Hi", "max_tokens": 2}'
    response = httpx.post(f"{server.base_url}/v1/completions", content=body,
                          headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_streamed_body_over_the_limit_gets_413(server):
    def chunks():
        yield b'{"model": "default", "prompt": "'
        for _ in range(5 * 1024):
            yield b"a" * 1024
        yield b'"}'

    response = httpx.post(f"{server.base_url}/v1/completions", content=chunks(), timeout=60)
    assert assert_openai_error(response, 413)["code"] == "body_too_large"


def test_no_cors_headers_unless_configured(server):
    response = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions",
                              headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert_openai_error(preflight, 405)
    assert "access-control-allow-origin" not in preflight.headers


# --- API key and CORS ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def secured(tiny_model_dir, tmp_path_factory):
    proc = InProcessServer(tiny_model_dir, "--cache-dir", str(tmp_path_factory.mktemp("cache")),
                           "--max-tokens", "4", "--api-key", KEY, "--cors-origins", "https://app.example")
    yield proc.wait_ready()
    assert proc.stop() == 0, proc.output()


@pytest.mark.parametrize("authorization", [None, "", "Bearer", f"Token {KEY}", f"Basic {KEY}", f"Bearer {KEY}x",
                                           f"Bearer {KEY[:-1]}", f"Bearer {KEY.upper()}", f"{KEY}",
                                           "Bearer sk-test-0123456788"])
def test_requests_without_the_key_get_401(secured, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    response = httpx.get(f"{secured.base_url}/v1/models", headers=headers)
    error = assert_openai_error(response, 401, "authentication_error")
    assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("method, path", [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"),
                                          ("GET", "/v1/nothing"), ("GET", "/health/"), ("GET", "//health"),
                                          ("GET", "/health/../v1/models"), ("GET", "/HEALTH"),
                                          ("POST", "/v1/completions"), ("POST", "/health")])
def test_every_route_but_health_needs_the_key(secured, method, path):
    """Unknown routes answer 401 too, so the routes cannot be enumerated without a key."""
    with httpx.Client(base_url=secured.base_url) as client:
        request = client.build_request(method, "http://placeholder")
        request.url = httpx.URL(f"{secured.base_url}").copy_with(raw_path=path.encode())
        response = client.send(request)
    assert_openai_error(response, 401, "authentication_error")


def test_the_key_opens_every_route_and_health_needs_none(secured):
    assert httpx.get(f"{secured.base_url}/health").status_code == 200
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {"Authorization": f"{scheme} {KEY}"}
        assert httpx.get(f"{secured.base_url}/v1/models", headers=headers).status_code == 200
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
    response = httpx.post(f"{secured.base_url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200


def test_cors_allows_only_configured_origins(secured):
    ok = httpx.options(f"{secured.base_url}/v1/chat/completions",
                       headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                "Access-Control-Request-Headers": "authorization, content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    refused = httpx.options(f"{secured.base_url}/v1/chat/completions",
                            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert assert_openai_error(refused, 400)["code"] == "cors_refused"
    assert "access-control-allow-origin" not in refused.headers
    headers = {"Authorization": f"Bearer {KEY}"}
    foreign = httpx.get(f"{secured.base_url}/v1/models", headers={**headers, "Origin": "https://evil.example"})
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers
    # A browser must be able to read the 401 too, or it reports a CORS failure instead.
    denied = httpx.get(f"{secured.base_url}/v1/models", headers={"Origin": "https://app.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://app.example"


# --- health and the guard, in-process on a stub engine ------------------------------------------

class StubEngine:
    """What ``create_app`` reads from an engine, without a model or a thread."""

    def __init__(self, healthy: tuple[bool, str] = (True, "ok")):
        info = SimpleNamespace(model_id="stub", context_length=64, weight_format="-", blas="-",
                               kv_scheme="fp16", vocab_size=100)
        self.model = SimpleNamespace(info=info, tokenizer=None, device=None)
        self.config = SimpleNamespace(max_tokens=8, max_tokens_limit=16, max_batch_size=8)
        self.inflight, self._health = 0, healthy
        self.metrics = SimpleNamespace(render=lambda: "kvserve_requests_running 0\n")

    def health(self):
        return self._health


def stub_client(engine: StubEngine, **http):
    from fastapi.testclient import TestClient

    from kvserve.configs import HTTPConfig
    from kvserve.server.http.app import create_app

    return TestClient(create_app(engine, HTTPConfig(**http)), raise_server_exceptions=False)


@pytest.mark.parametrize("reason", ["engine thread is not running", "engine step has not finished for 130 s"])
def test_health_is_503_when_the_engine_is_dead_or_stuck(reason):
    response = stub_client(StubEngine((False, reason))).get("/health")
    error = assert_openai_error(response, 503, "service_unavailable_error")
    assert error["message"] == reason


def test_draining_answers_503_to_new_work_but_serves_metrics():
    client = stub_client(StubEngine())
    assert client.get("/health").json() == {"status": "ok", "inflight": 0}
    assert client.app.state.gate.start_drain()
    assert assert_openai_error(client.get("/health"), 503)["code"] == "server_draining"
    response = client.post("/v1/chat/completions", json={"model": "stub", "messages": []})
    assert assert_openai_error(response, 503, "service_unavailable_error")["code"] == "server_draining"
    assert response.headers["retry-after"] == "5"
    assert client.get("/metrics").status_code == 200 and client.get("/v1/models").status_code == 200


def test_openapi_documents_400_and_the_error_object_never_422():
    schema = stub_client(StubEngine()).get("/openapi.json").json()
    assert '"422"' not in json.dumps(schema)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert sorted(chat) == ["200", "400", "401", "404", "413", "429", "431", "503"]
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]


def test_gate_aborts_what_is_left():
    from kvserve.server.http.guard import Gate

    gate, aborted = Gate(), []
    first = gate.track(lambda: aborted.append("a"))
    gate.track(lambda: aborted.append("b"))
    gate.untrack(first)
    assert gate.abort_all() == 1 and aborted == ["b"]


def test_a_bug_answers_500_in_the_openai_shape_without_its_text():
    engine = StubEngine()
    engine.health = lambda: 1 / 0  # an unexpected exception inside a route
    response = stub_client(engine).get("/health")
    error = assert_openai_error(response, 500, "server_error")
    assert error["message"] == "internal server error"


def test_http_defaults_bind_loopback_without_key_or_cors():
    from kvserve.configs import ConfigError, HTTPConfig, load_config

    http = load_config("default").http
    assert (http.host, http.api_key, http.cors_origins) == ("127.0.0.1", None, ())
    assert (http.max_body_bytes, http.max_header_bytes, http.drain_timeout_s) == (4 << 20, 16 << 10, 30.0)
    with pytest.raises(ConfigError, match="at least 8 characters"):
        HTTPConfig(api_key="short")


# --- backpressure ------------------------------------------------------------------------------

def test_a_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    from together import together

    # Room for 2 in flight: 1 running (batch size 1) and 1 queued.
    proc = InProcessServer(tiny_model_dir, "--cache-dir", str(tmp_path), "--max-batch-size", "1",
                           "--max-queued-requests", "1").wait_ready()
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    try:
        responses = together([lambda: httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=120)
                              for _ in range(6)])
    finally:
        assert proc.stop() == 0, proc.output()
    assert sorted(r.status_code for r in responses) == [200, 200, 429, 429, 429, 429]
    for response in (r for r in responses if r.status_code == 429):
        error = assert_openai_error(response, 429, "rate_limit_error")
        assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"


# --- SIGTERM: drain, then exit 0 ----------------------------------------------------------------

TOPICS = ["cats", "the sea", "bread", "winter", "music", "trains", "gardens", "the moon"]


def stream_chat(base_url: str, topic: str, max_tokens: int, started: threading.Event) -> dict:
    """Stream one chat to its end; ``started`` is set at the first content chunk."""
    body = {"model": "default", "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out = {"content_chunks": 0, "finish_reason": None, "done": False, "status": None}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["delta"].get("content"):
                        out["content_chunks"] += 1
                        started.set()
                    out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def start_streams(base_url: str, count: int, max_tokens: int) -> tuple[list, list[threading.Event], list]:
    results, events, threads = [None] * count, [threading.Event() for _ in range(count)], []
    for i in range(count):
        def run(i=i):
            results[i] = stream_chat(base_url, TOPICS[i % len(TOPICS)], max_tokens, events[i])
        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    return results, events, threads


@pytest.fixture(scope="module")
def tiny_8k_dir(default_model_dir, tmp_path_factory):
    """The tiny model with an 8K context: its 512-token one decodes in under 0.5 s here, and
    the drain tests need streams that outlast what they check while the streams run."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-8k") / "tiny-8k", default_model_dir, context=8192)


def test_sigterm_lets_eight_running_streams_finish_and_refuses_new_work(tiny_8k_dir, tmp_path):
    proc = ServerProcess(tiny_8k_dir, "--cache-dir", str(tmp_path)).wait_ready()
    try:
        # 1,500 tokens each: the streams are still running when the refusals are checked.
        results, started, threads = start_streams(proc.base_url, 8, 1500)
        assert all(e.wait(60) for e in started)  # all 8 are decoding
        proc.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{proc.base_url}/health").status_code == 503, "the server to start draining")
        refused = httpx.post(f"{proc.base_url}/v1/completions", json={"model": "default", "prompt": "x"})
        assert assert_openai_error(refused, 503)["code"] == "server_draining"
        assert httpx.get(f"{proc.base_url}/health").status_code == 503
        for t in threads:
            t.join(120)
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    assert [r["status"] for r in results] == [200] * 8
    assert [(r["finish_reason"], r["done"]) for r in results] == [("length", True)] * 8
    assert "SIGTERM: draining 8 request(s)" in proc.output()
    # The 8 chats finished during the drain, and each was queued for the prefix cache's disk
    # writer; stopping the engine flushed them, so a restart finds all of them on disk.
    again = ServerProcess(tiny_8k_dir, "--cache-dir", str(tmp_path)).wait_ready()
    try:
        values = metrics(again.base_url)
    finally:
        assert again.stop() == 0
    disk = [v for k, v in values.items() if k.startswith("kvserve_prefix_cache_disk_entries")]
    assert disk and disk[0] >= 8, values


def _held(base_url: str) -> float:
    """Requests the server holds: queued or running."""
    return sum(v for k, v in metrics(base_url).items()
               if k.startswith(("kvserve_requests_waiting", "kvserve_requests_running")))


def test_drain_timeout_aborts_what_is_left_with_a_finish_reason(tiny_8k_dir, tmp_path):
    # The running stream must outlast the 0.5 s drain whatever the machine's speed: 8,000 tokens.
    proc = ServerProcess(tiny_8k_dir, "--cache-dir", str(tmp_path), "--max-batch-size", "1",
                         "--drain-timeout", "0.5").wait_ready()
    try:
        results, started, threads = start_streams(proc.base_url, 3, 8000)
        # SIGTERM once one runs and the server holds all three: a request still on its way
        # when the drain begins is refused (503), which is another test's case.
        wait_for(lambda: any(e.is_set() for e in started) and _held(proc.base_url) == 3,
                 "one stream running and three held")
        proc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()
    # One ran (batch size 1), two waited; the drain ended all three, each with a reason.
    assert [r["status"] for r in results] == [200] * 3
    assert [(r["finish_reason"], r["done"]) for r in results] == [("stop", True)] * 3
    assert "drain timed out: aborting 3 request(s)" in proc.output()
