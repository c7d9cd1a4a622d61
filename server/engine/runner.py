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

Decoding runs one step ahead. Before a step's tokens are read back, the next decode step
over the same rows is queued behind it, fed the tokens as arrays: building a step's graph
(Python, a few ms for a deep model) overlaps the device running the previous one, as
mlx-lm's ``generate`` does. When the next plan decodes those rows, the queued step is its
decode (rows that finished meanwhile are dropped from it); when it decodes others (a
preemption or a resumed request), the step is undone: one slot trimmed from every row and
the samplers' keys given back, so the tokens are those of a run that never went ahead.
Rows with presence or frequency penalties need the last token counted on the host before
they sample, so a batch holding one does not go ahead. A row with a grammar goes ahead: its
forward is queued, and its masked sampling waits until the token before is read and fed to
its grammar (``Draw.complete``), so rows without a grammar lose nothing beside it.

The choices of an ``n > 1`` request (its forks) get copies of their leader's cache when its
prompt completes, and their first tokens are sampled from the same logits. A preempted
request's cache is written to a swap file and read back bit-identical when it resumes.

With a prefix cache, a request's first chunk starts from the longest cached prefix of its
prompt (the step reports those tokens as prefilled too); every completed prompt, and every
finished request's prompt plus reply, is offered back to it, so the next turn of a chat
finds its whole history cached.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from kvserve.cache import KVScheme, PromptCache, load_layers, save_layers
from kvserve.cache.recurrent import install_position_steps
from kvserve.server.engine.captured import CapturedDecode
from kvserve.server.engine.checkpoints import Checkpoints
from kvserve.server.engine.fastpath import last_logits
from kvserve.server.engine.grammar import Grammars
from kvserve.server.engine.heap import heap_stats
from kvserve.server.engine.request import Request
from kvserve.server.engine.sampler import Draw, Pick, RequestSampler, agreed, draw_rows, sample_rows
from kvserve.server.engine.scheduler import PrefillChunk, StepPlan, StepResult, group_whole_prompts
from kvserve.server.engine.speculation import Proposer, Speculator
from kvserve.server.engine.warmup import is_warmup


log = logging.getLogger(__name__)

# Prompts prefill into raw (fp16) layers, converted to the scheme when the prompt completes:
# the prompt attends to itself exactly and at full speed (one fused attention instead of
# quantized matmuls), and decoding reads the scheme. Prompts longer than this convert once
# they reach it, which bounds the raw copy.
RAW_PREFILL_TOKENS = 2048

@dataclass(frozen=True)
class DecodeStep:
    """A decode forward queued on the device: its rows (request ids, batch order) and draw."""

    rows: list[str]
    draw: Draw

    def narrow(self, rows: list[str]) -> DecodeStep:
        """The step for ``rows``, a subset of its rows in their order (the rest finished)."""
        return DecodeStep(list(rows), self.draw.select([self.rows.index(r) for r in rows]))

    def complete(self) -> DecodeStep:
        """The step with its constrained rows sampled (``Draw.complete``)."""
        if not self.draw.deferred:
            return self
        draw = self.draw.complete()
        mx.async_eval(draw.arrays())
        return DecodeStep(self.rows, draw)


@dataclass(frozen=True)
class VerifyStep:
    """A decode forward that also verifies proposals: row b fed ``[last, *proposals[b]]``
    (right-padded to one width), ``logits`` (B, L, V), ``greedy`` their argmax (B, L)."""

    rows: list[str]
    proposals: list[list[int]]
    logits: mx.array
    greedy: mx.array

    def accept(self, samplers: list[RequestSampler]) -> list[tuple[list[int], Pick]]:
        """Per row: the proposals the model keeps and the pick after them, every token
        observed by the row's sampler. Rows without proposals sample their first position
        as an ordinary step does (grammar masks, logprobs, the same key draws)."""
        plain = [b for b, guess in enumerate(self.proposals) if not guess]
        drawn = {}
        if plain:
            picks = draw_rows([samplers[b] for b in plain], self.logits[mx.array(plain), 0]).read()
            drawn = dict(zip(plain, picks))
        argmax = self.greedy.tolist()
        out = []
        for b, (sampler, guess) in enumerate(zip(samplers, self.proposals)):
            if b in drawn:
                out.append(([], drawn[b]))
                continue
            if sampler.params.plain_greedy:
                kept, token = agreed(argmax[b], guess)
            else:
                kept, token = sampler.accept(self.logits[b, : len(guess) + 1], guess)
            for t in (*kept, token):
                sampler.observe(t)
            out.append((kept, Pick(token)))
        return out


class ModelRunner:
    """Holds the model, the caches and samplers of live requests; runs on the engine thread."""

    heartbeat_s: float | None = None  # a runner that must hear from the engine while idle says how often
    kv_bytes_by_rank: dict[int, int] = {}  # a model split across processes: each one's KV bytes

    def __init__(self, model, scheme: KVScheme, swap_dir: Path | None = None, prefix=None,
                 grammars: Grammars | None = None, proposer: Proposer | None = None,
                 checkpoint_every: int = 1024, captured: bool = False):
        self.model = model
        # Decode steps captured per batch shape and replayed (the device profile's choice).
        self._captured = CapturedDecode(model) if captured else None
        self.decode_paths = {"captured": 0, "eager": 0}  # decode forwards by how they were built
        # Speculative decoding: who proposes (prompt lookup or a draft model); None: off.
        self.speculation = Speculator(proposer) if proposer is not None else None
        if proposer is not None:  # recurrent layers verify position by position (recurrent.py)
            install_position_steps(model)
        self.scheme = scheme
        self.grammars = grammars  # compiles the grammars of constrained requests
        self.prefix = prefix  # kvserve.cache.prefix.PrefixCache or None
        self._hits: dict[str, int] = {}  # prefix tokens found, not yet reported to the scheduler
        self._checkpoints = Checkpoints(checkpoint_every)  # window/state layers kept mid-prompt
        self._tokens: dict[str, list[int]] = {}  # prompt + sampled tokens of each live request
        self._samplers: dict[str, RequestSampler] = {}
        self._single: dict[str, PromptCache] = {}  # B = 1 caches: prompts in progress, parked rows
        self._batch: PromptCache | None = None  # decoding requests, one row each
        self._rows: list[str] = []  # request id of each batch row
        self._last: dict[str, int] = {}  # last sampled token, the next decode input
        self._ahead: DecodeStep | None = None  # queued before it was planned, rows in the batch
        self._swap_root = swap_dir
        self._swap_dir: Path | None = None  # made on the first preemption
        self._swapped: dict[str, Path] = {}
        self._swap_count = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for request in plan.swap_out:
            self._swap_out(request.request_id)
        for request in plan.swap_in:
            self._swap_in(request.request_id)
        step = self._decode(plan.decode, plan.drafts)  # queued, read back last
        cached = self._attach_prefixes(plan.prefill)
        prefilled = {c.request.request_id: c.num_tokens for c in plan.prefill}
        started = tuple(c for c in plan.prefill if c.request.request_id in self._hits)
        # A cached prefix continues in its own B = 1 cache; so do prompts cut for checkpoints
        # before their last token (left-padded rows end together: that cut is one column).
        together, _ = group_whole_prompts(tuple(c for c in plan.prefill if c not in started
                                                and self._cuts(c.request, 0, c.request.num_prompt_tokens)
                                                in ([], [c.request.num_prompt_tokens - 1])))
        alone = [*started, *(c for c in plan.prefill if c not in started and c not in together)]
        joining: list[str] = []
        prompt_picks: dict[str, Pick] = {}
        for chunk in alone:
            done, computed = self._prefill(chunk)
            prefilled[chunk.request.request_id] = computed
            prompt_picks.update(done)
            joining.extend(done)
        self._join(joining)  # after the decode: they decode from the next step on
        if together:
            prompt_picks.update(self._prefill_together(together))
        self._ahead = self._queue_ahead(step, _ending(plan, prompt_picks))
        if isinstance(step, VerifyStep):
            accepted, decoded, proposed = self._read_verified(step)
        else:
            accepted, decoded, proposed = {}, self._read(step), {}
        if self.speculation is not None:
            self.speculation.record(accepted)
        picks = {**decoded, **prompt_picks}
        for request_id, pick in picks.items():
            self._tokens[request_id].extend((*accepted.get(request_id, ()), pick.token))
        return StepResult(prefilled=prefilled, sampled={r: p.token for r, p in picks.items()},
                          logprobs={r: p.logprob for r, p in picks.items() if p.logprob is not None},
                          cached=cached, accepted={r: a for r, a in accepted.items() if a},
                          proposed=proposed, armed=self._armed)

    def release(self, request_id: str, keep: bool = False) -> None:
        """Free a request's cache (its batch row leaves); called when it finishes or is aborted.
        ``keep`` first offers the cache of its prompt and reply to the prefix cache."""
        tokens = self._tokens.pop(request_id, None)
        if keep and self.prefix is not None and tokens is not None and not is_warmup(request_id):
            # The last sampled token is in the cache only when a queued step fed it.
            cache = self._held(request_id)
            if cache is not None and cache.offset in (len(tokens) - 1, len(tokens)):
                self._offer(tokens[: cache.offset], cache)
        self._hits.pop(request_id, None)
        self._checkpoints.pop(request_id)
        if self.speculation is not None:
            self.speculation.release(request_id)
        self._samplers.pop(request_id, None)
        self._single.pop(request_id, None)
        self._last.pop(request_id, None)
        swap = self._swapped.pop(request_id, None)
        if swap is not None:
            swap.unlink(missing_ok=True)
        if request_id in self._rows:
            self._keep([r for r in self._rows if r != request_id])

    def idle(self) -> None:
        """Nothing is live: hand MLX's cached buffers back to the system, so memory returns
        to its baseline between bursts of requests."""
        if not self._samplers:
            mx.clear_cache()

    def memory(self) -> dict[str, int]:
        """Bytes of MLX buffers in use and kept for reuse, and (glibc) the bytes malloc holds
        free in its arenas: between them and RSS, a leak shows apart from memory that an
        allocator keeps. Safe from any thread: they read counters."""
        out = {"mlx_active": mx.get_active_memory(), "mlx_cache": mx.get_cache_memory()}
        heap = heap_stats()
        if heap is not None:
            out["heap_free"] = heap.free
        return out

    def close(self) -> None:
        """Finish the prefix cache's queued writes and remove the swap directory (the
        engine calls this when it stops)."""
        self._ahead = None
        if self.prefix is not None:
            self.prefix.close()
        if self._swap_dir is not None:
            shutil.rmtree(self._swap_dir, ignore_errors=True)
            self._swap_dir, self._swapped = None, {}

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

    @property
    def decode_traces(self) -> int:
        """Captured steps traced so far (each a new batch shape)."""
        return self._captured.traces if self._captured is not None else 0

    def restart_counts(self) -> None:
        """Count decode forwards and traces from zero again: after the warm-up, whose steps
        the metrics leave out."""
        self.decode_paths = {"captured": 0, "eager": 0}
        if self._captured is not None:
            self._captured.traces = self._captured.replays = 0

    @property
    def swapped_requests(self) -> int:
        return len(self._swapped)

    # ---- prefix cache ----------------------------------------------------------------
    def _attach_prefixes(self, chunks: tuple[PrefillChunk, ...]) -> dict[str, int]:
        """Start each new request from its longest cached prefix; returns the tokens found."""
        found: dict[str, int] = {}
        for chunk in chunks:
            request = chunk.request
            if request.num_computed or request.request_id in self._samplers:
                continue
            self._samplers[request.request_id] = RequestSampler(request.params, self.grammars)
            self._tokens[request.request_id] = list(request.prompt_tokens)
            hit = self.prefix.lookup(request.prompt_tokens) if self.prefix is not None else None
            if self.prefix is not None and self._checkpoints.kinds(self._new_cache)[0]:
                self._checkpoints.part(request.request_id, self.prefix.parting(request.prompt_tokens),
                                       hit.num_tokens if hit is not None else 0)
            if hit is not None:
                self._single[request.request_id] = hit.cache
                self._hits[request.request_id] = found[request.request_id] = hit.num_tokens
        return found

    def _held(self, request_id: str) -> PromptCache | None:
        """The cache a live request holds: its batch row (a copy) or its B = 1 cache."""
        if request_id in self._rows:
            return self._batch.extract(self._rows.index(request_id))
        return self._single.get(request_id)

    def _offer(self, tokens: list[int], cache: PromptCache, checkpoints=()) -> None:
        """Hand a snapshot of ``cache``, holding exactly ``tokens``, to the prefix cache."""
        if cache.offset != len(tokens):
            return
        try:
            self.prefix.insert(tokens, cache, checkpoints)
        except Exception as exc:  # an entry the store cannot take is skipped, never fatal
            log.warning("prefix cache refused an entry: %s: %s", type(exc).__name__, exc)

    # ---- prefill: one request at a time, on its own B = 1 cache ------------------------
    def _prefill(self, chunk: PrefillChunk) -> tuple[dict[str, Pick], int]:
        """Feed a prompt chunk (after any cached prefix); the chunk that completes the prompt
        samples the first token of the request and of each of its forks, which get copies of
        the cache. Returns the picks and the prompt tokens now in the cache beyond before."""
        request = chunk.request
        cache = self._single_cache(request)
        hit = self._hits.pop(request.request_id, 0)
        start = request.num_computed + hit
        n = min(chunk.num_tokens, request.num_prompt_tokens - start)
        at = start
        for cut in self._cuts(request, start, start + n):  # checkpoints of window/state layers
            self.model(mx.array(request.prompt_tokens[at:cut])[None], cache=cache)
            cache.maybe_convert()
            self._checkpoints.take(request.request_id, cache)
            at = cut
        tokens = mx.array(request.prompt_tokens[at : start + n])[None]  # (1, L)
        if start + n < request.num_prompt_tokens:
            if at < start + n:
                self.model(tokens, cache=cache)
                cache.maybe_convert()
            mx.eval(cache.state)
            return {}, hit + n
        logits = last_logits(self.model, tokens, cache)  # (1, V)
        self._complete(cache, [request])
        forks = [f for f in request.forks if not f.finished]  # an aborted choice stays out
        group = [request, *forks]
        for fork in forks:  # one object: the join's merge copies it into each row
            self._samplers[fork.request_id] = RequestSampler(fork.params, self.grammars)
            self._single[fork.request_id] = cache
        ids = [r.request_id for r in group]
        picks = sample_rows([self._samplers[r] for r in ids],
                            mx.broadcast_to(logits, (len(ids), logits.shape[-1])))
        self._last.update((r, p.token) for r, p in zip(ids, picks))
        for fork in forks:
            self._tokens[fork.request_id] = list(request.prompt_tokens)
        return dict(zip(ids, picks)), hit + n

    def _complete(self, cache: PromptCache, requests: list[Request]) -> None:
        """Their prompts are in (row i of ``cache`` holds request i's): convert the raw
        prefill to the scheme and offer each prompt for reuse."""
        cache.convert()
        cache.quantize_after = 0  # every token is in the scheme now, as if it started there
        if self.prefix is not None:
            for i, r in enumerate(requests):
                if not is_warmup(r.request_id):  # the engine's own warm-up is not worth keeping
                    self._offer(r.prompt_tokens, cache.extract(i) if cache.is_batch else cache,
                                self._checkpoints.pop(r.request_id))

    def _prefill_together(self, chunks: list[PrefillChunk]) -> dict[str, Pick]:
        """Whole prompts in one left-padded forward (a larger matmul per weight read than
        one forward each); the batch cache then joins the decode batch as it is.

            prompts  [a b c] [d e]     tokens  a b c      left_padding [0, 1]
                                               0 d e      (slot 0 of row 1 is masked)
        """
        requests = [c.request for c in chunks]
        width = max(r.num_prompt_tokens for r in requests)
        padding = [width - r.num_prompt_tokens for r in requests]
        cache = PromptCache.merge([self._new_cache() for _ in requests])
        cache.prepare(left_padding=padding)
        tokens = mx.array([[0] * pad + r.prompt_tokens for r, pad in zip(requests, padding)])  # (B, L)
        wants = [bool(self._cuts(r, 0, r.num_prompt_tokens)) for r in requests]  # at the last token - 1
        if any(wants):
            self.model(tokens[:, :-1], cache=cache)
            for i, r in enumerate(requests):
                if wants[i]:
                    self._checkpoints.take(r.request_id, cache.extract(i))
            tokens = tokens[:, -1:]
        logits = last_logits(self.model, tokens, cache)  # (B, V)
        self._complete(cache, requests)
        ids = [r.request_id for r in requests]
        picks = sample_rows([self._samplers[r] for r in ids], logits)
        self._last.update((r, p.token) for r, p in zip(ids, picks))
        self._add_rows(cache, ids)
        return dict(zip(ids, picks))

    def _cuts(self, request: Request, start: int, end: int) -> list[int]:
        """Where the prefill of prompt tokens [start, end) stops for checkpoints (none
        without a prefix cache, for the warm-up, or for models of full attention only)."""
        if self.prefix is None or is_warmup(request.request_id):
            return []
        windows, states = self._checkpoints.kinds(self._new_cache)
        return self._checkpoints.cuts(request, start, end, windows, states)

    def _single_cache(self, request: Request) -> PromptCache:
        if request.request_id not in self._single:
            self._single[request.request_id] = self._new_cache()
        return self._single[request.request_id]

    def _new_cache(self) -> PromptCache:
        return PromptCache.for_model(self.model, self.scheme, quantize_after=RAW_PREFILL_TOKENS)

    def warm_stored_chunks(self, tokens: list[int]) -> int:
        """The warm-up's chunks over K/V already in the scheme (``warmup.chunks_over_stored``)."""
        from kvserve.server.engine.warmup import chunks_over_stored

        return chunks_over_stored(self.model, self._new_cache(), tokens)

    # ---- decode: one forward over every decoding request --------------------------------
    def _decode(self, requests: tuple[Request, ...], drafts: dict[str, int]) -> DecodeStep | VerifyStep | None:
        """Queue this step's decode of ``requests``: the step queued ahead when it covers
        exactly them, else a new forward (after undoing the queued one) that verifies the
        rows' proposals when they have any (at most ``drafts[r]`` each)."""
        planned = {r.request_id for r in requests}
        if self._ahead is not None and planned == set(self._rows):
            step, self._ahead = self._ahead.narrow(self._rows).complete(), None
            return step
        self._undo_ahead()
        if not requests:
            return None
        self._park([r for r in self._rows if r not in planned])
        self._join([r.request_id for r in requests if r.request_id not in self._rows])
        proposals = self.speculation.propose(self._rows, drafts, self._tokens) if self.speculation else []
        if any(proposals):
            return self._verify(proposals)
        return self._forward(mx.array([[self._last[r]] for r in self._rows]))  # (B, 1)

    # ---- speculative decoding: proposals verified inside the batch ----------------------
    def _takes_proposals(self, request_id: str) -> bool:
        """Rows whose sampling can take verified proposals: no grammar (its matcher moves
        one token at a time), no logprobs (reported per sampled token) and no thinking budget
        (it may close the block at any position)."""
        params = self._samplers[request_id].params
        return params.grammar is None and not params.logprobs and params.thinking is None

    def _arm(self, rows: list[str]) -> None:
        """Once per step: the rows that propose at the next one (``Speculator.arm``)."""
        if self.speculation is not None:
            self.speculation.arm(rows, self._tokens, self._takes_proposals)

    @property
    def _armed(self) -> frozenset[str]:
        return self.speculation.armed if self.speculation is not None else frozenset()

    def _verify(self, proposals: list[list[int]]) -> VerifyStep:
        """One forward over every row, ``[last, *proposals]`` each, right-padded with the
        row's last token (those slots are dropped after)."""
        width = 1 + max(len(g) for g in proposals)
        tokens = [[self._last[r], *g] + [self._last[r]] * (width - 1 - len(g)) for r, g in zip(self._rows, proposals)]
        self._batch.begin_decode()  # a TurboQuant prompt still raw is compressed first
        self._batch.record_positions()  # recurrent states: one per position, for trim_rows
        logits = self.model(mx.array(tokens), cache=self._batch)  # (B, L, V)
        self._batch.maybe_convert()
        greedy = mx.argmax(logits, axis=-1)  # (B, L)
        mx.async_eval(greedy)
        return VerifyStep(list(self._rows), proposals, logits, greedy)

    def _read_verified(self, step: VerifyStep) -> tuple[dict[str, tuple[int, ...]], dict[str, Pick], dict[str, int]]:
        """Accept per row and drop each row's rejected (and padding) slots from every layer.
        Returns the kept proposals, the picks after them and the proposals verified."""
        width = step.logits.shape[1]
        results = step.accept([self._samplers[r] for r in step.rows])
        assert self._rows[: len(step.rows)] == step.rows, "rows join the batch at its end"
        joined = [0] * (len(self._rows) - len(step.rows))  # joined after the forward: nothing to drop
        self._batch.trim_rows([width - 1 - len(kept) for kept, _ in results] + joined)
        accepted, picks = {}, {}
        for r, (kept, pick) in zip(step.rows, results):
            self._last[r] = pick.token
            accepted[r], picks[r] = tuple(kept), pick
        return accepted, picks, {r: len(g) for r, g in zip(step.rows, step.proposals) if g}

    def _forward(self, tokens: mx.array, ahead: bool = False) -> DecodeStep:
        """One decode forward over the whole batch, sampled per row, evaluation started.
        ``ahead``: fed tokens not read yet, so constrained rows sample later (``complete``)."""
        logits = self._captured(tokens, self._batch) if self._captured is not None else None
        self.decode_paths["eager" if logits is None else "captured"] += 1
        if logits is None:  # not captured: built here, operation by operation
            logits = self.model(tokens, cache=self._batch)[:, -1, :]  # (B, V)
        self._batch.maybe_convert()
        # Each row with its own sampler: per-request filters, penalties and PRNG key.
        draw = draw_rows([self._samplers[r] for r in self._rows], logits, defer=ahead)
        mx.async_eval(draw.arrays())
        return DecodeStep(list(self._rows), draw)

    def _queue_ahead(self, step: DecodeStep | None, ending: set[str]) -> DecodeStep | None:
        """Queue the next decode of every batch row, fed this step's tokens as arrays (rows
        that joined after it: their first token). None when every row ends here, or when
        a row's penalties need its last token counted first. Constrained rows go ahead
        too: their masked sampling waits for the next step (``Draw.complete``)."""
        rows = self._rows
        self._arm(rows)
        if not rows or ending.issuperset(rows) or any(self._samplers[r].params.penalized for r in rows):
            return None
        if isinstance(step, VerifyStep) or self._armed:
            return None  # the next proposals need this step's tokens
        decoded = step.rows if step is not None else []
        assert rows[: len(decoded)] == decoded, "rows join the batch at its end"
        parts = [step.draw.tokens.astype(mx.int32)] if decoded else []
        if len(rows) > len(decoded):
            parts.append(mx.array([self._last[r] for r in rows[len(decoded):]], dtype=mx.int32))
        return self._forward(mx.concatenate(parts)[:, None] if len(parts) > 1 else parts[0][:, None], ahead=True)

    def _read(self, step: DecodeStep | None) -> dict[str, Pick]:
        """Wait for a step's tokens; they become the rows' next decode inputs."""
        if step is None:
            return {}
        picks = step.draw.read()
        self._last.update((r, p.token) for r, p in zip(step.rows, picks))
        return dict(zip(step.rows, picks))

    def _undo_ahead(self) -> None:
        """Drop the queued step: every row loses the slot it wrote, every sampler gets its
        key back (the device may still compute the step; nothing reads it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._batch is not None:
            # Every layer kind can drop its last token: windows keep a reserve, recurrent
            # states the arrays the queued forward replaced.
            if self._batch.trim(1) != 1:
                raise RuntimeError(f"cannot undo the queued decode step of {self._batch!r}")
            ahead.draw.undo()

    # ---- preemption: a request's cache goes to a swap file and comes back as it was -----
    def _swap_out(self, request_id: str) -> None:
        self._undo_ahead()  # the row leaves as the last read step left it
        if request_id in self._rows:
            self._park([request_id])
        cache = self._single.pop(request_id)
        if self.speculation is not None:  # a draft model's cache is rebuilt when it resumes
            self.speculation.proposer.release(request_id)
        if self._swap_dir is None:
            self._swap_dir = Path(tempfile.mkdtemp(prefix="kvserve-swap-", dir=self._swap_root))
        self._swap_count += 1  # file names never carry request input
        path = self._swap_dir / f"{self._swap_count}.safetensors"
        self._swapped[request_id] = save_layers(path, cache.layers)

    def _swap_in(self, request_id: str) -> None:
        path = self._swapped.pop(request_id)
        layers, _ = load_layers(path)
        path.unlink()
        self._single[request_id] = PromptCache(layers, self.scheme)

    def _join(self, request_ids: list[str]) -> None:
        """Move B = 1 caches into the decode batch as new rows (one merge, one extend)."""
        if not request_ids:
            return
        self._add_rows(PromptCache.merge([self._single.pop(r) for r in request_ids]), request_ids)

    def _add_rows(self, batch: PromptCache, request_ids: list[str]) -> None:
        """Append a batch container's rows (one per request id) to the decode batch."""
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.extend(batch)
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
            self._batch, self._rows, self._ahead = None, [], None
            return
        self._batch.filter([self._rows.index(r) for r in request_ids])
        self._rows = list(request_ids)


def _ending(plan: StepPlan, prompt_picks: dict[str, Pick]) -> set[str]:
    """Requests whose token of this step is their last by ``max_tokens``."""
    out = {r.request_id for r in plan.decode if r.num_generated + 1 >= r.params.max_tokens}
    for chunk in plan.prefill:
        for r in (chunk.request, *chunk.request.forks):
            if r.request_id in prompt_picks and r.params.max_tokens <= 1:
                out.add(r.request_id)
    return out
