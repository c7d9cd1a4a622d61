"""Proposals from a draft model (``--speculative draft --draft-model M``): a smaller model
with the served model's tokenizer continues each row greedily, and the served model
verifies those tokens inside the continuous batch (``speculation.py``, ``runner.py``).

Each request gets the draft's own B = 1 ``PromptCache`` in the served KV scheme, built like
the runner's (raw prefill, then the scheme): a draft step that built a plain cache would
quietly leave the scheme. The cache follows the request's tokens lazily: a call keeps the
longest prefix it shares with them, trims the rest (the proposals the model rejected) in
its own scheme and feeds what is new, then decodes k tokens:

    tokens  p0 .. p9                    propose 4: feed p0..p9, decode d0 d1 d2 d3
    cache   p0 .. p9 d0 d1 d2           (d3 is never fed)
    the model keeps d0, picks x         tokens p0 .. p9 d0 x
    next call: keep p0..p9 d0, trim d1 d2, feed x, decode the next 4

The first call for a request feeds its whole prompt (in chunks); a paused row catches up
on every token since its last proposal. The k greedy steps of every row are queued as one
graph and read back once, so the host does not wait between draft steps. Example::

    draft = DraftProposer(small_model, parse_scheme("affine4"), cost=0.3)
    draft.propose({"a": ([1, 2, 3, 4], 3)})     # {'a': [t1, t2, t3]}: three greedy tokens
    draft.cache_of("a").offset                  # 6: the prompt and t1, t2
"""

from __future__ import annotations

from time import perf_counter

import mlx.core as mx

from kvserve.cache import KVScheme, PromptCache
from kvserve.server.engine.fastpath import last_logits

# Prompt tokens per draft forward when a row catches up (bounds the attention's scratch).
CATCH_UP_CHUNK = 512
# A request's draft cache prefills raw up to this many tokens, then takes the scheme (as
# the runner's prompts do; ``runner.RAW_PREFILL_TOKENS``).
RAW_PREFILL_TOKENS = 2048


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix.

        >>> common_prefix([1, 2, 3, 4], [1, 2, 5]), common_prefix([], [1])
        (2, 0)
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftProposer:
    """A draft model's greedy proposals, one B = 1 cache per request (``Proposer``).

    ``cost``: a one-row decode step of the draft as a share of the served model's
    (``relative_cost``); ``vocab``: token ids the served model has (a larger draft
    vocabulary's extra ids end a proposal)."""

    def __init__(self, model, scheme: KVScheme, cost: float, vocab: int | None = None):
        self.model, self.scheme, self.cost, self.vocab = model, scheme, cost, vocab
        self._caches: dict[str, PromptCache] = {}
        # What each request's cache holds: the first n of its tokens, then the draft tokens
        # fed after them (a request's tokens only grow, so n of them is all a check needs).
        self._held: dict[str, tuple[int, list[int]]] = {}

    def ready(self, request_id: str, tokens: list[int]) -> bool:
        return len(tokens) > 0  # a draft model always has a guess

    def propose(self, wants: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
        chains = {r: self._chain(r, tokens, k) for r, (tokens, k) in wants.items() if k > 0}
        mx.eval(list(chains.values()))
        out = {r: [] for r in wants}  # k = 0: asked, nothing proposed
        for r, chain in chains.items():
            drafted = chain.tolist()
            self._held[r] = (len(wants[r][0]), drafted[:-1])  # the last draft token is never fed
            out[r] = self._valid(drafted)
        return out

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._held.pop(request_id, None)

    def cache_of(self, request_id: str) -> PromptCache | None:
        """The draft cache a request holds (None before its first proposal)."""
        return self._caches.get(request_id)

    def _valid(self, chain: list[int]) -> list[int]:
        if self.vocab is None:
            return chain
        cut = next((i for i, t in enumerate(chain) if t >= self.vocab), len(chain))
        return chain[:cut]

    def _chain(self, request_id: str, tokens: list[int], k: int) -> mx.array:
        """Queue k greedy draft tokens after ``tokens`` (an array of shape (k,), not read)."""
        cache = self._catch_up(request_id, tokens)
        logits = self._feed(cache, tokens[cache.offset :])
        picks = [mx.argmax(logits, axis=-1)]  # (1,)
        for _ in range(k - 1):
            logits = self.model(picks[-1][:, None], cache=cache)[:, -1, :]
            cache.maybe_convert()
            picks.append(mx.argmax(logits, axis=-1))
        return mx.concatenate(picks)

    def _catch_up(self, request_id: str, tokens: list[int]) -> PromptCache:
        """The request's cache cut to the longest prefix of ``tokens`` it holds, leaving at
        least the last token to feed (its logits give the first proposal)."""
        cache, (n, fed) = self._caches.get(request_id), self._held.get(request_id, (0, []))
        keep = min(n + common_prefix(fed, tokens[n:]), len(tokens) - 1)
        drop = cache.offset - keep if cache is not None else 0
        if drop and cache.trim(drop) != drop:
            cache = None  # a layer that cannot drop that many tokens: start again
        if cache is None:
            cache = PromptCache.for_model(self.model, self.scheme, quantize_after=RAW_PREFILL_TOKENS)
            self._caches[request_id] = cache
        return cache

    def _feed(self, cache: PromptCache, tokens: list[int]) -> mx.array:
        """Feed ``tokens`` in chunks; the last position's logits, shape (1, V)."""
        fresh = cache.offset == 0
        if not fresh:
            cache.begin_decode()  # a TurboQuant cache takes several tokens in its decode form
        for start in range(0, len(tokens) - CATCH_UP_CHUNK, CATCH_UP_CHUNK):
            self.model(mx.array([tokens[start : start + CATCH_UP_CHUNK]]), cache=cache)
            cache.maybe_convert()
            mx.eval(cache.state)
        tail = tokens[len(tokens) - 1 - (len(tokens) - 1) % CATCH_UP_CHUNK :]
        logits = last_logits(self.model, mx.array([tail]), cache)
        if fresh:  # the prompt is in: every later token is stored in the scheme
            cache.convert()
            cache.quantize_after = 0
            cache.begin_decode()
        else:
            cache.maybe_convert()
        return logits


def relative_cost(draft, target, scheme: KVScheme, context: int = 64, repeats: int = 7) -> float:
    """A one-row decode step of ``draft`` as a share of one of ``target``: each model's
    fastest of ``repeats`` steps over ``context`` cached tokens, the two models taking turns
    after one untimed step each. Measured at start-up, so the choice of how many positions
    to verify counts what the draft's forwards cost on this machine. The fastest step, not
    the median, and taking turns: other work on the machine (another server starting) only
    ever slows a step, and slows the two models' steps alike while they alternate."""

    def stepper(model):
        cache = PromptCache.for_model(model, scheme)
        model(mx.zeros((1, context), dtype=mx.int32), cache=cache)
        cache.begin_decode()
        mx.eval(cache.state)

        def step() -> float:
            start = perf_counter()
            mx.eval(model(mx.array([[1]]), cache=cache))
            return perf_counter() - start

        step()
        return step

    steps = stepper(draft), stepper(target)
    times = [[step() for step in steps] for _ in range(repeats)]
    return min(t[0] for t in times) / min(t[1] for t in times)
