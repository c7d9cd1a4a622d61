"""Step plans as JSON, so every process of a split model runs the plan rank 0 scheduled.

Rank 0 sends a request in full (prompt, sampling parameters, forks) the first time a plan
names it, and from then on only its counters; the other ranks keep a ``Mirror`` of the live
requests and rebuild each ``StepPlan`` from it. Nothing here imports ``mlx``.

    >>> from kvserve.server.engine.request import Request, SamplingParams
    >>> a = Request([1, 2, 3], SamplingParams(temperature=0.0, stop=("x",)), request_id="a")
    >>> sent: set[str] = set()
    >>> msg = plan_message(StepPlan(prefill=(PrefillChunk(a, 3),)), sent)
    >>> msg["prefill"], [r["id"] for r in msg["new"]], msg["counters"]
    ([['a', 3]], ['a'], {'a': [0, 0, 'waiting']})
    >>> mirror = Mirror()
    >>> plan = mirror.plan(json.loads(json.dumps(msg)))
    >>> plan.prefill[0].request.prompt_tokens, plan.prefill[0].request.params == a.params
    ([1, 2, 3], True)
    >>> a.num_computed, a.num_generated = 3, 1
    >>> msg = plan_message(StepPlan(decode=(a,), drafts={"a": 2}), sent)
    >>> msg["new"], msg["decode"], msg["drafts"]
    ([], ['a'], {'a': 2})
    >>> mirror.plan(msg).decode[0].num_generated
    1

A choice (fork) released while its leader runs is marked finished and no longer synced:

    >>> b = Request([4], SamplingParams(), request_id="b")
    >>> b.forks = [Request([4], SamplingParams(), request_id="b2", fork_of="b")]
    >>> mirror.plan(plan_message(StepPlan(prefill=(PrefillChunk(b, 1),)), sent)).prefill[0].request.forks[0].status
    <RequestStatus.WAITING: 'waiting'>
    >>> sent.discard("b2"); mirror.forget("b2")
    >>> msg = plan_message(StepPlan(decode=(b,)), sent)
    >>> sorted(msg["counters"]), mirror.plan(msg).decode[0].forks[0].finished
    (['b'], True)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kvserve.server.engine.grammar import Grammar
from kvserve.server.engine.request import Request, RequestStatus, SamplingParams
from kvserve.server.engine.scheduler import PrefillChunk, StepPlan
from kvserve.server.engine.thinking import ThinkingBudget


def params_to_dict(p: SamplingParams) -> dict[str, Any]:
    """Every sampling field; a grammar as its kind and text, a thinking budget as its fields.

    >>> p = SamplingParams(logit_bias=((5, -1.0),), ignore_eos=True)
    >>> params_from_dict(json.loads(json.dumps(params_to_dict(p))))
    SamplingParams(max_tokens=512, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0, \
frequency_penalty=0.0, logit_bias=((5, -1.0),), seed=None, stop=(), logprobs=False, top_logprobs=0, grammar=None, \
thinking=None, ignore_eos=True)
    >>> budget = SamplingParams(thinking=ThinkingBudget(1024, start=(7,), end=(8, 9), open=True))
    >>> params_from_dict(json.loads(json.dumps(params_to_dict(budget)))) == budget
    True
    """
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    if p.grammar is not None:
        out["grammar"] = {"kind": p.grammar.kind, "text": p.grammar.text}
    if p.thinking is not None:
        out["thinking"] = dataclasses.asdict(p.thinking)
    return out


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    d = dict(d)
    d["logit_bias"] = tuple((int(t), float(b)) for t, b in d["logit_bias"])
    d["stop"] = tuple(d["stop"])
    if d["grammar"] is not None:
        d["grammar"] = Grammar(**d["grammar"])
    if d.get("thinking") is not None:
        t = d["thinking"]
        d["thinking"] = ThinkingBudget(t["budget"], tuple(t["start"]), tuple(t["end"]), t["open"])
    return SamplingParams(**d)


def _counters(r: Request) -> list:
    return [r.num_computed, r.num_generated, r.status.value]


def _full(r: Request) -> dict[str, Any]:
    return {"id": r.request_id, "prompt": r.prompt_tokens, "params": params_to_dict(r.params),
            "boundaries": list(r.boundaries), "forks": [_full(f) for f in r.forks]}


def plan_message(plan: StepPlan, sent: set[str]) -> dict[str, Any]:
    """What the other ranks need to run ``plan``: requests they have not seen (added to
    ``sent``) and the counters of every request the plan names, forks included."""
    named = [c.request for c in plan.prefill] + list(plan.decode) + list(plan.swap_out) + list(plan.swap_in)
    new = []
    for r in named:
        if r.request_id not in sent:
            new.append(_full(r))
            sent.update(m.request_id for m in (r, *r.forks))
    # Released requests (a finished choice of a request still running) are no longer sent.
    counters = {m.request_id: _counters(m) for r in named for m in (r, *r.forks) if m.request_id in sent}
    return {"new": new, "counters": counters,
            "prefill": [[c.request.request_id, c.num_tokens] for c in plan.prefill],
            "decode": [r.request_id for r in plan.decode],
            "swap_out": [r.request_id for r in plan.swap_out],
            "swap_in": [r.request_id for r in plan.swap_in],
            "drafts": dict(plan.drafts)}


class Mirror:
    """The live requests as rank 0 last described them (ranks other than 0 keep one)."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def plan(self, msg: dict[str, Any]) -> StepPlan:
        """The ``StepPlan`` a ``plan_message`` describes, its requests' counters updated."""
        for full in msg["new"]:
            self._add(full)
        for rid, (computed, generated, status) in msg["counters"].items():
            r = self.requests[rid]
            r.num_computed, r.num_generated, r.status = computed, generated, RequestStatus(status)
        get = self.requests.__getitem__
        return StepPlan(prefill=tuple(PrefillChunk(get(rid), n) for rid, n in msg["prefill"]),
                        decode=tuple(map(get, msg["decode"])), swap_out=tuple(map(get, msg["swap_out"])),
                        swap_in=tuple(map(get, msg["swap_in"])), drafts=dict(msg["drafts"]))

    def forget(self, request_id: str) -> None:
        """A released request: marked finished (its leader, still running, may list it among
        its forks) and no longer looked up."""
        r = self.requests.pop(request_id, None)
        if r is not None:
            r.status = RequestStatus.FINISHED

    def _add(self, full: dict[str, Any], leader: str | None = None) -> Request:
        r = Request(list(full["prompt"]), params_from_dict(full["params"]), request_id=full["id"], fork_of=leader,
                    boundaries=tuple(full["boundaries"]))
        r.forks = [self._add(f, r.request_id) for f in full["forks"]]
        self.requests[r.request_id] = r
        return r
