"""The scheduler is pure policy: exact plans, and no mlx import."""

import subprocess
import sys

import pytest

from kvserve.server.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from kvserve.server.engine.scheduler import QueueFull, Scheduler, StepResult


def _request(n_prompt: int, max_tokens: int = 4) -> Request:
    return Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_imports_without_mlx():
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"
        "import kvserve.server.engine.scheduler, kvserve.server.engine.loop\n"
        "import kvserve.server.http.app\n"
        "assert 'mlx_lm' not in sys.modules\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_chunked_prefill_then_decode():
    s = Scheduler(max_running=1, prefill_step_size=4, max_waiting=4)
    r = _request(10)
    s.add(r)
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        assert plan.decode == ()
        (chunk,) = plan.prefill
        chunks.append((chunk.num_tokens, chunk.completes_prompt))
        sampled = {r.request_id: 7} if chunk.completes_prompt else {}
        s.commit(StepResult(prefilled={r.request_id: chunk.num_tokens}, sampled=sampled))
    assert chunks == [(4, False), (4, False), (2, True)]
    assert (r.status, r.num_computed, r.num_generated) == (RequestStatus.DECODE, 10, 1)
    plan = s.schedule()
    assert plan.prefill == () and plan.decode == (r,)


def test_fifo_admission_and_finish():
    s = Scheduler(max_running=1, prefill_step_size=8, max_waiting=2)
    a, b = _request(3), _request(3)
    s.add(a)
    s.add(b)
    assert [c.request for c in s.schedule().prefill] == [a]
    assert list(s.waiting) == [b]
    s.finish(a, FinishReason.LENGTH)
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED, FinishReason.LENGTH)
    assert [c.request for c in s.schedule().prefill] == [b]
    s.finish(b, FinishReason.ABORT)
    assert not s.has_work and s.schedule().empty


def test_waiting_queue_is_bounded():
    s = Scheduler(max_running=1, prefill_step_size=8, max_waiting=2)
    s.add(_request(1))
    s.add(_request(1))
    with pytest.raises(QueueFull):
        s.add(_request(1))


def test_abort_of_waiting_request():
    s = Scheduler(max_running=1, prefill_step_size=8, max_waiting=4)
    a, b = _request(2), _request(2)
    s.add(a)
    s.add(b)
    s.schedule()
    assert s.find(b.request_id) is b
    s.finish(b, FinishReason.ABORT)
    assert s.find(b.request_id) is None and list(s.waiting) == []


def _named(name: str, n_prompt: int) -> Request:
    return Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4), request_id=name)


def test_budget_goes_to_decodes_first_then_fifo_prompt_chunks():
    s = Scheduler(max_running=3, prefill_step_size=4, max_waiting=4, max_step_tokens=6)
    a, b, c, d = _named("a", 2), _named("b", 9), _named("c", 5), _named("d", 1)
    for r in (a, b, c, d):
        s.add(r)
    steps = []
    results = [
        StepResult(prefilled={"a": 2, "b": 4}, sampled={"a": 1}),
        StepResult(prefilled={"b": 4, "c": 1}, sampled={"a": 1}),
        StepResult(prefilled={"b": 1, "c": 4}, sampled={"a": 1, "b": 1, "c": 1}),
    ]
    for result in results:
        steps.append(s.schedule().describe())
        s.commit(result)
    assert steps == [
        {"prefill": [("a", 2), ("b", 4)], "decode": []},  # c gets nothing: budget spent
        {"prefill": [("b", 4), ("c", 1)], "decode": ["a"]},  # 1 decode + 5 prompt tokens
        {"prefill": [("b", 1), ("c", 4)], "decode": ["a"]},  # both prompts complete
    ]
    assert list(s.waiting) == [d]  # max_running = 3
    assert s.schedule().describe() == {"prefill": [], "decode": ["a", "b", "c"]}
    s.finish(a, FinishReason.STOP)  # a leaves, d is admitted and prefilled next to the decodes
    plan = s.schedule()
    assert plan.describe() == {"prefill": [("d", 1)], "decode": ["b", "c"]} and plan.num_tokens == 3


def test_a_long_prompt_never_takes_more_than_the_budget_left_by_decodes():
    s = Scheduler(max_running=4, prefill_step_size=256, max_waiting=4, max_step_tokens=16)
    streams = [_named(f"s{i}", 2) for i in range(3)]
    for r in streams:
        s.add(r)
    s.schedule()
    s.commit(StepResult(prefilled={r.request_id: 2 for r in streams},
                        sampled={r.request_id: 1 for r in streams}))
    long = _named("long", 1000)
    s.add(long)
    plan = s.schedule()
    assert plan.describe() == {"prefill": [("long", 13)], "decode": ["s0", "s1", "s2"]}
    assert plan.num_tokens == 16


def test_step_budget_must_fit_every_decoding_request():
    with pytest.raises(ValueError):
        Scheduler(max_running=8, prefill_step_size=4, max_waiting=4, max_step_tokens=7)
    assert Scheduler(max_running=2, prefill_step_size=4, max_waiting=4).max_step_tokens == 4


def test_engine_config_defaults_batch_eight():
    from kvserve.configs import ConfigError, EngineConfig

    assert (EngineConfig().max_batch_size, EngineConfig().max_step_tokens) == (8, None)  # the device's
    assert EngineConfig().step_sizes(256) == (256, 256)
    assert EngineConfig(prefill_step_size=4).max_step_tokens == 8  # room for every decode
    with pytest.raises(ConfigError):
        EngineConfig(max_batch_size=8, max_step_tokens=4)
