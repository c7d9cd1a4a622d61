"""A model split across two processes (``kvserve serve --distributed``, the ring backend over
loopback): it answers what one process answers, its prefix cache survives a restart and is
refused by a server of another layout, and a rank that dies ends the server cleanly.

The ranks are started as ``mlx.launch`` starts them (``MLX_RANK``, ``MLX_HOSTFILE``), each a
process of its own, so a test can kill one; one test goes through ``mlx.launch`` itself.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from archs import make_tiny_model
from servers import DistributedServer, ServerProcess
from together import together

from kvserve.cache.prefix.files import read_header

PROMPTS = ["Write a haiku about the sea.", "Name three colours.", "What is 12 times 7?",
           "Give me a word that rhymes with cat.", "Describe a tree in one sentence.",
           "List two planets.", "Say hello in French.", "What do bees make?"]
# Both servers compute in one weight format: "auto" may time another one in each process.
SAME = ("--weight-format", "dense-f32", "--max-tokens", "24")


def ask(server, prompt: str, max_tokens: int = 24, **extra):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=600)
    return client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, **{"temperature": 0, **extra})


def answers(server, prompts: list[str]) -> list[tuple[str, int]]:
    replies = together([lambda p=p: ask(server, p) for p in prompts])
    return [(r.choices[0].message.content, r.usage.completion_tokens) for r in replies]


def metric(server, name: str) -> dict[str, float]:
    """Samples of one metric: labels -> value."""
    lines = httpx.get(f"{server.base_url}/metrics").text.splitlines()
    return {line[len(name):].rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith(name + "{")}


@pytest.fixture(scope="module", params=["fp16", "affine4"])
def pair(request, default_model_dir, tmp_path_factory):
    """One process and two processes, same model, scheme and weight format."""
    scheme = request.param
    cache = tmp_path_factory.mktemp(f"dist-{scheme}")
    common = ("--cache-dir", str(cache), "--kv-scheme", scheme, "--prompt-cache-disk-gb", "0", *SAME)
    one = ServerProcess(default_model_dir, *common)
    two = DistributedServer(default_model_dir, *common)
    two.scheme = scheme
    one.wait_ready(), two.wait_ready()
    yield one, two
    assert two.stop() == [0, 0], two.output()
    assert one.stop() == 0, one.output()


# Quantized K/V, split against whole: the ranks' partial products round differently (and the
# whole model's decode products read packed codes), a value on a quantization boundary can take
# the other 4-bit code, and the replies can part. Where they part, the split run's token must be
# among the whole run's top five and less than this many nats below its pick. Rounding-level
# changes alone move that gap: one of these prompts parted at 0.15 nats, and at 0.45-0.56 once
# RMSNorm and RoPE became one CPU operation each (either one alone kept it under 0.25). A broken
# split (a wrong shard, a lost all-reduce) parts at the first tokens by many nats.
NEAR_TIE = 1.0


def tie_gap(whole, split) -> float | None:
    """At the first token where two greedy chat replies part, how far the split run's pick
    sat below the whole run's in the whole run (None: they agree)."""
    for mine, theirs in zip(whole.choices[0].logprobs.content, split.choices[0].logprobs.content):
        if mine.token != theirs.token:
            ranked = {t.token: t.logprob for t in mine.top_logprobs}
            assert theirs.token in ranked, f"{theirs.token!r} was not even in the top 5 beside {mine.token!r}"
            return mine.logprob - ranked[theirs.token]
    return None


def test_greedy_replies_equal_one_process_alone_and_with_8_streams(pair):
    """fp16: the same tokens. affine4: the same tokens, or a part where the split run's token
    is among the whole run's top five, less than NEAR_TIE nats below its pick."""
    one, two = pair
    extra = {"logprobs": True, "top_logprobs": 5}
    for prompts in (PROMPTS[:2], PROMPTS):  # alone, then 8 streams together
        whole = together([lambda p=p: ask(one, p, **extra) for p in prompts]) if len(prompts) > 2 \
            else [ask(one, p, **extra) for p in prompts]
        split = together([lambda p=p: ask(two, p, **extra) for p in prompts]) if len(prompts) > 2 \
            else [ask(two, p, **extra) for p in prompts]
        for w, s in zip(whole, split):
            if two.scheme == "fp16":
                assert s.choices[0].message.content == w.choices[0].message.content
            else:
                gap = tie_gap(w, s)
                assert gap is None or gap < NEAR_TIE, (gap, w.choices[0].message.content, s.choices[0].message.content)


def test_unseeded_sampling_and_choices_stay_in_step_across_ranks(pair):
    """Rank 0 seeds every unseeded request for all ranks: otherwise the ranks would draw
    different tokens, and rank 0 would stop at the first step their digests differ."""
    _, two = pair
    replies = together([lambda p=p: ask(two, p, temperature=0.9, n=2) for p in PROMPTS[:4]])
    assert all(len(r.choices) == 2 and {c.finish_reason for c in r.choices} <= {"stop", "length"}
               for r in replies)
    assert httpx.get(f"{two.base_url}/health").status_code == 200


def test_each_rank_reports_its_kv_bytes(pair):
    _, two = pair
    replies = together([lambda p=p: ask(two, p, max_tokens=24, stream=True) for p in PROMPTS[:4]])
    seen = []
    for stream in replies:  # read while the streams run: their KV is live
        for _ in stream:
            sample = metric(two, "kvserve_kv_cache_rank_bytes")
            seen.append(tuple(sample.get(f'{{kv_scheme="{two.scheme}",rank="{r}"}}') for r in (0, 1)))
    # Both ranks report the state after the same step. The default model's 3 KV heads split
    # 2 + 1: rank 0 holds twice rank 1's bytes.
    assert all(zero == 2 * one for zero, one in seen), seen
    assert max(one for _, one in seen) > 0


@pytest.mark.parametrize("arch,scheme,launcher", [
    ("qwen3", "fp16", True),  # 4 query heads over 2 KV heads: mlx-lm's own shard(), through mlx.launch
    ("qwen3", "affine4", False),
    ("gpt_oss", "fp16", False),  # sliding windows, attention sinks, a mixture of experts
    ("qwen3_5", "fp16", False),  # recurrent (GatedDeltaNet) layers beside full attention
    ("qwen3_next", "fp16", False),  # no shard(): mlx-lm's pipeline, 2 layers per rank
    ("qwen3_next", "affine4", False),
])
def test_other_families_split_through_mlx_lm(default_model_dir, tmp_path, arch, scheme, launcher):
    model = make_tiny_model(arch, tmp_path / arch, default_model_dir)
    common = ("--cache-dir", str(tmp_path / "c"), "--prompt-cache-disk-gb", "0", "--kv-scheme", scheme, *SAME)
    one = ServerProcess(model, *common)
    two = DistributedServer(model, *common, launcher=launcher)
    try:
        one.wait_ready(), two.wait_ready()
        split = "pp2:rank0:layers=2+2" if arch == "qwen3_next" else "tp2:rank0:even"
        assert f"split {split}" in two.output()
        long = " ".join(PROMPTS * 12)  # ~500 tokens: prefilled in two chunks of 256
        for prompt in (PROMPTS[0], long):
            assert ask(two, prompt).choices[0].message.content == ask(one, prompt).choices[0].message.content
        # Sent again: every rank resumes at the last token but one (windows and states from
        # the checkpoints each rank kept of its own layers), as one process does.
        again = [ask(server, long) for server in (two, one)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in again] == [again[1].usage.prompt_tokens - 1] * 2
        assert again[0].choices[0].message.content == again[1].choices[0].message.content
        assert answers(two, PROMPTS) == answers(one, PROMPTS)
    finally:
        assert two.stop()[0] == 0, two.output()
        one.stop()


def test_a_model_mlx_lm_cannot_split_is_refused(default_model_dir, tmp_path):
    model = make_tiny_model("gemma3_text", tmp_path / "gemma3", default_model_dir)
    two = DistributedServer(model, "--cache-dir", str(tmp_path / "c"), *SAME)
    assert two.wait_exit(300) == [1, 1], two.output()
    out = two.output()
    assert "kvserve: error: gemma3_text cannot be split across 2 processes: mlx-lm gives it neither a " \
           "tensor-parallel shard() nor a pipeline split" in out and "Traceback" not in out


def test_prefix_cache_survives_a_restart_and_one_process_refuses_its_files(default_model_dir, tmp_path):
    files = tmp_path / "prompts"
    common = ("--cache-dir", str(tmp_path / "c"), "--prompt-cache-dir", str(files), *SAME)
    # ~1,000 tokens: the plan that brings it is longer than one 4 KiB frame (its tail follows).
    prompt = "Summarize in one sentence: " + " ".join(PROMPTS * 16)
    two = DistributedServer(default_model_dir, *common).wait_ready()
    first = ask(two, prompt)
    assert two.stop() == [0, 0], two.output()
    parts = {d.name: sorted(d.glob("*.safetensors")) for d in files.iterdir()}
    assert sorted(parts) == ["rank0", "rank1"] and all(parts.values())
    shard = read_header(parts["rank1"][0]).metadata["user.shard"]
    assert shard == "tp2:rank1:kv_heads=2+1,mlp=768+768"

    two = DistributedServer(default_model_dir, *common).wait_ready()
    again = ask(two, prompt)
    assert two.stop() == [0, 0], two.output()
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content

    one = ServerProcess(default_model_dir, "--cache-dir", str(tmp_path / "c"), "--prompt-cache-dir",
                        str(files / "rank0"), *SAME).wait_ready()
    try:
        alone = ask(one, prompt)
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(one, "kvserve_prefix_cache_refused_files_total")['{reason="shard"}'] \
            == len(parts["rank0"])
    finally:
        assert one.stop() == 0, one.output()
    assert set(parts["rank0"]) <= set(files.glob("rank0/*.safetensors"))  # refused, never deleted


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_dies_ends_the_server_cleanly(default_model_dir, tmp_path, victim):
    """Killed mid-stream: the client's stream ends in an error (or the connection drops when
    rank 0 is the one killed); /health stops answering 200; the other rank exits within 10 s
    naming the rank it lost; the files left behind load right after a restart."""
    common = ("--cache-dir", str(tmp_path / "c"), "--prompt-cache-dir", str(tmp_path / "p"), *SAME)
    two = DistributedServer(default_model_dir, *common).wait_ready()
    short = ask(two, PROMPTS[0]).choices[0].message.content
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    events, error = 0, None
    try:
        with httpx.stream("POST", f"{two.base_url}/v1/chat/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    break
                events += 1
                if events == 5:
                    killed_at = time.monotonic()
                    os.kill(two.pid(victim), signal.SIGKILL)
    except httpx.HTTPError as exc:  # rank 0 itself died: the connection is what ends
        error = f"{type(exc).__name__}"
    assert error is not None and events >= 5
    survivor = 1 - victim
    if victim == 1:
        assert "rank 0 of 2: lost rank 1" in error
        assert _health_not_ok(two)
    # Heartbeats are 1 s apart: the bound only catches a survivor that never notices.
    codes = two.wait_exit(60 - (time.monotonic() - killed_at))
    assert codes[survivor] == 1, two.output()
    assert f"rank {survivor} of 2: lost rank {victim}" in two.output(survivor)

    two = DistributedServer(default_model_dir, *common).wait_ready()
    try:
        assert ask(two, PROMPTS[0]).choices[0].message.content == short
    finally:
        assert two.stop() == [0, 0], two.output()


def _health_not_ok(server) -> bool:
    """/health answers 503, or nothing once the process has exited."""
    try:
        return httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
    except httpx.HTTPError:
        return True


# --- the uneven split, in one process: what each rank keeps adds up to the whole layer ---

@pytest.mark.parametrize("quantized", [False, True])
def test_row_and_column_parts_rebuild_the_layer(quantized):
    import mlx.core as mx
    import mlx.nn as nn

    from kvserve.server.models.shard import _cols, _rows, even_bounds

    mx.random.seed(3)
    layer = nn.Linear(192, 96, bias=True)
    if quantized:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
    x = mx.random.normal((2, 192))
    full = layer(x)
    rows = even_bounds(96, 3, unit=32)  # [0, 32, 64, 96]
    stacked = mx.concatenate([_rows(layer, a, b)(x) for a, b in zip(rows, rows[1:])], axis=-1)
    assert mx.array_equal(stacked, full)
    cols = even_bounds(192, 2, unit=32)  # [0, 96, 192]: column parts carry no bias
    summed = sum(_cols(layer, a, b)(x[:, a:b]) for a, b in zip(cols, cols[1:])) + layer.bias
    assert mx.allclose(summed, full, atol=1e-4)
