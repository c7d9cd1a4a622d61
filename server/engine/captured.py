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
300. A batch shape changes when rows join or leave and when the cache grows (doubling up to
4,096 slots at a time, so a few times over a long generation); each new one is traced once (warm-up covers the
served batch sizes at the first capacity).

    step = CapturedDecode(model)
    logits = step(tokens, batch)                # (B, V), every layer one token longer,
    if logits is None:                          # or None: this step is not captured
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

from kvserve.cache.captured import adopt_outputs, step_inputs, step_mask, structure, templates, view

log = logging.getLogger(__name__)


class CapturedDecode:
    """Captured decode steps of one model, one traced function per layer structure."""

    def __init__(self, model: Callable):
        self.model = model
        # Layer structure (``cache.captured.structure``) -> its step; None: its trace failed.
        self._steps: dict[tuple, Callable | None] = {}
        self.traces = self.replays = 0  # traces made; captured steps run (a trace's own included)

    def __call__(self, tokens: mx.array, batch) -> mx.array | None:
        """Logits (B, V) of one decode step over ``tokens`` (B, 1), every layer one token
        longer; None, with nothing written, where the step is not captured and the caller
        steps eagerly: layers a trace cannot stand in for (``structure``), a structure's
        first step (kernels that check themselves against a reference on their first call,
        ``kernels.dispatch``, read results, which a trace cannot do), or a failed trace."""
        layers = list(batch)
        key = None if getattr(batch, "pending_conversion", False) else structure(layers)
        if key is None:
            return None
        if key not in self._steps:
            self._steps[key] = mx.compile(self._step_for(templates(layers)))
            return None
        fn = self._steps[key]
        if fn is None:
            return None
        size, parts = step_inputs(layers)
        starts = mx.array(layers[0].left_padding, dtype=mx.int32)
        traces, t0 = self.traces, time.perf_counter()
        try:
            logits, *new = fn(tokens, mx.array(size, dtype=mx.int32), starts, *parts)
        except Exception as exc:  # noqa: BLE001 (a model the trace cannot follow steps eagerly)
            log.warning("decode step of %s not captured (%s); stepping eagerly", key[0][0].__name__, exc)
            self._steps[key] = None
            return None
        if self.traces > traces:
            log.info("decode step captured for %d rows over %d slots in %.0f ms", len(starts), parts[0].shape[2],
                     1e3 * (time.perf_counter() - t0))
        del parts  # the old storage's last holders are the step's inputs: MLX writes in place
        adopt_outputs(layers, new)
        self.replays += 1
        return logits

    def _step_for(self, layers: list[tuple[type, Any, int, dict]]) -> Callable:
        model = self.model

        def step(tokens, slot, starts, *parts):
            self.traces += 1
            mask = step_mask(starts, slot, parts[0].shape[2])
            views, i = [], 0
            for cls, scheme, n, state in layers:
                views.append(view(cls, scheme, list(parts[i:i + n]), slot, starts, mask, state))
                i += n
            logits = model(tokens, cache=views)[:, -1, :]
            return [logits] + [p for v in views for p in v._buf.parts]

        return step
