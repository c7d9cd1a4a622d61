"""The only code that runs the model: executes a ``StepPlan`` and returns a ``StepResult``.

Each request owns a KV cache (mlx-lm's per-layer caches for now) and a sampler. A prefill
chunk extends the cache; the chunk that completes the prompt also samples the first token,
so the first output token always comes from a real forward pass over the last prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvserve.cache import KVScheme, PromptCache
from kvserve.server.engine.fastpath import last_logits
from kvserve.server.engine.request import Request
from kvserve.server.engine.sampler import RequestSampler
from kvserve.server.engine.scheduler import PrefillChunk, StepPlan, StepResult


@dataclass
class _Slot:
    cache: PromptCache
    sampler: RequestSampler
    last_token: int | None = None


class ModelRunner:
    """Holds the model and one cache per live request; everything here runs on the engine thread."""

    def __init__(self, model, scheme: KVScheme):
        self.model = model
        self.scheme = scheme
        self._slots: dict[str, _Slot] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        prefilled: dict[str, int] = {}
        sampled: dict[str, int] = {}
        for chunk in plan.prefill:
            token = self._prefill(chunk)
            prefilled[chunk.request.request_id] = chunk.num_tokens
            if token is not None:
                sampled[chunk.request.request_id] = token
        for request in plan.decode:
            sampled[request.request_id] = self._decode(request)
        return StepResult(prefilled=prefilled, sampled=sampled)

    def release(self, request_id: str) -> None:
        """Free a request's cache; called when it finishes or is aborted."""
        self._slots.pop(request_id, None)

    @property
    def live_requests(self) -> int:
        return len(self._slots)

    @property
    def kv_bytes(self) -> int:
        """Bytes allocated by the KV caches of all live requests."""
        return sum(slot.cache.nbytes for slot in self._slots.values())

    def _slot(self, request: Request) -> _Slot:
        slot = self._slots.get(request.request_id)
        if slot is None:
            slot = _Slot(PromptCache.for_model(self.model, self.scheme), RequestSampler(request.params))
            self._slots[request.request_id] = slot
        return slot

    def _prefill(self, chunk: PrefillChunk) -> int | None:
        request, slot = chunk.request, self._slot(chunk.request)
        start = request.num_computed
        tokens = mx.array(request.prompt_tokens[start : start + chunk.num_tokens])
        if not chunk.completes_prompt:
            self.model(tokens[None], cache=slot.cache)
            slot.cache.maybe_convert()
            mx.eval(slot.cache.state)
            return None
        logits = last_logits(self.model, tokens[None], slot.cache)  # (1, V)
        slot.cache.maybe_convert()
        return self._sample(slot, logits)

    def _decode(self, request: Request) -> int:
        slot = self._slots[request.request_id]
        logits = self.model(mx.array([[slot.last_token]]), cache=slot.cache)  # (1, 1, V)
        slot.cache.maybe_convert()
        return self._sample(slot, logits[:, -1, :])

    def _sample(self, slot: _Slot, logits: mx.array) -> int:
        token = slot.sampler.sample(logits)
        slot.last_token = token.item()
        return slot.last_token
