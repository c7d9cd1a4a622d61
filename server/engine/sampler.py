"""Per-request token sampling inside one batch, each request with a private random key.

Each request carries its own PRNG key, split once per sampled token, so a seeded request
produces the same tokens whatever else the engine is doing (no global random state).
The filters (top-k, top-p, min-p) come from mlx-lm; the penalties and the bias follow
OpenAI's definitions over the tokens generated so far, applied as one sparse add.

Drawing and reading are apart, so a step can be queued on the device before the previous
one's tokens are known: ``draw_rows`` builds the sampled tokens as arrays (splitting keys),
``Draw.read`` waits for them and counts them for the penalties, ``Draw.undo`` gives the keys
back when a queued step is dropped.

Example (row 0 greedy, row 1 greedy with token 1 banned by a bias):
    >>> import mlx.core as mx
    >>> rows = [RequestSampler(SamplingParams(temperature=0.0)),
    ...         RequestSampler(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),)))]
    >>> [p.token for p in sample_rows(rows, mx.array([[0.1, 2.0, -1.0], [0.1, 2.0, -1.0]]))]
    [1, 0]
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from kvserve.server.engine.grammar import Grammars, RowGrammar
from kvserve.server.engine.request import SamplingParams, TokenLogprob
from kvserve.server.engine.thinking import BudgetState


@dataclass(frozen=True)
class Pick:
    """One row's sampled token and, if the request asked, its log-probabilities."""

    token: int
    logprob: TokenLogprob | None = None


class RequestSampler:
    """Sampling state of one request: its parameters, PRNG key, generated-token counts and,
    for a request with a grammar, its matcher (``grammars`` compiles it); with a thinking
    budget, its count of thinking tokens."""

    def __init__(self, params: SamplingParams, grammars: Grammars | None = None):
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self._bias = dict(params.logit_bias)
        self._counts: Counter[int] = Counter()
        self.grammar: RowGrammar | None = None
        if params.grammar is not None:
            if grammars is None:
                raise ValueError("a request with a grammar needs the model's Grammars")
            self.grammar = grammars.matcher(params.grammar)
            self.grammars = grammars
        self.budget = BudgetState(params.thinking) if params.thinking is not None else None

    def observe(self, token: int) -> None:
        """Count a generated token (the penalties look at these counts) and feed it to the
        grammar."""
        if self.params.penalized:
            self._counts[token] += 1
        if self.grammar is not None:
            self.grammar.consume(token)
        if self.budget is not None:
            self.budget.observe(token)

    def waits_on_previous(self) -> bool:
        """This row's next sample depends on the token before it (a grammar's mask, a budget
        that may close its thinking block): a step queued before that token is read defers it."""
        return self.grammar is not None or (self.budget is not None and self.budget.may_force_soon())

    def adjust(self, logits: mx.array, ahead: Sequence[int] = ()) -> mx.array:
        """``logits`` (1, V) plus the bias minus the penalties, as one sparse add; ``ahead``:
        tokens not observed yet that come before this position (proposals being verified)."""
        params = self.params
        delta = dict(self._bias)
        counts = self._counts + Counter(ahead) if params.penalized and ahead else self._counts
        for token, count in counts.items():
            penalty = params.frequency_penalty * count + params.presence_penalty
            delta[token] = delta.get(token, 0.0) - penalty
        if not delta:
            return logits
        ids = mx.array(list(delta.keys()))
        return logits.astype(mx.float32).at[:, ids].add(mx.array(list(delta.values())))

    def sample(self, logits: mx.array) -> mx.array:
        """``logits`` (1, V) -> token id array of shape (1,); a spent thinking budget emits its
        block's end marker instead (drawing no key)."""
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:
            return mx.array([forced], dtype=mx.uint32)
        logits = self.adjust(logits)
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(self._scaled(logits), key=sub)

    def _scaled(self, logits: mx.array) -> mx.array:
        """Adjusted logits (N, V) -> the logits this request samples from: log-softmax,
        top-k / top-p / min-p filters, then temperature."""
        params = self.params
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, params.top_k)
        if 0.0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        return logprobs * (1.0 / params.temperature)

    def accept(self, logits: mx.array, proposals: Sequence[int]) -> tuple[list[int], int]:
        """Verify proposed tokens against the model: ``logits`` (k + 1, V) are the model's
        after the last token and after each proposal. Returns the proposals kept and the
        token that follows them. Nothing is observed here (the caller does).

        Position i is sampled exactly as an ordinary step would sample it, with the key
        the i-th next draw would use (greedy: the argmax), and a proposal is kept while it
        equals that sample. So the tokens are those of decoding without speculation, token
        for token and seed for seed, and each is distributed as the model's p; a guess d is
        kept with probability p(d), as by the rejection rule with a one-hot draft. Only the
        draws of emitted tokens are consumed.

            >>> s = RequestSampler(SamplingParams(temperature=0.0))
            >>> s.accept(mx.array([[0., 3., 1.], [2., 0., 1.], [0., 0., 5.]]), [1, 2])
            ([1], 0)
        """
        k = len(proposals)
        rows = mx.concatenate([self.adjust(logits[i : i + 1], proposals[:i]) for i in range(k + 1)])
        if self.params.greedy:
            picks = mx.argmax(rows, axis=-1).tolist()
        else:
            scaled, keys, key = self._scaled(rows), [], self._key
            for _ in range(k + 1):
                key, sub = mx.random.split(key)
                keys.append((key, sub))
            picks = mx.concatenate([mx.random.categorical(scaled[i : i + 1], key=sub)
                                    for i, (_, sub) in enumerate(keys)]).tolist()
        kept, token = agreed(picks, proposals)
        if not self.params.greedy:
            self._key = keys[len(kept)][0]  # len(kept) + 1 tokens emitted: as many draws used
        return kept, token

def agreed(picks: Sequence[int], proposals: Sequence[int]) -> tuple[list[int], int]:
    """The proposals that equal the picks at their positions, up to the first that does
    not, and the pick that follows them (``picks`` has one more position).

        >>> agreed([4, 7, 9], [4, 8])
        ([4], 7)
    """
    n = next((i for i, (p, d) in enumerate(zip(picks, proposals)) if p != d), len(proposals))
    return list(proposals[:n]), picks[n]


@dataclass(frozen=True)
class Draw:
    """Tokens sampled for a batch, still arrays: ``tokens`` (B,) and, for the rows that ask,
    their log-probability arrays. ``keys`` are the samplers' keys before the draw.

    A draw queued before the previous tokens are read cannot mask its constrained rows yet
    (their grammars have not seen the previous token), nor know whether a thinking budget
    closes its block: those rows are ``deferred``, their logits kept, and ``complete``
    samples them once the grammars and budgets are current. The forward
    itself is already on the device; only the masked sampling of those rows waits."""

    samplers: tuple[RequestSampler, ...]
    keys: tuple[mx.array, ...]
    tokens: mx.array
    scored: dict[int, tuple[mx.array, ...]]
    deferred: tuple[int, ...] = ()
    logits: mx.array | None = None  # (B, V), kept while rows are deferred

    def arrays(self) -> list:
        return [self.tokens, self.scored]

    def select(self, rows: list[int]) -> Draw:
        """The same draw for these rows only, in this order (rows that left are dropped)."""
        if rows == list(range(len(self.samplers))):
            return self
        index = mx.array(rows)
        return Draw(tuple(self.samplers[b] for b in rows), tuple(self.keys[b] for b in rows),
                    self.tokens[index], {i: self.scored[b] for i, b in enumerate(rows) if b in self.scored},
                    tuple(i for i, b in enumerate(rows) if b in self.deferred),
                    None if self.logits is None else self.logits[index])

    def complete(self) -> Draw:
        """Sample the deferred rows, their grammars now fed every earlier token."""
        if not self.deferred:
            return self
        rows = list(self.deferred)
        samplers = [self.samplers[b] for b in rows]
        masked = _grammar_masked(samplers, self.logits[mx.array(rows)])
        own = {b: samplers[i].sample(masked.get(i, self.logits[b : b + 1])) for i, b in enumerate(rows)}
        tokens = mx.concatenate([own[b] if b in own else self.tokens[b : b + 1] for b in range(len(self.samplers))])
        scored = dict(self.scored)
        scored.update({b: _logprob_arrays(self.logits[b], tokens[b], self.samplers[b].params.top_logprobs)
                       for b in rows if self.samplers[b].params.logprobs})
        return Draw(self.samplers, self.keys, tokens, scored)

    def read(self) -> list[Pick]:
        """Wait for the tokens; each row's sampler counts its token."""
        assert not self.deferred, "complete() the draw first"
        mx.eval(self.arrays())
        values = self.tokens.tolist()
        for sampler, token in zip(self.samplers, values):
            sampler.observe(token)
        return [Pick(token, _token_logprob(token, self.scored[b]) if b in self.scored else None)
                for b, token in enumerate(values)]

    def undo(self) -> None:
        """Give every sampler its key back, as if this draw never happened."""
        for sampler, key in zip(self.samplers, self.keys):
            sampler._key = key


def draw_rows(samplers: list[RequestSampler], logits: mx.array, defer: bool = False) -> Draw:
    """Sample row ``b`` of ``logits`` (B, V) with ``samplers[b]``, as arrays (nothing runs).

    Plain greedy rows share one argmax over the whole batch; the others sample alone. A
    penalized row must have observed every earlier token first (its counts live here); a
    constrained row too, or with ``defer`` it waits for ``Draw.complete``.
    """
    keys = tuple(s._key for s in samplers)
    greedy = mx.argmax(logits, axis=-1)  # (B,)
    deferred = tuple(b for b, s in enumerate(samplers) if defer and s.waits_on_previous())
    now = [s if b not in deferred else None for b, s in enumerate(samplers)]
    masked = _grammar_masked(now, logits)
    own = {b: s.sample(masked.get(b, logits[b : b + 1])) for b, s in enumerate(now)
           if s is not None and not s.params.plain_greedy}
    tokens = mx.concatenate([own[b] if b in own else greedy[b : b + 1]
                             for b in range(len(samplers))]) if samplers else greedy
    wanted = [b for b, s in enumerate(now) if s is not None and s.params.logprobs]
    scored = {b: _logprob_arrays(logits[b], tokens[b], samplers[b].params.top_logprobs)
              for b in wanted}
    return Draw(tuple(samplers), keys, tokens, scored, deferred, logits if deferred else None)


def _grammar_masked(samplers: list[RequestSampler | None], logits: mx.array) -> dict[int, mx.array]:
    """The logits (1, V) of each constrained row with the tokens its grammar forbids at -inf;
    every constrained row's mask is filled in one parallel call (None: a row left out)."""
    rows = [b for b, s in enumerate(samplers) if s is not None and s.grammar is not None]
    if not rows:
        return {}
    allowed = samplers[rows[0]].grammars.masks([samplers[b].grammar for b in rows])  # (R, V)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:  # the embedding may have rows past the tokenizer's vocabulary
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    allowed = mx.array(allowed[:, :vocab])
    picked = logits[mx.array(rows)].astype(mx.float32)
    picked = mx.where(allowed, picked, mx.array(-mx.inf, dtype=mx.float32))
    return {b: picked[i : i + 1] for i, b in enumerate(rows)}


def sample_rows(samplers: list[RequestSampler], logits: mx.array) -> list[Pick]:
    """Sample row ``b`` of ``logits`` (B, V) with ``samplers[b]`` and read the picks."""
    return draw_rows(samplers, logits).read()


def _logprob_arrays(row: mx.array, token: mx.array, k: int) -> tuple[mx.array, ...]:
    """Log-softmax of one row (V,): the sampled token's value and the top ``k`` (ids, values)."""
    logprobs = row.astype(mx.float32) - mx.logsumexp(row.astype(mx.float32))
    chosen = logprobs[token]
    if k <= 0:
        return (chosen,)
    ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
    return chosen, ids, logprobs[ids]


def _token_logprob(token: int, arrays: tuple[mx.array, ...]) -> TokenLogprob:
    chosen = arrays[0].item()
    if len(arrays) == 1:
        return TokenLogprob(token, chosen)
    top = sorted(zip(arrays[1].tolist(), arrays[2].tolist()), key=lambda t: (-t[1], t[0]))
    return TokenLogprob(token, chosen, tuple(top))
