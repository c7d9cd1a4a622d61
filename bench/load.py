"""C concurrent streams against one OpenAI-compatible URL, and the statistics users quote.

Per request: time to first token (TTFT), time per output token after the first (TPOT),
the gaps between streamed chunks (ITL) and end-to-end latency (E2E). Output tokens are
the server's own ``usage.completion_tokens`` when it sends usage, else streamed chunks.

Example (statistics over measured samples):
    >>> percentile([4.0, 1.0, 3.0, 2.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.5, 3.97)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestStats:
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    requests: list[RequestStats]
    wall_seconds: float

    @property
    def ok(self) -> list[RequestStats]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def summary(self) -> dict[str, float | int | None]:
        """p50/p99 of each latency in seconds, throughput and error count."""
        out: dict[str, float | int | None] = {
            "requests": len(self.requests), "errors": self.errors,
            "output_tokens": self.output_tokens, "wall_s": self.wall_seconds,
            "output_tok_s": self.tokens_per_second}
        series = {"ttft": [r.ttft for r in self.ok], "tpot": [r.tpot for r in self.ok],
                  "itl": [g for r in self.ok for g in r.itl], "e2e": [r.e2e for r in self.ok]}
        for name, values in series.items():
            values = [v for v in values if v is not None]
            for q in (50, 99):
                out[f"{name}_p{q}"] = percentile(values, q) if values else None
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 10)


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestStats:
    stats = RequestStats()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                stats.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return stats
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    stats.error = str(payload["error"])[:200]
                    return stats
                usage = payload.get("usage")
                if usage:
                    stats.output_tokens = usage.get("completion_tokens", 0)
                if _has_text(payload):
                    now = time.perf_counter()
                    chunks += 1
                    if stats.ttft is None:
                        stats.ttft = now - start
                    else:
                        stats.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        stats.error = f"{type(exc).__name__}: {exc}"
        return stats
    stats.e2e = time.perf_counter() - start
    stats.output_tokens = stats.output_tokens or chunks
    return stats


def _has_text(payload: dict) -> bool:
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


async def _drive(base_url: str, bodies: list[dict], concurrency: int, timeout: float) -> LoadResult:
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[RequestStats] = []
    # A fresh connection per request: llama-server may close a streamed response's connection
    # while the pool still holds it, and the next request on it failed with RemoteProtocolError.
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                results.append(await _one(client, base_url.rstrip("/") + _path(body), body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LoadResult(results, wall)


def chat_bodies(model: str, prompts: list[str], max_tokens: int, chat: bool = True,
                ignore_eos: bool = False) -> list[dict]:
    """Streaming greedy requests that ask for usage in the last chunk: chat messages, or
    with ``chat`` False raw prompts for ``/v1/completions`` (a base model has no chat
    template). ``ignore_eos``: every request generates ``max_tokens`` (a server that knows
    the field), so servers and schemes whose greedy answers end at different lengths do the
    same work.

    >>> [sorted(b) for b in chat_bodies("m", ["hi"], 4) + chat_bodies("m", ["hi"], 4, chat=False)]
    ... # doctest: +NORMALIZE_WHITESPACE
    [['max_tokens', 'messages', 'model', 'stream', 'stream_options', 'temperature'],
     ['max_tokens', 'model', 'prompt', 'stream', 'stream_options', 'temperature']]
    >>> chat_bodies("m", ["hi"], 4, ignore_eos=True)[0]["ignore_eos"]
    True
    """
    text = (lambda p: {"messages": [{"role": "user", "content": p}]}) if chat else (lambda p: {"prompt": p})
    extra = {"ignore_eos": True} if ignore_eos else {}
    return [{"model": model, **text(p), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}, **extra} for p in prompts]


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def run_load(base_url: str, bodies: list[dict], concurrency: int, timeout: float = 600.0) -> LoadResult:
    return asyncio.run(_drive(base_url, bodies, concurrency, timeout))
