"""Streams aborted mid-generation free everything: KV bytes return to zero, RSS to baseline."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from servers import ServerProcess, wait_idle
from together import together

from kvserve.bench.soak import metrics, rss_bytes

# The end-of-text tokens banned (<|endoftext|> 0, <|im_end|> 2 in the default model's
# vocabulary, which the tiny model keeps): a sampled one could end a stream before the client
# hangs up (one stream of 200 did, seeing 1 chunk), and every stream must be cut mid-way.
BODY = {"model": "default", "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 200, "stream": True, "temperature": 0.7, "logit_bias": {"0": -100, "2": -100}}


def leave_after_tokens(base_url: str, tokens: int) -> int:
    """Stream, read ``tokens`` content chunks, then hang up mid-generation."""
    seen = 0
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=BODY, timeout=60) as response:
        for line in response.iter_lines():
            if '"content"' in line:
                seen += 1
                if seen >= tokens:
                    return seen
    return seen


def abort_streams(base_url: str, count: int) -> list[int]:
    seen = []
    for start in range(0, count, 8):
        seen += together([lambda i=i: leave_after_tokens(base_url, 2 + i % 5) for i in range(start, start + 8)])
    return seen


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_two_hundred_aborted_streams_leave_no_kv_bytes_and_rss_at_baseline(tiny_model_dir, tmp_path):
    proc = ServerProcess(tiny_model_dir, "--cache-dir", str(tmp_path), "--kv-scheme", "turbo0v4").wait_ready()
    try:
        base = proc.base_url
        abort_streams(base, 24)  # warm-up: allocator pools, compiled kernels, imports
        wait_idle(base)
        baseline = rss_bytes(proc.proc.pid)
        seen = abort_streams(base, 200)
        assert min(seen) >= 2  # every stream was cut mid-generation, not at its end
        wait_idle(base)
        assert metrics(base)['kvserve_requests_finished_total{reason="abort"}'] >= 224
        assert metrics(base)['kvserve_kv_cache_bytes{kv_scheme="turbo0v4"}'] == 0
        after = rss_bytes(proc.proc.pid)
        print(f"RSS baseline {baseline / 2**20:.1f} MiB, after 200 aborts {after / 2**20:.1f} MiB")
        assert after <= baseline * 1.05, (baseline, after)
    finally:
        assert proc.stop() == 0, proc.output()
