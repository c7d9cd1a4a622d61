"""Continuous batching: the scheduler and the runner together, on a tiny random-weight llama.

The model: hidden 64, 2 layers, 4 query heads, 2 KV heads, head_dim 64 (so every quantized
scheme applies), vocab 256. ``drive`` is the engine loop without threads: requests arrive
at given steps, join the decode batch when their prompt completes and leave at max_tokens.
"""

from __future__ import annotations

import pytest
from servers import random_llama

from kvserve.cache import SCHEME_NAMES, parse_scheme
from kvserve.server.engine.request import FinishReason, Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.scheduler import Scheduler, StepPlan
from stepping import drive

# 8 prompts of 3..45 tokens and 8 lengths, so rows join and leave at different steps.
PROMPTS = [[(7 * i + 13 * j) % 251 + 1 for j in range(3 + 6 * i)] for i in range(8)]
MAX_TOKENS = [12, 7, 15, 9, 14, 6, 11, 13]


@pytest.fixture(scope="module")
def model():
    return random_llama(4321)


def make_requests(params: list[SamplingParams]) -> list[Request]:
    return [Request(list(p), q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(PROMPTS, params))]


def alone(model, scheme: str, requests: list[Request]) -> dict[str, list[int]]:
    out = {}
    for r in requests:
        fresh = Request(list(r.prompt_tokens), r.params, request_id=r.request_id)
        out.update(drive(ModelRunner(model, parse_scheme(scheme)), [fresh]).tokens)
    return out


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0) for n in MAX_TOKENS]


# Greedy tokens are identical for every scheme: a row's K/V are encoded from its own tokens
# only (padding excluded), and other rows' slots are masked. Logits differ from the request
# alone by float rounding only (other GEMM shapes, longer masked attention rows).
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_batch_of_8_decodes_like_each_request_alone(model, scheme):
    runner = ModelRunner(model, parse_scheme(scheme))
    trace = drive(runner, make_requests(greedy_params()), step_tokens=96, prefill=32)
    batched, sizes = trace.tokens, trace.sizes
    assert max(sizes) == 8  # all eight decoded together at some step
    assert batched == alone(model, scheme, make_requests(greedy_params()))
    assert [len(batched[f"r{i}"]) for i in range(8)] == MAX_TOKENS
    assert runner.live_requests == 0 and runner.kv_bytes == 0 and runner.batch_rows == ()


def test_staggered_arrivals_join_and_leave_every_step(model):
    """Requests arrive one per step, long prompts prefill in chunks while others decode."""
    runner = ModelRunner(model, parse_scheme("fp16"))
    trace = drive(runner, make_requests(greedy_params()), arrivals=[0, 1, 2, 3, 5, 8, 9, 13],
                  step_tokens=10, prefill=8)
    batched, sizes = trace.tokens, trace.sizes
    assert batched == alone(model, "fp16", make_requests(greedy_params()))
    assert len(set(sizes)) >= 5  # the batch grew and shrank through many sizes


def test_seeded_sampling_reproduces_inside_a_batch(model):
    params = [SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, seed=100 + i)
              for i, n in enumerate(MAX_TOKENS)]
    batched = drive(ModelRunner(model, parse_scheme("fp16")), make_requests(params)).tokens
    assert batched == alone(model, "fp16", make_requests(params))
    assert len({tuple(t) for t in batched.values()}) == 8  # the seeds differ, so do the samples


def test_kv_bytes_follow_rows_joining_and_leaving(model):
    runner = ModelRunner(model, parse_scheme("fp16"))
    a, b = make_requests(greedy_params())[:2]
    scheduler = Scheduler(max_running=2, prefill_step_size=64, max_waiting=4)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.commit(runner.execute(scheduler.schedule()))
    assert runner.batch_rows == ("r0", "r1")
    # fp16 rows of 256 slots: 2 layers * (K + V) * 2 KV heads * 64 dims * 2 bytes (16-bit floats,
    # though the model computes in float32 here)
    per_slot = 2 * 2 * 2 * 64 * 2
    assert runner.kv_bytes == 2 * 256 * per_slot
    scheduler.finish(a, FinishReason.ABORT)
    runner.release("r0")
    assert runner.batch_rows == ("r1",) and runner.kv_bytes == 256 * per_slot
    runner.release("r1")
    assert runner.kv_bytes == 0 and runner.live_requests == 0


def test_rows_a_plan_skips_are_parked_and_rejoin(model):
    """The runner follows any plan: a decoding request left out of a step keeps its cache."""
    requests = make_requests(greedy_params())[:2]
    runner = ModelRunner(model, parse_scheme("fp16"))
    scheduler = Scheduler(max_running=2, prefill_step_size=64, max_waiting=4)
    for r in requests:
        scheduler.add(r)
    out = {r.request_id: [] for r in requests}
    plans = [scheduler.schedule(), StepPlan(decode=(requests[1],)), StepPlan(decode=tuple(requests))]
    for plan in plans + [StepPlan(decode=tuple(requests))] * 3:
        result = runner.execute(plan)
        scheduler.commit(result)
        for request_id, token in result.sampled.items():
            out[request_id].append(token)
    expected = alone(model, "fp16", make_requests([SamplingParams(max_tokens=n, temperature=0.0)
                                                   for n in (5, 6)] + greedy_params()[2:]))
    assert out == {"r0": expected["r0"], "r1": expected["r1"]}


def test_each_decode_step_is_queued_by_the_step_before():
    """Decoding runs one step ahead: the forward that computes a step's tokens is issued
    by the step before, before its own tokens are read; the step that ends every row (by
    max_tokens) queues nothing. Recorded as the (B, L) token shapes the model embeds."""
    import mlx.nn as nn

    model, shapes = random_llama(4321), []

    class Recording(nn.Embedding):
        def __call__(self, x):
            shapes.append(tuple(x.shape))
            return super().__call__(x)

    recording = Recording(*model.model.embed_tokens.weight.shape)
    recording.weight = model.model.embed_tokens.weight
    model.model.embed_tokens = recording
    requests = make_requests([SamplingParams(max_tokens=4, temperature=0.0)] * 5)[3:5]  # 21, 27 tokens
    runner = ModelRunner(model, parse_scheme("affine4"))
    scheduler = Scheduler(max_running=2, prefill_step_size=64, max_waiting=4)
    for r in requests:
        scheduler.add(r)
    per_step, out = [], {r.request_id: [] for r in requests}
    while scheduler.has_work:
        shapes.clear()
        result = runner.execute(scheduler.schedule())
        scheduler.commit(result)
        per_step.append(list(shapes))
        for request_id, token in result.sampled.items():
            out[request_id].append(token)
            if scheduler.find(request_id).num_generated == 4:
                scheduler.finish(scheduler.find(request_id), FinishReason.LENGTH)
                runner.release(request_id)
    # Step 1 prefills both prompts in one padded forward and queues step 2's decode.
    assert per_step == [[(2, 27), (2, 1)], [(2, 1)], [(2, 1)], []]
    assert out == alone(random_llama(4321), "affine4", requests)


# A captured decode step (traced once per batch shape, replayed) computes what the eager step
# computes: the same greedy tokens, bit for bit, while rows join, leave and queue ahead. Models
# with layers it does not capture (sliding windows; turbo4's calibrated keys, in the middle two
# of six layers, the others being affine8) step eagerly throughout.
@pytest.mark.parametrize("arch,scheme", [("tiny", "fp16"), ("tiny", "affine4"), ("tiny", "affine8"),
                                         ("tiny", "turbo0v4"), ("tiny", "turbo8v3"), ("six", "turbo4"),
                                         ("qwen3", "affine4"), ("qwen3_moe", "fp16"), ("gemma3_text", "fp16")])
def test_captured_steps_decode_exactly_as_eager_ones(model, arch, scheme):
    from archs import build_model

    net = model if arch == "tiny" else random_llama(4321, layers=6) if arch == "six" else build_model(arch, seed=3)
    arrivals = [0, 1, 2, 3, 5, 8, 9, 13]
    eager = drive(ModelRunner(net, parse_scheme(scheme)), make_requests(greedy_params()),
                  arrivals=arrivals, step_tokens=10, prefill=8).tokens
    runner = ModelRunner(net, parse_scheme(scheme), captured=True)
    captured = drive(runner, make_requests(greedy_params()), arrivals=arrivals, step_tokens=10, prefill=8).tokens
    assert captured == eager
    steps, paths = runner._captured, runner.decode_paths
    assert paths["captured"] == steps.replays and runner.decode_traces == steps.traces
    if arch == "gemma3_text" or scheme == "turbo4":  # windows; calibrated key scales
        assert steps.traces == steps.replays == 0 < paths["eager"]
    else:
        assert steps.replays > 2 * steps.traces > 0  # most steps replayed a trace
