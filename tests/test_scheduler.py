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
