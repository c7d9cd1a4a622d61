"""The engine loop without threads or text: requests arrive at given steps, the scheduler
plans, the runner executes, requests leave at ``max_tokens``. Used by the batching tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.server.engine.request import FinishReason, Request, TokenLogprob
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.scheduler import Scheduler


@dataclass
class Trace:
    tokens: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # decode batch size per step
    swaps: list[tuple[str, str]] = field(default_factory=list)  # ("out" | "in", request id)
    proposed: int = 0  # speculative tokens verified
    accepted: int = 0  # of those, kept


def drive(runner: ModelRunner, requests: list[Request], arrivals: list[int] | None = None,
          step_tokens: int = 24, prefill: int = 16, max_kv_tokens: int | None = None,
          max_running: int = 8, draft_tokens: int = 0) -> Trace:
    """Run requests (and their forks) to max_tokens; returns what each sampled (proposals
    the runner accepted, then its sampled token, per step)."""
    scheduler = Scheduler(max_running=max_running, prefill_step_size=prefill, max_waiting=16,
                          max_step_tokens=step_tokens, max_kv_tokens=max_kv_tokens,
                          max_draft_tokens=draft_tokens)
    pending = list(zip(arrivals or [0] * len(requests), requests))
    members = [m for r in requests for m in (r, *r.forks)]
    trace = Trace({m.request_id: [] for m in members}, {m.request_id: [] for m in members})
    step = 0
    while pending or scheduler.has_work:
        for item in [p for p in pending if p[0] <= step]:
            scheduler.add(item[1])
            pending.remove(item)
        plan = scheduler.schedule()
        step += 1
        if plan.empty:
            continue
        assert plan.num_tokens <= step_tokens
        result = runner.execute(plan)
        scheduler.commit(result)
        trace.sizes.append(len(plan.decode))
        trace.swaps += [("out", r.request_id) for r in plan.swap_out]
        trace.swaps += [("in", r.request_id) for r in plan.swap_in]
        trace.proposed += sum(result.proposed.values())
        trace.accepted += sum(len(a) for a in result.accepted.values())
        for request_id, token in result.sampled.items():
            trace.tokens[request_id].extend((*result.accepted.get(request_id, ()), token))
            if request_id in result.logprobs:
                trace.logprobs[request_id].append(result.logprobs[request_id])
            request = scheduler.find(request_id)
            if request.num_generated >= request.params.max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
                runner.release(request_id, keep=True)  # as the engine does at a finish
    return trace
