"""The only code that runs the model: executes a ``StepPlan`` and returns a ``StepResult``.

Each request owns a sampler (its own PRNG key) and, while its prompt is prefilled, its own
B = 1 ``PromptCache``. The chunk that completes the prompt also samples the first token, so
the first output token always comes from a real forward pass over the last prompt token.
Then the request's cache joins the running decode batch, one left-padded ``PromptCache``
whose rows are the decoding requests; a decode step is ONE forward over all of them:

    step 1  prefill a (3 tokens, completes)   -> a joins:      rows [a]        size 3
    step 2  decode [a];  prefill b (5, done)  -> b joins:      rows [a, b]     a left-padded by 1
    step 3  decode [a, b]: tokens (2, 1)      -> a finishes:   filter -> rows [b]

Rows never see each other (the mask hides other rows' slots and padding), so a request
decodes alone or inside any batch to the same tokens, up to float rounding.
"""

from __future__ import annotations

import mlx.core as mx

from kvserve.cache import KVScheme, PromptCache
from kvserve.server.engine.fastpath import last_logits
from kvserve.server.engine.request import Request
from kvserve.server.engine.sampler import RequestSampler
from kvserve.server.engine.scheduler import PrefillChunk, StepPlan, StepResult


class ModelRunner:
    """Holds the model, the caches and samplers of live requests; runs on the engine thread."""

    def __init__(self, model, scheme: KVScheme):
        self.model = model
        self.scheme = scheme
        self._samplers: dict[str, RequestSampler] = {}
        self._single: dict[str, PromptCache] = {}  # B = 1 caches: prompts in progress, parked rows
        self._batch: PromptCache | None = None  # decoding requests, one row each
        self._rows: list[str] = []  # request id of each batch row
        self._last: dict[str, int] = {}  # last sampled token, the next decode input

    def execute(self, plan: StepPlan) -> StepResult:
        sampled = self._decode(plan.decode) if plan.decode else {}
        prefilled: dict[str, int] = {}
        joining: list[str] = []
        for chunk in plan.prefill:
            request_id = chunk.request.request_id
            token = self._prefill(chunk)
            prefilled[request_id] = chunk.num_tokens
            if token is not None:
                sampled[request_id] = token
                joining.append(request_id)
        self._join(joining)  # after the decode: they decode from the next step on
        return StepResult(prefilled=prefilled, sampled=sampled)

    def release(self, request_id: str) -> None:
        """Free a request's cache (its batch row leaves); called when it finishes or is aborted."""
        self._samplers.pop(request_id, None)
        self._single.pop(request_id, None)
        self._last.pop(request_id, None)
        if request_id in self._rows:
            self._keep([r for r in self._rows if r != request_id])

    @property
    def live_requests(self) -> int:
        return len(self._samplers)

    @property
    def batch_rows(self) -> tuple[str, ...]:
        """Request ids of the decode batch, in row order."""
        return tuple(self._rows)

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated by the KV caches of all live requests (batch padding included)."""
        batch = self._batch.nbytes if self._batch is not None else 0
        return batch + sum(cache.nbytes for cache in self._single.values())

    # ---- prefill: one request at a time, on its own B = 1 cache ------------------------
    def _prefill(self, chunk: PrefillChunk) -> int | None:
        request = chunk.request
        cache = self._single_cache(request)
        start = request.num_computed
        tokens = mx.array(request.prompt_tokens[start : start + chunk.num_tokens])[None]  # (1, L)
        if not chunk.completes_prompt:
            self.model(tokens, cache=cache)
            cache.maybe_convert()
            mx.eval(cache.state)
            return None
        logits = last_logits(self.model, tokens, cache)  # (1, V)
        cache.maybe_convert()
        token = self._samplers[request.request_id].sample(logits).item()
        self._last[request.request_id] = token
        return token

    def _single_cache(self, request: Request) -> PromptCache:
        request_id = request.request_id
        if request_id not in self._samplers:
            self._samplers[request_id] = RequestSampler(request.params)
            self._single[request_id] = PromptCache.for_model(self.model, self.scheme)
        return self._single[request_id]

    # ---- decode: one forward over every decoding request --------------------------------
    def _decode(self, requests: tuple[Request, ...]) -> dict[str, int]:
        planned = [r.request_id for r in requests]
        self._park([r for r in self._rows if r not in planned])
        self._join([r for r in planned if r not in self._rows])
        tokens = mx.array([[self._last[r]] for r in self._rows])  # (B, 1)
        logits = self.model(tokens, cache=self._batch)[:, -1, :]  # (B, V)
        self._batch.maybe_convert()
        # Each row with its own sampler: per-request temperature, top_p and PRNG key.
        picks = [self._samplers[r].sample(logits[b : b + 1]) for b, r in enumerate(self._rows)]
        values = mx.concatenate(picks).tolist()  # one evaluation for the whole batch
        self._last.update(zip(self._rows, values))
        return dict(zip(self._rows, values))

    def _join(self, request_ids: list[str]) -> None:
        """Move B = 1 caches into the decode batch as new rows (one merge, one extend)."""
        if not request_ids:
            return
        joining = PromptCache.merge([self._single.pop(r) for r in request_ids])
        if self._batch is None:
            self._batch = joining
        else:
            self._batch.extend(joining)
        self._rows.extend(request_ids)

    def _park(self, request_ids: list[str]) -> None:
        """Rows a plan does not decode leave the batch as B = 1 caches until planned again."""
        if not request_ids:
            return
        for r in request_ids:
            self._single[r] = self._batch.extract(self._rows.index(r))
        self._keep([r for r in self._rows if r not in request_ids])

    def _keep(self, request_ids: list[str]) -> None:
        """Shrink the batch to these rows (in this order); an empty batch is dropped."""
        if not request_ids:
            self._batch, self._rows = None, []
            return
        self._batch.filter([self._rows.index(r) for r in request_ids])
        self._rows = list(request_ids)
