"""A corpus of malformed requests and the exact answer each must get.

Every case is ``(name, path, body, status, param, code)``: ``body`` is raw bytes or a value
sent as JSON; ``param`` and ``code`` are what the OpenAI error object must say (``ANY``
where the wording of a pydantic path is not the point). The served model is the tiny test
llama: context 512, vocabulary 49152, batch size 8.

Example:
    >>> len(CORPUS) >= 100, len({c.name for c in CORPUS}) == len(CORPUS)
    (True, True)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ANY = object()
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any
    status: int
    param: Any = ANY
    code: Any = ANY
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def chat(**fields) -> dict:
    return {"model": "default", "messages": MESSAGES, **fields}


def completion(**fields) -> dict:
    return {"model": "default", "prompt": "hi", **fields}


def _json_syntax() -> list[Case]:
    """Bodies that are not one strict JSON object: caught before any route sees them."""
    bad = {
        "nan": b'{"model": "default", "messages": [], "temperature": NaN}',
        "infinity": b'{"model": "default", "prompt": "hi", "top_p": Infinity}',
        "minus-infinity": b'{"model": "default", "prompt": "hi", "seed": -Infinity}',
        "nan-in-ignored-field": b'{"model": "default", "prompt": "hi", "extra": NaN}',
        "nan-in-logit-bias": b'{"model": "default", "prompt": "hi", "logit_bias": {"1": NaN}}',
        "truncated": b'{"model": "default", "prompt": "hi"',
        "trailing-comma": b'{"model": "default", "prompt": "hi",}',
        "single-quotes": b"{'model': 'default'}",
        "raw-ff-byte": b'{"model": "default", "prompt": "\xff\xfe"}',
        "latin1-byte": b'{"model": "default", "prompt": "caf\xe9"}',
        "overlong-utf8": b'{"model": "default", "prompt": "\xc0\xaf"}',
        "lone-high-surrogate": b'{"model": "default", "prompt": "\\ud800"}',
        "lone-low-surrogate": b'{"model": "default", "messages": [{"role": "user", "content": "\\udc00"}]}',
        "surrogate-in-key": b'{"model": "default", "prompt": "hi", "\\ud800": 1}',
        "surrogate-in-stop": b'{"model": "default", "prompt": "hi", "stop": ["\\udfff"]}',
        "surrogate-in-model": b'{"model": "\\ud83d", "prompt": "hi"}',
        "deep-100k": b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep-33-objects": b'{"model": "default", "x": ' + b'{"a": ' * 32 + b"1" + b"}" * 32 + b"}",
        "garbage": b"\x00\x01\x02",
        "just-text": b"hello",
        "comment": b'{"model": "default" /* c */}',
        "duplicate-close": b'{"model": "default"}}',
    }
    cases = [Case(f"json-{name}", COMPLETIONS, body, 400, None, "invalid_json") for name, body in bad.items()]
    for name, body in {"array": b"[1, 2, 3]", "null": b"null", "string": b'"hi"', "number": b"42",
                       "true": b"true", "empty-array": b"[]"}.items():
        cases.append(Case(f"non-object-{name}", CHAT, body, 400, None, "invalid_json"))
    return cases


def _field_matrix() -> list[Case]:
    """Each field below its minimum, above its maximum, of the wrong type, null where not nullable."""
    rows = [
        ("temperature", [-0.01, 2.01, "hot", [1], {"a": 1}, 1e309]),
        ("top_p", [0, -1, 1.5, "x"]),
        ("top_k", [-1, 2**21, "5", 1.5]),
        ("min_p", [-0.1, 1.1, "x"]),
        ("presence_penalty", [-2.1, 2.1, "x"]),
        ("frequency_penalty", [-2.1, 2.1, None]),
        ("max_tokens", [0, -1, -(2**63), 1e309, "10", 1.5]),  # a large one is capped: test_http.py
        ("n", [0, -1, 129, 10**6, 10**30, "2", None]),
        ("seed", [2**64, -(2**63) - 1, 10**40, "7", 1.5]),
        ("stream", ["yes", 2, [True]]),
        ("stream_options", ["x", [1]]),
        ("stop", [["x"] * 17, ["x" * 257], 5, [1, 2], {"a": "b"}]),
        ("logit_bias", [{"x": 1}, {"-1": 1}, {"1.5": 1}, {"5": 101}, {"5": -101}, {"49152": 1},
                        {"9999999999": 1}, {str(i): 1 for i in range(301)}, [1, 2], "x", {"5": "x"}]),
        ("model", [5, None, ["default"], {"id": "default"}]),
    ]
    cases = []
    for field, values in rows:
        for i, value in enumerate(values):
            cases.append(Case(f"chat-{field}-{i}", CHAT, chat(**{field: value}), 400, ANY))
    return cases


def _chat_specific() -> list[Case]:
    return [
        Case("chat-no-messages", CHAT, {"model": "default"}, 400, "messages"),
        Case("chat-empty-messages", CHAT, chat(messages=[]), 400, "messages"),
        Case("chat-messages-string", CHAT, chat(messages="hi"), 400, "messages"),
        Case("chat-messages-null", CHAT, chat(messages=None), 400, "messages"),
        Case("chat-message-not-object", CHAT, chat(messages=["hi"]), 400, "messages.0"),
        Case("chat-unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
        Case("chat-no-role", CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
        Case("chat-content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
        Case("chat-content-part-image", CHAT, chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, ANY),
        Case("chat-content-part-no-text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
             400, ANY),
        Case("chat-logprobs-string", CHAT, chat(logprobs="yes"), 400, "logprobs"),
        Case("chat-top-logprobs-without-logprobs", CHAT, chat(top_logprobs=3), 400, None),
        Case("chat-top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        Case("chat-top-logprobs-huge", CHAT, chat(logprobs=True, top_logprobs=10**6), 400, "top_logprobs"),
        Case("chat-top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
        Case("chat-max-completion-tokens-0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
        Case("chat-n-above-batch", CHAT, chat(n=9), 400, "n"),
        Case("chat-n-128", CHAT, chat(n=128), 400, "n"),
        Case("chat-too-long", CHAT, chat(messages=[{"role": "user", "content": "word " * 600}]), 400,
             "messages", "context_length_exceeded"),
    ]


def _completion_specific() -> list[Case]:
    return [
        Case("completion-no-prompt", COMPLETIONS, {"model": "default"}, 400, "prompt"),
        Case("completion-empty-prompt", COMPLETIONS, completion(prompt=""), 400, "prompt"),
        Case("completion-empty-token-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
        # Found by bench/fuzz.py: a control character the tokenizer drops left a 0-token prompt
        # that no engine step could schedule (a 500).
        Case("completion-prompt-without-tokens", COMPLETIONS, completion(prompt="\u0013"), 400, "prompt"),
        Case("completion-negative-token", COMPLETIONS, completion(prompt=[-1]), 400, ANY),
        Case("completion-token-at-vocab", COMPLETIONS, completion(prompt=[49152]), 400, "prompt"),
        Case("completion-token-overflow", COMPLETIONS, completion(prompt=[2**64]), 400, "prompt"),
        Case("completion-token-float", COMPLETIONS, completion(prompt=[1.5]), 400, ANY),
        Case("completion-list-of-strings", COMPLETIONS, completion(prompt=["a", "b"]), 400, ANY),
        Case("completion-nested-lists", COMPLETIONS, completion(prompt=[[1, 2]]), 400, ANY),
        Case("completion-prompt-object", COMPLETIONS, completion(prompt={"a": 1}), 400, "prompt"),
        Case("completion-logprobs-6", COMPLETIONS, completion(logprobs=6), 400, "logprobs"),
        Case("completion-logprobs-negative", COMPLETIONS, completion(logprobs=-1), 400, "logprobs"),
        Case("completion-echo-string", COMPLETIONS, completion(echo="x"), 400, "echo"),
        Case("completion-too-long-text", COMPLETIONS, completion(prompt="word " * 2000), 400, "prompt",
             "context_length_exceeded"),
        Case("completion-too-long-ids", COMPLETIONS, completion(prompt=[1] * 512), 400, "prompt",
             "context_length_exceeded"),
        Case("completion-unknown-model", COMPLETIONS, completion(model="gpt-4"), 404, "model", "model_not_found"),
        Case("completion-huge-model-name", COMPLETIONS, completion(model="m" * 100_000), 404, "model",
             "model_not_found"),
        Case("chat-unknown-model", CHAT, chat(model="other"), 404, "model", "model_not_found"),
        Case("chat-empty-model-name", CHAT, chat(model=""), 404, "model", "model_not_found"),
    ]


def _empty_bodies() -> list[Case]:
    return [Case("chat-empty-body", CHAT, b"", 400, ANY), Case("completion-empty-body", COMPLETIONS, b"", 400, ANY),
            Case("chat-empty-object", CHAT, b"{}", 400, ANY), Case("completion-whitespace", COMPLETIONS, b"  ", 400,
                                                                      None, "invalid_json")]


def _routes_and_sizes() -> list[Case]:
    """Unknown routes, wrong methods, and bodies or headers over the limits (4 MiB, 16 KiB)."""
    return [
        Case("route-unknown", "/v1/nothing", b"", 404, None, None, method="GET"),
        Case("route-embeddings", "/v1/embeddings", completion(), 404, None, None),
        Case("route-root", "/", b"", 404, None, None, method="GET"),
        Case("method-get-chat", CHAT, b"", 405, None, None, method="GET"),
        Case("method-post-models", "/v1/models", b"{}", 405, None, None),
        Case("method-delete-health", "/health", b"", 405, None, None, method="DELETE"),
        Case("body-5mib", COMPLETIONS, b"x" * (5 << 20), 413, None, "body_too_large"),
        Case("body-5mib-valid-json", COMPLETIONS, completion(prompt="a" * (5 << 20)), 413, None, "body_too_large"),
        Case("header-64kib", "/v1/models", b"", 431, None, "headers_too_large", method="GET",
             headers=(("x-padding", "a" * (64 << 10)),)),
        Case("header-many", COMPLETIONS, completion(), 431, None, "headers_too_large",
             headers=tuple((f"x-h{i}", "v" * 100) for i in range(300))),
    ]


CORPUS: list[Case] = (_json_syntax() + _field_matrix() + _chat_specific() + _completion_specific()
                      + _empty_bodies() + _routes_and_sizes())
