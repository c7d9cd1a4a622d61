"""Per-request sampling inside one batch, n > 1 choices and preemption, on a tiny random llama.

References are computed without any cache: a full forward over prompt + generated tokens
at every step, so they share no code with the runner beyond the model itself.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from servers import random_llama
from stepping import drive

from kvserve.cache import PromptCache, parse_scheme
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner

PROMPTS = [[(11 * i + 5 * j) % 251 + 1 for j in range(4 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return random_llama(97)


def reference_logits(model, tokens: list[int]) -> mx.array:
    """The last position's logits over an fp16 cache, as the runner computes them (K/V stored
    as 16-bit floats: without a cache they would differ by that rounding, ~4e-4 here)."""
    cache = PromptCache.for_model(model, "fp16")
    return model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)  # (V,)


def reference_greedy(model, prompt: list[int], n: int, bias: dict[int, float] | None = None,
                     presence: float = 0.0, frequency: float = 0.0) -> list[int]:
    """OpenAI's definitions, spelled out: logit - count * frequency - (count > 0) * presence + bias."""
    out: list[int] = []
    for _ in range(n):
        logits = reference_logits(model, prompt + out).tolist()
        for token, value in (bias or {}).items():
            logits[token] += value
        for token in set(out):
            logits[token] -= out.count(token) * frequency + presence
        out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


def run(model, params: list[SamplingParams], scheme: str = "fp16", **kwargs):
    requests = [Request(list(p), q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(PROMPTS, params))]
    return drive(ModelRunner(model, parse_scheme(scheme)), requests, **kwargs)


def test_penalties_and_bias_follow_openai_inside_a_mixed_batch(model):
    favourite = reference_greedy(model, PROMPTS[1], 1)[0]
    params = [SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((favourite, -100.0), (7, 3.0))),
              SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=2.0),
              SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=2.0),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((9, 100.0),))]
    got = run(model, params).tokens
    assert got["r0"] == reference_greedy(model, PROMPTS[0], 10)
    assert got["r1"] == reference_greedy(model, PROMPTS[1], 10, bias={favourite: -100.0, 7: 3.0})
    assert favourite not in got["r1"]
    assert got["r2"] == reference_greedy(model, PROMPTS[2], 10, frequency=2.0)
    assert got["r3"] == reference_greedy(model, PROMPTS[3], 10, presence=2.0)
    assert got["r4"] == [9] * 10  # +100 dominates every logit


def test_biased_rows_decode_ahead_like_the_reference(model):
    """Without penalties the batch decodes one step ahead; a bias needs no counts."""
    favourite = reference_greedy(model, PROMPTS[1], 1)[0]
    params = [SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias=((favourite, -100.0), (7, 3.0)))]
    got = run(model, params).tokens
    assert got["r0"] == reference_greedy(model, PROMPTS[0], 10)
    assert got["r1"] == reference_greedy(model, PROMPTS[1], 10, bias={favourite: -100.0, 7: 3.0})


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature(model):
    params = [SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=1),
              SamplingParams(max_tokens=8, temperature=1.5, min_p=1.0, seed=2),
              SamplingParams(max_tokens=8, temperature=0.0)]
    got = run(model, params).tokens
    for i in range(3):
        assert got[f"r{i}"] == reference_greedy(model, PROMPTS[i], 8)


def test_top_k_keeps_samples_inside_the_k_most_likely(model):
    params = [SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=s) for s in range(6)]
    requests = [Request(list(PROMPTS[0]), q, request_id=f"r{i}") for i, q in enumerate(params)]
    got = drive(ModelRunner(model, parse_scheme("fp16")), requests).tokens
    top3 = set(mx.argsort(-reference_logits(model, PROMPTS[0]))[:3].tolist())
    assert {t[0] for t in got.values()} <= top3


def test_logprobs_are_the_model_distribution_with_sorted_alternatives(model):
    params = [SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=4),
              SamplingParams(max_tokens=5, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=True)]
    trace = run(model, params)
    assert trace.logprobs["r1"] == []  # not asked, not computed
    for rid, prompt in (("r0", PROMPTS[0]), ("r2", PROMPTS[2])):
        tokens, records = trace.tokens[rid], trace.logprobs[rid]
        assert [r.token for r in records] == tokens
        for step, record in enumerate(records):
            logits = reference_logits(model, prompt + tokens[:step])
            expected = (logits - mx.logsumexp(logits)).tolist()
            assert record.logprob == pytest.approx(expected[record.token], abs=1e-4)
            if rid == "r0":
                best = sorted(range(len(expected)), key=lambda t: -expected[t])[:4]
                assert [t for t, _ in record.top] == best
                assert [lp for _, lp in record.top] == pytest.approx([expected[t] for t in best], abs=1e-4)
                assert record.top[0][0] == record.token  # greedy picks the most likely
            else:
                assert record.top == ()


def test_n_choices_share_one_prefill_and_match_separate_requests(model):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=40)
    leader = Request(list(PROMPTS[3]), params, request_id="lead")
    for i in (1, 2):
        leader.forks.append(Request(list(PROMPTS[3]), SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i),
                                    request_id=f"fork{i}", fork_of="lead"))
    runner = ModelRunner(model, parse_scheme("fp16"))
    trace = drive(runner, [leader], prefill=8)
    prefill_steps = len(trace.sizes) - 5  # 6 tokens: the first from the prefill, 5 decode steps
    assert prefill_steps == -(-len(PROMPTS[3]) // 8)  # one prompt's chunks, not three
    assert trace.sizes[-5:] == [3] * 5
    for rid, seed in (("lead", 40), ("fork1", 41), ("fork2", 42)):
        alone = drive(ModelRunner(model, parse_scheme("fp16")),
                      [Request(list(PROMPTS[3]), SamplingParams(max_tokens=6, temperature=1.0, seed=seed),
                               request_id=rid)]).tokens[rid]
        assert trace.tokens[rid] == alone
    assert len({tuple(t) for t in trace.tokens.values()}) == 3
    assert runner.kv_bytes == 0 and runner.live_requests == 0


@pytest.mark.parametrize("scheme", ["fp16", "affine4", "turbo0v4"])
def test_preempted_requests_resume_with_identical_output(model, scheme, tmp_path):
    params = [SamplingParams(max_tokens=24, temperature=0.0) for _ in range(4)] + \
             [SamplingParams(max_tokens=24, temperature=0.8, seed=9 + i) for i in range(2)]
    free = run(model, params, scheme, step_tokens=64, prefill=32)
    runner = ModelRunner(model, parse_scheme(scheme), swap_dir=tmp_path)
    requests = [Request(list(p), q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(PROMPTS, params))]
    tight = drive(runner, requests, step_tokens=64, prefill=32, max_kv_tokens=150)
    assert tight.tokens == free.tokens
    outs = [rid for kind, rid in tight.swaps if kind == "out"]
    assert outs and sorted(outs) == sorted(rid for kind, rid in tight.swaps if kind == "in")
    assert runner.kv_bytes == 0 and runner.swapped_requests == 0
    runner.close()
    assert list(tmp_path.iterdir()) == []
