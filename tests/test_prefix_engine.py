"""The prefix cache inside the engine: hits from RAM and SSD, partial and chat-turn reuse,
on a tiny random-weight llama with real files on disk."""

from __future__ import annotations

import pytest
from servers import random_llama
from stepping import drive

from kvserve.cache import parse_scheme
from kvserve.cache.prefix import Namespace, PrefixCache
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.scheduler import Scheduler

PROMPT = [(13 * i) % 251 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def model():
    return random_llama(2024)


def open_cache(scheme: str, disk_dir=None) -> PrefixCache:
    return PrefixCache(Namespace("tiny", "tok", scheme), ram_bytes=1 << 26, disk_dir=disk_dir,
                       disk_bytes=1 << 26 if disk_dir else 0)


def generate(runner: ModelRunner, prompt: list[int], n: int = 8, rid: str = "r") -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens that came from the prefix cache."""
    request = Request(list(prompt), SamplingParams(max_tokens=n, temperature=0.0), request_id=rid)
    seen: dict[str, int] = {}
    original = runner.execute

    def execute(plan):  # record what the runner reported as cached, as the scheduler reads it
        result = original(plan)
        seen.update(result.cached)
        return result

    runner.execute = execute
    try:
        tokens = drive(runner, [request], prefill=16).tokens[rid]
    finally:
        runner.execute = original
    return tokens, seen.get(rid, 0)


def release_all(runner: ModelRunner) -> None:
    assert runner.live_requests == 0 and runner.kv_bytes == 0


@pytest.mark.parametrize("scheme", ["fp16", "affine4", "turbo0v4"])
def test_a_repeated_prompt_reuses_all_but_its_last_token(model, scheme):
    pc = open_cache(scheme)
    runner = ModelRunner(model, parse_scheme(scheme), prefix=pc)
    cold, cached_cold = generate(runner, PROMPT, rid="a")
    warm, cached_warm = generate(runner, PROMPT, rid="b")
    again, _ = generate(runner, PROMPT, rid="c")
    assert (cached_cold, cached_warm) == (0, len(PROMPT) - 1)
    if scheme == "fp16":
        assert warm == cold  # the same K/V, the same last-token forward
    assert again == warm  # the same cached state gives the same output every time
    release_all(runner)
    pc.close()


def test_a_shared_start_is_a_partial_hit_and_output_equals_cold(model):
    runner = ModelRunner(model, parse_scheme("fp16"), prefix=open_cache("fp16"))
    generate(runner, PROMPT, rid="a")
    other = PROMPT[:25] + [7, 8, 9, 10, 11]
    warm, cached = generate(runner, other, rid="b")
    cold, _ = generate(ModelRunner(model, parse_scheme("fp16")), other, rid="b")
    assert cached == 25 and warm == cold


def test_the_next_chat_turn_finds_prompt_and_reply_cached(model):
    runner = ModelRunner(model, parse_scheme("fp16"), prefix=open_cache("fp16"))
    reply, _ = generate(runner, PROMPT, n=6, rid="t1")
    turn2 = PROMPT + reply + [3, 1, 4, 1, 5]
    warm, cached = generate(runner, turn2, rid="t2")
    assert cached == len(PROMPT) + len(reply) - 1  # the last sampled token was never fed
    cold, _ = generate(ModelRunner(model, parse_scheme("fp16")), turn2, rid="t2")
    assert warm == cold


def test_a_reply_ended_beside_a_longer_one_is_cached_whole(model):
    """A row that ends while another decodes on was fed its last token by the step queued
    ahead, so its next turn finds the whole reply cached (the lone request above was not)."""
    runner = ModelRunner(model, parse_scheme("fp16"), prefix=open_cache("fp16"))
    other = [(7 * i) % 251 + 1 for i in range(36)]
    requests = [Request(list(PROMPT), SamplingParams(max_tokens=5, temperature=0.0), request_id="a"),
                Request(other, SamplingParams(max_tokens=12, temperature=0.0), request_id="b")]
    reply = drive(runner, requests, prefill=64, step_tokens=128).tokens["a"]
    turn2 = PROMPT + reply + [3, 1, 4, 1, 5]
    warm, cached = generate(runner, turn2, rid="a2")
    assert cached == len(PROMPT) + len(reply)
    cold, _ = generate(ModelRunner(model, parse_scheme("fp16")), turn2, rid="a2")
    assert warm == cold


@pytest.mark.parametrize("scheme", ["fp16", "affine4", "turbo0v4"])
def test_after_a_restart_the_ssd_tier_gives_the_ram_hit_output(model, scheme, tmp_path):
    pc = open_cache(scheme, tmp_path)
    runner = ModelRunner(model, parse_scheme(scheme), prefix=pc)
    cold, _ = generate(runner, PROMPT, rid="a")
    from_ram, _ = generate(runner, PROMPT, rid="b")
    assert pc.close()  # every queued write is on disk
    restarted = open_cache(scheme, tmp_path)
    assert restarted.stats()["disk_entries"] >= 1
    runner = ModelRunner(model, parse_scheme(scheme), prefix=restarted)
    from_disk, cached = generate(runner, PROMPT, rid="c")
    assert cached == len(PROMPT) - 1 and restarted.stats()["disk_hits"] == 1
    assert from_disk == from_ram
    if scheme == "fp16":
        assert from_disk == cold
    restarted.close()


def test_batched_prefill_offers_every_prompt(model):
    """Whole prompts prefilled together are each inserted, and each hit afterwards."""
    pc = open_cache("fp16")
    runner = ModelRunner(model, parse_scheme("fp16"), prefix=pc)
    prompts = [PROMPT[:30], [5] + PROMPT[:29], [6] + PROMPT[:28]]
    requests = [Request(list(p), SamplingParams(max_tokens=3, temperature=0.0), request_id=f"p{i}")
                for i, p in enumerate(prompts)]
    first = drive(runner, requests, step_tokens=96, prefill=32).tokens
    assert pc.stats()["inserts"] >= 3
    for i, p in enumerate(prompts):
        tokens, cached = generate(runner, p, n=3, rid=f"q{i}")
        assert cached == len(p) - 1 and tokens == first[f"p{i}"]


def test_the_scheduler_sees_cached_tokens_as_computed(model):
    pc = open_cache("fp16")
    runner = ModelRunner(model, parse_scheme("fp16"), prefix=pc)
    generate(runner, PROMPT, rid="a")
    s = Scheduler(max_running=2, prefill_step_size=16, max_waiting=2)
    r = Request(list(PROMPT), SamplingParams(max_tokens=2, temperature=0.0), request_id="b")
    s.add(r)
    plan = s.schedule()
    assert plan.describe() == {"prefill": [("b", 16)], "decode": []}
    result = runner.execute(plan)
    s.commit(result)
    assert result.cached == {"b": 39} and result.prefilled == {"b": 40}
    assert (r.num_computed, r.num_generated, r.num_prefix_cached) == (40, 1, 39)
