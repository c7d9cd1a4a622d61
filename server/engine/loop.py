"""The engine thread: the one thread that owns the model, every MLX array and every cache.

Other threads talk to it only through its inbox (``submit``, ``abort``, ``stop``) and
receive ``TokenEvent`` objects through the per-request sink they passed to ``submit``.
A sink is called on the engine thread and must only hand the event over (for example with
``loop.call_soon_threadsafe``), never block.

One iteration: drain the inbox, ask the scheduler for a ``StepPlan``, let the runner
execute it, commit the ``StepResult``, turn sampled tokens into text and events.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.configs import EngineConfig
from kvserve.kernels import cuda_programs
from kvserve.server.engine.device import PREFILL_STEP
from kvserve.server.engine.kv_memory import KVBudget, kv_budget
from kvserve.server.engine.metrics import EngineMetrics
from kvserve.server.engine.output import OutputState, StopMatcher
from kvserve.server.engine.request import FinishReason, Request, RequestStatus, TokenEvent, Usage
from kvserve.server.engine.scheduler import QueueFull, Scheduler, StepPlan, StepResult
from kvserve.server.engine.warmup import WarmupFailed, WarmupReport

log = logging.getLogger("kvserve.engine")

Sink = Callable[[TokenEvent], None]

# A step that makes no progress for this long while requests wait means the engine is stuck.
STUCK_AFTER_S = 120.0


class EngineDown(RuntimeError):
    """The engine cannot serve any more (a process of a split model is gone, or the processes
    disagree): raised by a runner, it fails every request and ends the engine thread. Raised
    by ``submit`` afterwards, the HTTP layer answers 503."""


def await_thread_exit(native_id: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the OS thread ``native_id`` to be gone (Linux: its entry
    under /proc/self/task); True once it is, or where there is no /proc to tell.

    ``Thread.join`` returns before a thread's C++ thread-local destructors run, and MLX's
    compile cache is one: its entries take the GIL to drop the Python objects they hold. A
    script that ends right after ``Engine.stop`` then finalizes the interpreter while the
    engine thread's destructors wait for the GIL, and the process aborts ("terminate called
    without an active exception", two runs in three on a 2-core CPU). Waiting here lets them
    run while the interpreter is whole.

        >>> t = threading.Thread(target=lambda: None); t.start(); t.join()
        >>> await_thread_exit(t.native_id, 5.0)
        True
    """
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@dataclass(frozen=True)
class LoadedModel:
    """What the loader hands the engine: the runner, the tokenizer and facts for clients."""

    runner: Any  # ModelRunner; typed loosely so this module never imports mlx
    tokenizer: Any  # mlx-lm TokenizerWrapper
    info: Any  # ModelInfo
    grammars: Any = None  # Grammars: structured output for this tokenizer
    kv_token_bytes: int = 0  # what one token adds to a request's KV cache (kv_memory.token_bytes)
    device: Any = None  # DeviceProfile: what serves on this device (device.py)
    # The prefix cache keeps checkpoints where a prompt's messages end (window or state
    # layers): the HTTP layer then finds those ends (``conversation.message_ends``).
    message_ends: bool = False


@dataclass
class _Live:
    request: Request
    sink: Sink
    output: OutputState
    last_token_time: float | None = None


class Engine:
    """Runs ``load`` and then the step loop on a dedicated thread."""

    def __init__(self, load: Callable[[], LoadedModel], config: EngineConfig):
        self.config = config
        self._load = load
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvserve-engine", daemon=True)
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since: float | None = None
        self._down: str | None = None  # why the engine stopped serving (EngineDown)
        self._down_event = threading.Event()
        self.model: LoadedModel | None = None
        self.kv_budget: KVBudget | None = None  # known once the model is loaded
        # submit() bounds what is in flight; the inbox may hand the scheduler all of it at
        # once, before a step admits any, so its waiting queue holds that whole bound.
        # Chunk sizes the config leaves unset are the device profile's, known once loaded.
        step, step_tokens = config.step_sizes(PREFILL_STEP["cpu"])
        self.scheduler = Scheduler(config.max_batch_size, step,
                                   config.max_queued_requests + config.max_batch_size,
                                   step_tokens, None,  # KV tokens: set once loaded
                                   config.num_draft_tokens if config.speculative != "off" else 0)
        self._live: dict[str, _Live] = {}
        self.metrics = EngineMetrics(kv_scheme="")  # named once the model (and scheme) loaded
        self.warmup: WarmupReport | None = None  # what the warm-up ran, where the device has one
        self._programs: int | None = None  # kernel programs compiled when serving began

    # ---- called from other threads -------------------------------------------------
    def start(self) -> LoadedModel:
        """Start the thread, wait for the model to load and warm up; re-raise either's failure
        here (``WarmupFailed`` for the warm-up's)."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error
        return self.model

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request (and its forks: the ``n`` choices share ``sink``, their events
        tell them apart by ``request_id``); raises ``QueueFull`` when there is no room."""
        size = 1 + len(request.forks)
        with self._lock:
            if self._down is not None:
                raise EngineDown(self._down)
            if self._inflight + size > self.config.max_queued_requests + self.scheduler.max_running:
                raise QueueFull(f"{self._inflight} requests are already in flight")
            self._inflight += size
        self._inbox.put(("submit", request, sink))

    def abort(self, request_id: str) -> None:
        """Stop a request and all its forks."""
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is running, flush the writers, then end the thread; False when the
        thread was still running after ``timeout`` seconds."""
        self._inbox.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        await_thread_exit(self._thread.native_id, 5.0 if timeout is None else timeout)
        return True

    def health(self) -> tuple[bool, str]:
        if self._down is not None:
            return False, self._down
        if not self._thread.is_alive():
            return False, "engine thread is not running"
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > STUCK_AFTER_S:
            return False, f"engine step has not finished for {time.monotonic() - busy:.0f} s"
        return True, "ok"

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def down(self) -> str | None:
        """Why the engine stopped serving, or None (``EngineDown``)."""
        return self._down

    def wait_down(self) -> str:
        """Block until the engine goes down; returns why."""
        self._down_event.wait()
        return self._down

    def fail_now(self, reason: str) -> None:
        """From any thread, when the engine thread may never come back (a process of a split
        model died while this one waited on it): every live request ends with ``reason``,
        /health answers 503, ``submit`` refuses, ``wait_down`` returns."""
        with self._lock:
            if self._down is not None:
                return
            self._down = reason
        log.error("engine down: %s", reason)
        for live in list(self._live.values()):
            live.sink(TokenEvent(live.request.request_id, "", finish_reason=FinishReason.ERROR,
                                 usage=_usage(live.request), error=reason))
        self._down_event.set()

    # ---- engine thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model = self._load()
        except BaseException as exc:  # reported to start(), which re-raises it
            self._start_error = exc
            self._ready.set()
            return
        self.kv_budget = kv_budget(self.config.kv_memory, self.model.kv_token_bytes)
        self.scheduler.max_kv_tokens = self.kv_budget.tokens
        if self.model.device is not None:
            self.scheduler.prefill_step_size, self.scheduler.max_step_tokens = self.config.step_sizes(
                self.model.device.prefill_step_size)
        if self.model.device is not None and self.model.device.warmup:
            try:
                self._warm_up()
            except WarmupFailed as exc:  # reported to start(), which re-raises it
                self._start_error = exc
                self.model.runner.close()
                self._ready.set()
                return
        self._programs = cuda_programs.compiled()  # from here on, each new one stalls a request
        self.metrics.kv_budget_bytes = self.kv_budget.bytes
        self.metrics.kv_scheme = self.model.info.kv_scheme
        self.metrics.memory = self.model.runner.memory
        if self.model.runner.prefix is not None:  # files found at start-up show before any step
            self.metrics.prefix = self.model.runner.prefix.stats()
        self._ready.set()
        try:
            self._run()
        except EngineDown as exc:
            self._go_down(str(exc))
        finally:
            self.model.runner.close()

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self.scheduler.has_work):
            stopping |= self._drain_inbox(block=not self.scheduler.has_work and not stopping)
            self._expire_waiting(time.monotonic())
            self._step()

    def _step(self) -> StepPlan | None:
        """Schedule and run one step; the plan it ran, or None."""
        plan = self.scheduler.schedule()
        if plan.empty:
            if self.scheduler.running:  # requests no step can advance: never spin on them
                log.error("engine: no step can advance %d running request(s)", len(self.scheduler.running))
                self._fail_running("engine error: the request could not be scheduled")
            self._observe_idle()
            return None
        started = self._busy_since = time.monotonic()
        try:
            result = self.model.runner.execute(plan)
        except EngineDown:
            raise
        except Exception as exc:  # fail the step's requests, keep serving others
            log.exception("engine step failed")
            self._fail_running(f"engine error: {type(exc).__name__}: {exc}")
            return None
        finally:
            self._busy_since = None
        self.metrics.step.observe(time.monotonic() - started)
        self.scheduler.commit(result)
        self._emit(result)
        self._observe(plan, result)
        return plan

    def _warm_up(self) -> None:
        """Serve ``warmup_requests`` to this engine before it says ready, through the same
        steps as any request; the prefix cache keeps none of them, the metrics count none."""
        from kvserve.server.engine.device import kernel_files
        from kvserve.server.engine.warmup import warmup_requests, warmup_tokens

        device = self.model.device
        report, kernels, started = WarmupReport(), kernel_files(device), time.monotonic()
        programs = cuda_programs.compiled()
        errors: list[str] = []
        tokens = warmup_tokens(self.model.tokenizer)
        requests = warmup_requests(self.scheduler.max_running, self.scheduler.prefill_step_size,
                                   tokens, self.model.info.context_length, self.scheduler.max_step_tokens)
        try:
            self._serve_to_self(requests, report, errors)
            report.prefill_chunks += self.model.runner.warm_stored_chunks(tokens)
        except Exception as exc:  # a step's failure fails its requests; this one ends the warm-up
            errors.append(f"{type(exc).__name__}: {exc}")
        report.seconds, report.compiled = time.monotonic() - started, kernel_files(device) - kernels
        report.programs = cuda_programs.compiled() - programs
        report.error = errors[0] if errors else ""
        self.warmup = report
        if report.error:
            raise WarmupFailed(report, len(requests), max(len(r.prompt_tokens) for r in requests))
        self.metrics = EngineMetrics(kv_scheme="")
        self.model.runner.restart_counts()
        # The warm-up's freed buffers go back now, not when the first requests end: MLX keeps
        # them for reuse, and an 8B-shape server's warm-up left ~138 GiB of an H200 held.
        self.model.runner.idle()
        log.info("%s", report.describe())

    def _serve_to_self(self, requests: list[Request], report: WarmupReport, errors: list[str]) -> None:
        """Admit ``requests`` and step until none is left; each failed one's error goes to
        ``errors``."""
        for request in requests:
            self._inflight += 1
            self._admit(request, lambda event: errors.append(event.error) if event.error else None)
        while self.scheduler.has_work:
            plan = self._step()
            if plan is not None:
                report.steps += 1
                report.prefill_chunks += len(plan.prefill)
                if plan.decode:
                    report.batch_sizes.add(len(plan.decode))

    def _go_down(self, reason: str) -> None:
        """Fail every request, running, waiting or still in the inbox; refuse new ones."""
        with self._lock:
            told, self._down = self._down is not None, self._down or reason
        if told:  # fail_now already ended every request
            self._down_event.set()
            return
        log.error("engine down: %s", reason)
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.request_id in self._live:
                self._finish(request, FinishReason.ERROR, "", error=reason)
        try:
            while True:
                command = self._inbox.get_nowait()
                if command[0] == "submit":
                    self._admit(command[1], command[2])
                    self._finish(command[1], FinishReason.ERROR, "", error=reason)
        except queue.Empty:
            pass
        self._down_event.set()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; returns True when asked to stop. While idle, waits at most
        the runner's ``heartbeat_s`` (a split model's processes check on each other)."""
        stop = False
        try:
            command = self._inbox.get(block=block, timeout=self.model.runner.heartbeat_s if block else None)
            while True:
                stop |= self._apply(command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return stop

    def _apply(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "submit":
            self._admit(command[1], command[2])
        elif kind == "abort":
            request = self.scheduler.find(command[1])
            for member in ([request, *request.forks] if request is not None else []):
                if member.request_id in self._live:
                    self._finish(member, FinishReason.ABORT, "")
        return kind == "stop"

    def _admit(self, request: Request, sink: Sink) -> None:
        tokenizer = self.model.tokenizer
        for member in (request, *request.forks):
            output = OutputState(
                detokenizer=tokenizer.detokenizer,
                matcher=StopMatcher(member.params.stop),
                eos_token_ids=frozenset(() if member.params.ignore_eos else tokenizer.eos_token_ids),
            )
            self._live[member.request_id] = _Live(member, sink, output)
        self.scheduler.add(request)

    def _expire_waiting(self, now: float) -> None:
        """Requests that waited in the queue longer than ``queue_timeout_s`` leave it with a
        ``TIMEOUT`` finish (checked between steps). A preempted request has already streamed
        tokens and waits to resume, not to start: the limit does not apply to it."""
        limit = self.config.queue_timeout_s
        if not limit:
            return
        for request in [r for r in self.scheduler.waiting if not r.swapped and now - r.arrival_time > limit]:
            self._finish(request, FinishReason.TIMEOUT, "",
                         error=f"the request waited more than {limit:g} s in the queue; retry later")

    def _emit(self, result: StepResult) -> None:
        now = time.monotonic()
        for request_id, token in result.sampled.items():
            tokens = (*result.accepted.get(request_id, ()), token)
            logprobs = (result.logprobs[request_id],) if request_id in result.logprobs else ()
            self._emit_tokens(self._live[request_id], tokens, logprobs, now)

    def _emit_tokens(self, live: _Live, tokens: tuple[int, ...], logprobs: tuple, now: float) -> None:
        """Feed a step's tokens (one, or accepted proposals then one) to a request's output;
        one event carries their text. Tokens after a stop are dropped and not counted."""
        request, parts = live.request, []
        before = request.num_generated - len(tokens)  # the scheduler counted all of them
        for i, token in enumerate(tokens):
            self._time_token(live, now)
            text, stopped = live.output.add_token(token)
            parts.append(text)
            if stopped or before + i + 1 >= request.params.max_tokens:
                request.num_generated = before + i + 1  # what came after the end never counts
                reason = FinishReason.STOP if stopped else FinishReason.LENGTH
                tail = "" if stopped else live.output.finish()
                self._finish(request, reason, "".join(parts) + tail, logprobs=logprobs)
                return
        text = "".join(parts)
        if text or logprobs:
            live.sink(TokenEvent(request.request_id, text, tokens, logprobs=logprobs))

    def _time_token(self, live: _Live, now: float) -> None:
        request = live.request
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.ttft.observe(now - request.arrival_time)
        elif live.last_token_time is not None:
            self.metrics.itl.observe(now - live.last_token_time)
        live.last_token_time = now
        self.metrics.generated_tokens += 1

    def _finish(self, request: Request, reason: FinishReason, text: str, error: str | None = None,
                logprobs: tuple = ()) -> None:
        live = self._live.pop(request.request_id)
        self.scheduler.finish(request, reason)
        # A finished prompt + reply is the start of a chat's next turn: offer it for reuse.
        self.model.runner.release(request.request_id, keep=reason in (FinishReason.STOP, FinishReason.LENGTH))
        with self._lock:
            self._inflight -= 1
        self.metrics.finished[reason.value] += 1
        self.metrics.e2e.observe(time.monotonic() - request.arrival_time)
        live.sink(TokenEvent(request.request_id, text, finish_reason=reason, usage=_usage(request),
                             error=error, logprobs=logprobs, stop=live.output.matcher.matched))
        for fork in request.forks:  # choices that never started die with their leader
            if fork.status is RequestStatus.WAITING and fork.request_id in self._live:
                self._finish(fork, reason, "", error)

    def _fail_running(self, message: str) -> None:
        for request in list(self.scheduler.running):
            if request.request_id in self._live:
                self._finish(request, FinishReason.ERROR, "", error=message)

    def _observe(self, plan: StepPlan, result: StepResult) -> None:
        """Gauges and counters after a step (read by ``GET /metrics``)."""
        m, runner = self.metrics, self.model.runner
        m.prompt_tokens += sum(result.prefilled.values()) - sum(result.cached.values())
        m.preemptions += len(plan.swap_out)
        m.draft_proposed += sum(result.proposed.values())
        m.draft_accepted += sum(len(a) for a in result.accepted.values())
        m.waiting, m.running = len(self.scheduler.waiting), len(self.scheduler.running)
        m.kv_bytes, m.swapped = runner.kv_bytes, runner.swapped_requests
        m.kv_bytes_by_rank = runner.kv_bytes_by_rank
        m.decode_paths, m.decode_traces = dict(runner.decode_paths), runner.decode_traces
        if runner.prefix is not None:
            m.prefix = runner.prefix.stats()
        self._note_programs()

    def _note_programs(self) -> None:
        """Name each kernel program compiled since the warm-up (a request waited on it)."""
        if self._programs is None:
            return
        for key in cuda_programs.since(self._programs):
            log.warning("kernel program compiled while serving: %s", cuda_programs.describe(key))
        self.metrics.kernel_programs += cuda_programs.compiled() - self._programs
        self._programs = cuda_programs.compiled()

    def _observe_idle(self) -> None:
        if self.metrics.running or self.metrics.kv_bytes:
            self._observe(StepPlan(), StepResult())
        if not self.scheduler.has_work:
            self.model.runner.idle()


def _usage(request: Request) -> Usage:
    return Usage(request.num_prompt_tokens, request.num_generated, request.num_prefix_cached)
