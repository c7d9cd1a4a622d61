"""The decode step captured once per batch shape and replayed (``mx.compile``).

Where a step is bound by the host (a small model on a GPU: 8 rows of the default model
build some 500 MLX operations in 8-10 ms of Python for 2-3 ms of kernels), building the
step's graph is most of its cost. A captured step traces the model's forward once for a
batch shape (rows, cache capacity, the layers' formats) and replays the recorded graph
after that: no Python per operation, and ``mx.compile`` fuses the element-wise chains.

What makes a step replayable is that nothing in it is a Python number that changes from
step to step. Each layer is traced over its storage at full capacity
(``kvserve.cache.captured``): the write slot, the rows' first slots and so their positions
and mask are arrays the step takes, so a step at slot 301 replays the trace made at slot
300. A batch shape changes when rows join or leave and when the cache grows (doubling, so
a few times over a long generation); each new one is traced once (warm-up covers the
served batch sizes at the first capacity).

    step = CapturedDecode(model)
    if step.serves(batch):                      # full-attention layers in their decode form
        logits = step(tokens, batch)            # (B, V); every layer's size grew by one
    else:
        logits = model(tokens, cache=batch)[:, -1, :]

Attention reads each layer's whole capacity under the mask (up to one granule more than
the rows hold); the layer's own kernels run it, as in an eager step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvserve.cache.captured import captured_state, step_mask, view

log = logging.getLogger(__name__)


def _structure(layers) -> tuple:
    """What a trace assumes beyond array shapes: each layer's class and scheme."""
    return tuple((type(layer), layer.scheme.name, len(layer._buf.parts)) for layer in layers)


class CapturedDecode:
    """Captured decode steps of one model, one traced function per layer structure."""

    def __init__(self, model: Callable):
        self.model = model
        self._traced: dict[tuple, Callable] = {}
        self._failed: set[tuple] = set()
        self._seen: set[tuple] = set()
        self.traces = self.replays = 0  # traces made; captured steps run (a trace's own included)

    def serves(self, batch) -> bool:
        """Every layer a full-attention batch layer in its decode form (``captured_state``),
        holding tokens, all at one size (a batch cache's layers are), none to be converted."""
        layers = list(batch)
        if not layers or getattr(batch, "pending_conversion", False):
            return False
        if any(captured_state(layer) is None for layer in layers):
            return False
        if len({layer.size() for layer in layers}) != 1:
            return False
        # A structure's first step runs eagerly: kernels that check themselves against a
        # reference on their first call (``kernels.dispatch``) read results, which a trace
        # cannot do.
        structure = _structure(layers)
        if structure not in self._seen:
            self._seen.add(structure)
            return False
        return structure not in self._failed

    def __call__(self, tokens: mx.array, batch) -> mx.array | None:
        """Logits (B, V) of one decode step over ``tokens`` (B, 1), every layer one token
        longer; None (nothing written) where the trace failed: the caller steps eagerly."""
        layers = list(batch)
        size = layers[0].size()
        for layer in layers:  # room for this step's slot, outside the trace (a copy on growth)
            layer._buf.reserve(layer._buf.parts, size + 1)
        structure = _structure(layers)
        fn = self._traced.get(structure)
        if fn is None:
            fn = self._traced[structure] = mx.compile(self._step_for(layers))
        parts = [p for layer in layers for p in layer._buf.parts]
        starts = mx.array(layers[0].left_padding, dtype=mx.int32)
        traces, t0 = self.traces, time.perf_counter()
        try:
            logits, *new = fn(tokens, mx.array(size, dtype=mx.int32), starts, *parts)
        except Exception as exc:  # noqa: BLE001 (a model the trace cannot follow steps eagerly)
            log.warning("decode step of %s not captured (%s); stepping eagerly", structure[0][0].__name__, exc)
            self._failed.add(structure)
            self._traced.pop(structure, None)
            return None
        if self.traces > traces:
            log.info("decode step captured for %d rows over %d slots in %.0f ms", len(starts), parts[0].shape[2],
                     1e3 * (time.perf_counter() - t0))
        del parts  # the old storage's last holders are the step's inputs: MLX writes in place
        i = 0
        for layer in layers:
            n = len(layer._buf.parts)
            layer._buf.parts, i = new[i:i + n], i + n
            layer._buf.size = size + 1
        self.replays += 1
        return logits

    def _step_for(self, layers: list[Any]) -> Callable:
        # Classes, schemes and static state only: a trace outlives the batch it was made for.
        templates = [(type(layer), layer.scheme, len(layer._buf.parts), captured_state(layer)) for layer in layers]
        model = self.model

        def step(tokens, slot, starts, *parts):
            self.traces += 1
            mask = step_mask(starts, slot, parts[0].shape[2])
            views, i = [], 0
            for cls, scheme, n, state in templates:
                views.append(view(cls, scheme, list(parts[i:i + n]), slot, starts, mask, state))
                i += n
            logits = model(tokens, cache=views)[:, -1, :]
            return [logits] + [p for v in views for p in v._buf.parts]

        return step
