"""Speculative decoding inside the continuous batch, on tiny random models, with both
proposers: prompt lookup (``ngram``) and a draft model (``draft``: the target with its
weights perturbed by 1% of their spread, so it agrees with the target often, not always).

Greedy rows must give exactly the tokens of a run without speculation, alone and in a batch
of 8, in every scheme family, with sliding windows and with recurrent states; sampled rows
must keep the model's distribution (a chi-square test of the acceptance rule) and give the
same tokens alone and batched; the rejected tokens leave every layer, the target's and the
draft's, in its own class and scheme.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from archs import build_model, prompt_tokens
from mlx.utils import tree_flatten, tree_unflatten

from kvserve.cache import parse_scheme
from kvserve.server.engine.draft import DraftProposer
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.sampler import RequestSampler
from kvserve.server.engine.scheduler import Scheduler
from kvserve.server.engine.speculation import NgramProposer
from stepping import drive

PROPOSERS = ["ngram", "draft"]

# Prompts that repeat a stretch and end inside its repeat, so prompt lookup guesses from the
# first decode step; the model follows some guesses (and its own loops) and not others.
_BASES = [prompt_tokens(i, 6 + 2 * i) for i in range(8)]
PROMPTS = [b * 2 + b[: 2 + i % 3] for i, b in enumerate(_BASES)]
MAX_TOKENS = [24, 17, 30, 19, 28, 16, 21, 26]


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=1)  # attention with spread: varied greedy output


def requests(params: list[SamplingParams], prompts=PROMPTS) -> list[Request]:
    return [Request(list(p), q, request_id=f"r{i}") for i, (p, q) in enumerate(zip(prompts, params))]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0.0) for n in MAX_TOKENS]


_DRAFTS: dict[int, tuple] = {}


def draft_of(model, noise: float = 0.01, seed: int = 7):
    """The target's class and weights, each weight plus ``noise`` times its spread of
    Gaussian noise: a draft that proposes what the target would, mostly."""
    if id(model) not in _DRAFTS:
        draft = type(model)(model.args)
        mx.random.seed(seed)
        draft.update(tree_unflatten([(k, v + noise * mx.std(v) * mx.random.normal(v.shape).astype(v.dtype))
                                     for k, v in tree_flatten(model.parameters())]))
        mx.eval(draft.parameters())
        _DRAFTS[id(model)] = (model, draft)  # the model too: its id stays its own
    return _DRAFTS[id(model)][1]


def proposer(mode: str, model, scheme: str):
    if mode == "off":
        return None
    if mode == "ngram":
        return NgramProposer()
    return DraftProposer(draft_of(model), parse_scheme(scheme), cost=0.0)


def runner_for(model, scheme: str, mode: str = "ngram", captured: bool = False) -> ModelRunner:
    """A runner that verifies every guess (positions cost nothing), so that these tests
    exercise verification whatever the batch; ``test_the_cost_model_*`` covers the choice."""
    runner = ModelRunner(model, parse_scheme(scheme), proposer=proposer(mode, model, scheme), captured=captured)
    if runner.speculation is not None:
        runner.speculation.position_cost = lambda rows: 0.0
    return runner


def run(model, scheme: str, reqs: list[Request], mode: str, alone: bool = False, **kw):
    """Tokens of each request, and the trace totals (proposed, accepted); ``mode``: off,
    ngram or draft."""
    draft = 0 if mode == "off" else 4
    kw.setdefault("step_tokens", 48)  # every row's 1 + 4 fit: proposals never depend on the batch
    if not alone:
        trace = drive(runner_for(model, scheme, mode), reqs, draft_tokens=draft, **kw)
        return trace.tokens, (trace.proposed, trace.accepted)
    out, totals = {}, [0, 0]
    for r in reqs:
        fresh = Request(list(r.prompt_tokens), r.params, request_id=r.request_id)
        trace = drive(runner_for(model, scheme, mode), [fresh], draft_tokens=draft, **kw)
        out.update(trace.tokens)
        totals = [totals[0] + trace.proposed, totals[1] + trace.accepted]
    return out, tuple(totals)


@pytest.mark.parametrize("mode", PROPOSERS)
@pytest.mark.parametrize("scheme", ["fp16", "affine4", "turbo0v4", "mxfp4"])
def test_greedy_tokens_equal_a_run_without_speculation(model, scheme, mode):
    plain, _ = run(model, scheme, requests(greedy_params()), "off")
    batched, (proposed, accepted) = run(model, scheme, requests(greedy_params()), mode)
    lone, _ = run(model, scheme, requests(greedy_params()), mode, alone=True)
    assert batched == plain == lone
    assert [len(batched[f"r{i}"]) for i in range(8)] == MAX_TOKENS
    # Both outcomes happen: proposals kept and proposals rejected.
    assert 0 < accepted < proposed


def test_captured_steps_speculate_exactly(model):
    """Verify steps run eagerly between captured decode steps (trimming rows, rolling their
    slots): the tokens stay those of a run without either. (Prompt lookup leaves steps
    without proposals, which are captured; a free draft proposes at every step.)"""
    plain, _ = run(model, "affine4", requests(greedy_params()), "off")
    runner = runner_for(model, "affine4", "ngram", captured=True)
    trace = drive(runner, requests(greedy_params()), draft_tokens=4, step_tokens=48)
    assert trace.tokens == plain
    assert 0 < trace.accepted < trace.proposed and runner._captured.replays > 0


def _speculates_exactly(arch: str, seed: int, mode: str) -> None:
    model = build_model(arch, seed=seed)
    base = prompt_tokens(7, 10)
    prompts = [(base * 6)[: 30 + 7 * i] for i in range(4)]  # windows of 16: prompts slide them
    params = [SamplingParams(max_tokens=40, temperature=0.0) for _ in prompts]
    for scheme in ("fp16", "affine4"):
        plain, _ = run(model, scheme, requests(params, prompts), "off")
        spec, (proposed, accepted) = run(model, scheme, requests(params, prompts), mode)
        assert spec == plain
        assert 0 < accepted < proposed


@pytest.mark.parametrize("mode", PROPOSERS)
@pytest.mark.parametrize("arch,seed", [("ministral3", 4), ("gpt_oss", 2), ("gemma4_text", 3)])  # sinks, KV sharing
def test_a_sliding_window_model_speculates_exactly(arch, seed, mode):
    _speculates_exactly(arch, seed, mode)


@pytest.mark.parametrize("arch,seed,mode", [
    ("qwen3_5", 1, "ngram"), ("qwen3_5", 1, "draft"), ("lfm2", 2, "ngram"), ("lfm2", 2, "draft"),
    # Random Mamba and hybrid models do not repeat their prompts: prompt lookup never guesses.
    ("nemotron_h", 1, "draft"), ("granitemoehybrid", 1, "draft"), ("qwen3_next", 1, "draft")])
def test_a_recurrent_model_rolls_each_row_back_to_the_tokens_it_keeps(arch, seed, mode):
    """Recurrent layers verify position by position and each row takes the state after its
    last kept token (``StateCache.trim_rows``): the tokens equal a run without speculation."""
    _speculates_exactly(arch, seed, mode)


@pytest.mark.parametrize("mode", PROPOSERS)
def test_seeded_sampled_rows_give_the_same_tokens_alone_batched_and_without_speculation(model, mode):
    params = [SamplingParams(max_tokens=n, temperature=0.1, top_k=20, seed=40 + i, frequency_penalty=0.3 * (i % 2),
                             logit_bias=((7, 2.0),) if i == 3 else ())
              for i, n in enumerate(MAX_TOKENS)]
    batched, (proposed, accepted) = run(model, "fp16", requests(params), mode)
    lone, _ = run(model, "fp16", requests(params), mode, alone=True)
    plain, _ = run(model, "fp16", requests(params), "off")
    assert batched == lone == plain  # each position drawn with the key it would have had
    assert 0 < accepted < proposed  # low temperature: the rows repeat themselves, mostly


def test_rows_that_cannot_take_proposals_sample_as_usual_beside_rows_that_do(model):
    """A row asking for logprobs never proposes; in verify steps it is sampled like in an
    ordinary step: same tokens, same logprobs (to float rounding) as without speculation."""
    params = greedy_params()
    params[2] = SamplingParams(max_tokens=MAX_TOKENS[2], temperature=0.0, logprobs=True, top_logprobs=2)
    runs = {}
    for mode, draft in (("off", 0), ("ngram", 4)):
        trace = drive(runner_for(model, "fp16", mode), requests(params),
                      draft_tokens=draft, step_tokens=48)
        runs[mode] = trace
    assert runs["ngram"].tokens == runs["off"].tokens
    assert runs["ngram"].accepted > 0
    spec, plain = runs["ngram"].logprobs["r2"], runs["off"].logprobs["r2"]
    assert len(spec) == len(plain) == MAX_TOKENS[2]
    assert [(x.token, [t for t, _ in x.top]) for x in spec] == [(x.token, [t for t, _ in x.top]) for x in plain]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(spec, plain)) < 1e-3


def _layout(cache) -> tuple:
    return tuple((type(layer).__name__, layer.scheme.name, getattr(layer, "phase", None)) for layer in cache.layers)


@pytest.mark.parametrize("mode", PROPOSERS)
@pytest.mark.parametrize("scheme", ["fp16", "affine4", "turbo0v4"])
def test_layers_keep_their_class_and_scheme_through_accept_and_reject(model, scheme, mode):
    """After every verify step each layer is still its scheme's batch class, and each draft
    cache's layer its scheme's B = 1 class. TurboQuant is compressed from the first one:
    verify chunks (and a draft's catch-up) are several tokens long, and a cache that only
    compresses on one-token steps would quietly decode unquantized."""
    runner = runner_for(model, scheme, mode)
    scheduler = Scheduler(max_running=8, prefill_step_size=64, max_waiting=8, max_step_tokens=64,
                          max_draft_tokens=4)
    for r in requests(greedy_params()):
        scheduler.add(r)
    layouts, draft_layouts, outcomes = set(), set(), set()
    while scheduler.has_work:
        result = runner.execute(scheduler.schedule())
        scheduler.commit(result)
        if result.proposed:
            layouts.add(_layout(runner._batch))
            draft_layouts |= {_layout(runner.speculation.proposer.cache_of(r)) for r in result.proposed
                              if mode == "draft"}
            outcomes |= {len(result.accepted.get(r, ())) == n for r, n in result.proposed.items()}
        for r in list(scheduler.running):
            if r.num_generated >= r.params.max_tokens:
                scheduler.finish(r, None)
                runner.release(r.request_id)
    assert outcomes == {True, False}  # whole and partial acceptances both happened
    batch_class, single_class, phase = {"fp16": ("BatchFP16KVCache", "FP16KVCache", None),
                                        "affine4": ("BatchQuantizedKVCache", "QuantizedKVCache", None),
                                        "turbo0v4": ("BatchTurboKVCache", "TurboKVCache", "compressed")}[scheme]
    assert layouts == {((batch_class, scheme, phase),) * 2}
    assert draft_layouts == ({((single_class, scheme, phase),) * 2} if mode == "draft" else set())


def test_a_draft_follows_preemption_and_resumes_exactly(model):
    """A preempted request's draft cache is dropped with it and rebuilt from its tokens when
    it resumes: the tokens are those of a run without speculation or preemption."""
    plain, _ = run(model, "fp16", requests(greedy_params()), "off")
    runner = runner_for(model, "fp16", "draft")
    trace = drive(runner, requests(greedy_params()), draft_tokens=4, step_tokens=48, max_kv_tokens=200)
    assert any(kind == "out" for kind, _ in trace.swaps)
    assert trace.tokens == plain
    assert 0 < trace.accepted < trace.proposed
    assert runner.speculation.proposer._caches == {}  # every finished request let its cache go


def test_a_draft_proposal_stops_at_a_token_the_served_model_lacks(model):
    """A draft whose vocabulary is larger than the served model's: a proposal ends before
    the first id the served model has no row for."""
    full = DraftProposer(draft_of(model), parse_scheme("fp16"), cost=0.0)
    tokens = PROMPTS[3]  # its third draft token is larger than the two before it
    chain = full.propose({"a": (tokens, 4)})["a"]
    assert max(chain[:2]) < chain[2]
    cut = DraftProposer(draft_of(model), parse_scheme("fp16"), cost=0.0, vocab=chain[2])
    assert cut.propose({"a": (tokens, 4)})["a"] == chain[:2]


# ---- the acceptance rule keeps the model's distribution --------------------------------

def _first_tokens(params: SamplingParams, logits: mx.array, guess: list[int], trials: int) -> np.ndarray:
    counts = np.zeros(logits.shape[-1])
    for seed in range(trials):
        sampler = RequestSampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        kept, token = sampler.accept(logits, guess)
        counts[(kept + [token])[0]] += 1
    return counts


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from math import erf, sqrt

    expected = probs * counts.sum()
    live = expected > 0
    assert counts[~live].sum() == 0, "a token the model gives no probability was emitted"
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    dof = int(live.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))  # Wilson-Hilferty
    return 0.5 * (1 - erf(z / sqrt(2)))


@pytest.mark.parametrize("guess", [[2], [5], [2, 3]])
def test_sampled_acceptance_emits_the_models_distribution(guess):
    """Proposing token 2 (likely), 5 (unlikely) or 2 then 3: the first emitted token is
    distributed as the model's p (temperature 0.8, top-k 6 over a vocabulary of 8)."""
    raw = mx.array([[0.3, -1.0, 1.5, 0.9, 0.0, -2.0, 0.7, -0.4]] * 3)
    params = SamplingParams(temperature=0.8, top_k=6)
    counts = _first_tokens(params, raw[: len(guess) + 1], guess, trials=3000)
    sampler = RequestSampler(params)
    probs = np.array(mx.softmax(sampler._scaled(raw[:1]), axis=-1)[0])
    assert _chi_square_p(counts, probs) > 1e-3
    assert counts[np.argsort(probs)[:2]].sum() == 0  # top-k removed the two least likely


def test_the_cost_model_verifies_fewer_positions_in_a_wide_batch(model):
    """With the CPU's measured cost of a position, a batch of 8 verifies far fewer guesses
    than one where positions are free; the tokens are the same."""
    free, (free_proposed, _) = run(model, "fp16", requests(greedy_params()), "ngram")
    trace = drive(ModelRunner(model, parse_scheme("fp16"), proposer=NgramProposer()), requests(greedy_params()),
                  draft_tokens=4, step_tokens=48)
    assert trace.tokens == free
    assert trace.proposed < free_proposed / 2


def _queued_ahead(runner: ModelRunner, draft_tokens: int) -> tuple[dict, list[bool]]:
    """The tokens of the greedy requests, and whether each step queued the next one ahead."""
    queued, queue = [], runner._queue_ahead

    def spy(step, ending):
        ahead = queue(step, ending)
        queued.append(ahead is not None)
        return ahead

    runner._queue_ahead = spy
    trace = drive(runner, requests(greedy_params()), draft_tokens=draft_tokens, step_tokens=48)
    return trace.tokens, queued


def test_rows_whose_guesses_would_not_pay_leave_every_step_queued_ahead(model):
    """Where no verified position pays for itself, no row arms: the steps are queued ahead
    exactly as without speculation. Where positions are free, rows arm and do not."""
    plain = _queued_ahead(ModelRunner(model, parse_scheme("fp16")), 0)
    costly = ModelRunner(model, parse_scheme("fp16"), proposer=NgramProposer())
    costly.speculation.position_cost = lambda rows: 10.0
    assert _queued_ahead(costly, 4) == plain
    free_tokens, free_queued = _queued_ahead(runner_for(model, "fp16"), 4)
    assert free_tokens == plain[0]
    assert free_queued.count(True) < plain[1].count(True)
