"""Per-request token sampling with a private random key.

Each request carries its own PRNG key, split once per sampled token, so a seeded request
produces the same tokens whatever else the engine is doing (no global random state).
The filtering helpers come from mlx-lm.

Example:
    >>> import mlx.core as mx
    >>> s = RequestSampler(SamplingParams(temperature=0.0))
    >>> s.sample(mx.array([[0.1, 2.0, -1.0]])).item()
    1
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from kvserve.server.engine.request import SamplingParams


class RequestSampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def sample(self, logits: mx.array) -> mx.array:
        """``logits`` (1, V) -> token id array of shape (1,)."""
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0.0 < self.params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.params.top_p)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=sub)
