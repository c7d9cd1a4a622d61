"""Speculative decoding through the real server: with ``--speculative ngram`` on the real
model (SmolLM2-135M-Instruct), and with ``--speculative draft`` on a tiny model padded with
layers that add nothing, drafted by the tiny model itself (no smaller model with the real
model's tokenizer ships on PyPI), a server answers exactly what one without speculation
answers, streamed or not, greedy or seeded, with stop strings and max_tokens, and counts
its proposals. The servers run in the test process (``tests/inprocess.py``): the replies and
the counters are what is checked, not the process.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest
from archs import make_padded_model, make_tiny_model, prompt_tokens
from inprocess import InProcessServer
from servers import on_gpu

TEXT = (Path(__file__).resolve().parents[1] / "server/engine/data/eval-gpl-3.0.txt").read_text().split()
PASSAGES = [" ".join(TEXT[200 + 150 * i : 200 + 150 * i + 120]) for i in range(4)]


def copy_prompt(passage: str, label: str = "Text") -> str:
    """The model copies the passage back: prompt lookup guesses most of its tokens."""
    return f"{label}:\n\n{passage}\n\nThe same text again:\n\n{' '.join(passage.split()[:6])}"


@pytest.fixture(scope="module")
def servers(default_model_dir, tmp_path_factory):
    started = {}
    for mode in ("off", "ngram"):
        cache = tmp_path_factory.mktemp(f"spec-{mode}")
        started[mode] = InProcessServer(default_model_dir, "--cache-dir", str(cache), "--speculative", mode,
                                        "--prompt-cache-disk-gb", "0", "--max-batch-size", "4")
    for proc in started.values():
        proc.wait_ready()
    yield started
    for proc in started.values():
        assert proc.stop() == 0, proc.output()


def complete(server, **body):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    return client.completions.create(model="default", **body)


def counters(server) -> dict[str, float]:
    lines = httpx.get(f"{server.base_url}/metrics").text.splitlines()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("kvserve_speculative_")}


def test_four_concurrent_copies_equal_the_server_without_speculation(servers):
    def run(mode: str) -> list:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda p: complete(servers[mode], prompt=copy_prompt(p), max_tokens=60,
                                                    temperature=0), PASSAGES))

    before = counters(servers["ngram"])
    plain, spec = run("off"), run("ngram")
    after = counters(servers["ngram"])
    assert [c.choices[0].text for c in spec] == [c.choices[0].text for c in plain]
    assert [c.usage.completion_tokens for c in spec] == [c.usage.completion_tokens for c in plain]
    accepted = after["kvserve_speculative_accepted_tokens_total"] - before["kvserve_speculative_accepted_tokens_total"]
    proposed = after["kvserve_speculative_proposed_tokens_total"] - before["kvserve_speculative_proposed_tokens_total"]
    assert 0 < accepted <= proposed
    assert all(k not in counters(servers["off"]) or v == 0 for k, v in counters(servers["off"]).items())


def test_a_stop_string_inside_accepted_tokens_ends_the_reply_there(servers):
    """Several tokens arrive in one step; a stop string among them ends the reply at it and
    the tokens after it are neither sent nor counted."""
    passage = PASSAGES[0]
    stop = " ".join(passage.split()[14:16])
    replies = [complete(servers[m], prompt=copy_prompt(passage), max_tokens=60, temperature=0, stop=[stop])
               for m in ("off", "ngram")]
    assert replies[0].choices[0].finish_reason == "stop"
    assert replies[1].choices[0].text == replies[0].choices[0].text
    assert replies[1].usage.completion_tokens == replies[0].usage.completion_tokens


# Seeded sampling through verification equals plain decoding bit for bit on the CPU. On a GPU a
# verified position's logits round differently from a decoded one's (another product shape), so
# a seeded sample can part after a near-tie (seen on an H100 with prompt lookup and with a draft).
ON_CPU_ONLY = pytest.mark.skipif(on_gpu(), reason="on a GPU a verified position's logits round differently "
                                 "from a decoded one's, so seeded samples part after a near-tie; "
                                 "docs/benchmarks/gpu-serve.md")


@ON_CPU_ONLY
def test_seeded_sampled_streams_equal_the_server_without_speculation(servers):
    """A prompt no other test sent, from its first token: neither server has a prefix of it
    cached. (An earlier test's four concurrent prompts may be prefilled together in one
    server and apart in the other, as they happen to arrive; a prefix hit on those caches
    would then differ in rounding between the servers, and a seeded sample after a near-tie
    with it: that is not what this test is about.)"""
    def stream(mode: str) -> str:
        chunks = complete(servers[mode], prompt=copy_prompt(PASSAGES[1], label="Passage"), max_tokens=40,
                          temperature=0.8, seed=7, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    assert stream("ngram") == stream("off")


# ---- a draft model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafted(default_model_dir, tmp_path_factory):
    """Two servers of a tiny llama padded with 30 layers that add nothing: one plain, one
    drafted by the unpadded tiny llama (same outputs, a fraction of the cost per token).
    The draft's cost is pinned: measured at start-up on a busy machine it can come out high
    enough that no row proposes, and what is verified must not depend on the machine."""
    root = tmp_path_factory.mktemp("drafted")
    target = make_padded_model("llama", 30, root / "target", default_model_dir, seed=1)
    draft = make_tiny_model("llama", root / "draft", default_model_dir, seed=1)
    pinned = root / "draft.toml"
    pinned.write_text("[engine]\ndraft_cost = 0.1\n")
    started = {mode: InProcessServer(target, "--cache-dir", str(root / mode), "--prompt-cache-disk-gb", "0",
                                     "--max-batch-size", "4", *args)
               for mode, args in (("off", ()), ("draft", ("--speculative", "draft", "--draft-model", str(draft),
                                                          "--config", str(pinned))))}
    for proc in started.values():
        proc.wait_ready()
    yield started
    for proc in started.values():
        assert proc.stop() == 0, proc.output()


def _draft_counts(server) -> tuple[float, float]:
    c = counters(server)
    return c["kvserve_speculative_proposed_tokens_total"], c["kvserve_speculative_accepted_tokens_total"]


def _text(server, body) -> str:
    reply = complete(server, **body)
    return "".join(c.choices[0].text for c in reply if c.choices) if body.get("stream") else reply.choices[0].text


def test_a_draft_models_greedy_proposals_leave_the_replies_as_they_were(drafted):
    """One request at a time (where the draft's forwards pay for themselves), then three at
    once: every reply equals the plain server's, and every proposal verified one at a time
    is kept (the draft computes what the target does)."""
    greedy = [dict(prompt=prompt_tokens(20 + i, 12), max_tokens=40, temperature=0) for i in range(3)]
    plain = [_text(drafted["off"], b) for b in greedy]
    before = _draft_counts(drafted["draft"])
    assert [_text(drafted["draft"], b) for b in greedy] == plain
    proposed, accepted = (b - a for a, b in zip(before, _draft_counts(drafted["draft"])))
    assert accepted == proposed > 0
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda b: _text(drafted["draft"], b), greedy)) == plain


@ON_CPU_ONLY
def test_a_draft_models_seeded_stream_is_the_plain_servers(drafted):
    body = dict(prompt=prompt_tokens(30, 12), max_tokens=40, temperature=0.9, seed=5, stream=True)
    before = _draft_counts(drafted["draft"])
    assert _text(drafted["draft"], body) == _text(drafted["off"], body)
    assert _draft_counts(drafted["draft"])[0] > before[0]
