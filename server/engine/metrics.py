"""Engine metrics in the Prometheus text format (version 0.0.4), without a client library.

The engine thread records; ``GET /metrics`` renders. Counters and histograms only grow, so
a render that races a step reads at worst one step behind; a lock keeps each histogram's
buckets, sum and count consistent with each other.

Example:
    >>> m = Histogram("kvserve_step_seconds", "Engine step time.", (0.01, 0.1))
    >>> m.observe(0.05); m.observe(0.5)
    >>> print("\\n".join(m.render({"kv_scheme": "fp16"})))
    # HELP kvserve_step_seconds Engine step time.
    # TYPE kvserve_step_seconds histogram
    kvserve_step_seconds_bucket{kv_scheme="fp16",le="0.01"} 0
    kvserve_step_seconds_bucket{kv_scheme="fp16",le="0.1"} 1
    kvserve_step_seconds_bucket{kv_scheme="fp16",le="+Inf"} 2
    kvserve_step_seconds_sum{kv_scheme="fp16"} 0.55
    kvserve_step_seconds_count{kv_scheme="fp16"} 2
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# Latency buckets in seconds: from one fast decode step to a long queue wait.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return repr(round(value, 9)) if isinstance(value, float) else str(value)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        with self._lock:
            i = bisect.bisect_left(self.buckets, value)
            if i < len(self.counts):
                self.counts[i] += 1
            self.total += value
            self.count += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        with self._lock:
            counts, total, count = list(self.counts), self.total, self.count
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, counts):
            running += n
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': _num(bound)})} {running}")
        lines.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {count}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_num(total)}")
        lines.append(f"{self.name}_count{_labels(labels)} {count}")
        return lines


class EngineMetrics:
    """What the engine thread records; ``render`` reads it from any thread."""

    def __init__(self, kv_scheme: str):
        self.kv_scheme = kv_scheme
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.draft_proposed = 0  # speculative tokens verified
        self.draft_accepted = 0  # of those, accepted
        self.finished: Counter[str] = Counter()
        self.waiting = 0
        self.running = 0
        self.kv_bytes = 0
        self.kv_budget_bytes = 0  # --kv-memory, or its default
        self.kv_bytes_by_rank: dict[int, int] = {}  # a model split across processes: each one's
        self.swapped = 0
        self.decode_paths = {"captured": 0, "eager": 0}  # decode forwards by path (ModelRunner)
        self.decode_traces = 0
        self.kernel_programs = 0  # kvserve kernel programs compiled after the warm-up
        # ModelRunner.memory, read at each render: allocator counters need no engine step.
        self.memory: Callable[[], dict[str, int]] = dict
        self.prefix: dict | None = None  # PrefixCache.stats() after the latest step
        self.ttft = Histogram("kvserve_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.")
        self.itl = Histogram("kvserve_inter_token_latency_seconds",
                             "Time between consecutive tokens of a request.")
        self.e2e = Histogram("kvserve_request_latency_seconds", "Time from arrival to the finish.")
        self.step = Histogram("kvserve_step_seconds", "Time of one engine step (model and sampling).")

    def render(self) -> str:
        """The whole exposition."""
        scheme = {"kv_scheme": self.kv_scheme}
        lines = [
            *_metric("kvserve_requests_waiting", "gauge", "Requests queued, not yet running.", self.waiting),
            *_metric("kvserve_requests_running", "gauge", "Requests prefilling or decoding.", self.running),
            *_metric("kvserve_requests_swapped", "gauge", "Preempted requests whose cache is on disk.",
                     self.swapped),
            *_metric("kvserve_kv_cache_bytes", "gauge", "Bytes allocated by the KV caches of live requests.",
                     self.kv_bytes, scheme),
            *_metric("kvserve_kv_budget_bytes", "gauge",
                     "Bytes the KV caches of live requests may hold (--kv-memory).", self.kv_budget_bytes, scheme),
            *_by_rank("kvserve_kv_cache_rank_bytes", "Bytes of KV caches held by each process of a split model.",
                      self.kv_bytes_by_rank, scheme),
            *_metric("kvserve_prompt_tokens_total", "counter", "Prompt tokens computed (cached ones not).",
                     self.prompt_tokens),
            *_metric("kvserve_generation_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
            *_metric("kvserve_preemptions_total", "counter", "Requests swapped out for KV memory.",
                     self.preemptions),
            *_metric("kvserve_speculative_proposed_tokens_total", "counter",
                     "Proposed tokens verified by the model (speculative decoding).", self.draft_proposed, scheme),
            *_metric("kvserve_speculative_accepted_tokens_total", "counter",
                     "Proposed tokens the model accepted.", self.draft_accepted, scheme),
            *_by_label("kvserve_decode_steps_total", "Decode forwards by path: replayed from a capture "
                       "(kvserve_decode_traces_total of them traced first) or built eagerly.", "path",
                       self.decode_paths),
            *_metric("kvserve_decode_traces_total", "counter",
                     "Decode steps traced for capture (one per new batch shape).", self.decode_traces),
            *_metric("kvserve_kernel_programs_compiled_total", "counter",
                     "kvserve's CUDA kernel programs compiled after the warm-up (a request waits on each).",
                     self.kernel_programs),
            *_by_label("kvserve_requests_finished_total", "Finished requests by finish reason.", "reason",
                       {r: self.finished[r] for r in ("stop", "length", "abort", "error", "timeout")}),
        ]
        for hist in (self.ttft, self.itl, self.e2e, self.step):
            lines += hist.render(scheme)
        lines += _memory_lines(self.memory())
        if self.prefix is not None:
            lines += _prefix_lines(self.prefix, scheme)
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help: str, value: float, labels: dict[str, str] | None = None) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name}{_labels(labels or {})} {_num(value)}"]


def _by_rank(name: str, help: str, values: dict[int, int], labels: dict[str, str]) -> list[str]:
    """A gauge per process rank (nothing for one process).

    >>> _by_rank("b", "Bytes.", {0: 5, 1: 3}, {"kv_scheme": "fp16"})[2:]
    ['b{kv_scheme="fp16",rank="0"} 5', 'b{kv_scheme="fp16",rank="1"} 3']
    """
    if not values:
        return []
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge",
            *(f"{name}{_labels({**labels, 'rank': str(r)})} {_num(v)}" for r, v in sorted(values.items()))]


def _by_label(name: str, help: str, label: str, values: dict[str, float]) -> list[str]:
    """One counter with one sample per value of ``label``."""
    return [f"# HELP {name} {help}", f"# TYPE {name} counter",
            *(f"{name}{_labels({label: key})} {_num(v)}" for key, v in values.items())]


# What each ``ModelRunner.memory()`` key measures; a key the runner does not report is left out.
MEMORY_GAUGES = {
    "mlx_active": ("kvserve_mlx_active_memory_bytes", "Bytes of MLX buffers in use (weights, caches, "
                   "activations)."),
    "mlx_cache": ("kvserve_mlx_cache_memory_bytes", "Bytes of freed MLX buffers kept for reuse."),
    "heap_free": ("kvserve_heap_free_bytes", "Bytes malloc holds free inside its arenas (glibc)."),
}


def _memory_lines(memory: dict[str, int]) -> list[str]:
    """Memory gauges, for telling a leak from a cache or allocator holding freed memory.

    >>> print("\\n".join(_memory_lines({"mlx_cache": 4096})))
    # HELP kvserve_mlx_cache_memory_bytes Bytes of freed MLX buffers kept for reuse.
    # TYPE kvserve_mlx_cache_memory_bytes gauge
    kvserve_mlx_cache_memory_bytes 4096
    """
    lines = []
    for key, (name, help) in MEMORY_GAUGES.items():
        if key in memory:
            lines += _metric(name, "gauge", help, memory[key])
    return lines


def _prefix_lines(p: dict, scheme: dict[str, str]) -> list[str]:
    """The prefix cache's counters and sizes (``PrefixCache.stats()``)."""
    lines = [*_metric("kvserve_prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix.",
                      p["hits"], scheme),
             *_metric("kvserve_prefix_cache_misses_total", "counter", "Prompts with no cached prefix.",
                      p["misses"], scheme),
             *_metric("kvserve_prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused.",
                      p["hit_tokens"], scheme),
             *_metric("kvserve_prefix_cache_disk_hits_total", "counter", "Hits read from the SSD tier.",
                      p["disk_hits"], scheme)]
    for tier in ("ram", "disk"):
        lines += _metric(f"kvserve_prefix_cache_{tier}_bytes", "gauge", f"Bytes held by the {tier} tier.",
                         p[f"{tier}_bytes"], scheme)
        lines += _metric(f"kvserve_prefix_cache_{tier}_entries", "gauge", f"Entries in the {tier} tier.",
                         p[f"{tier}_entries"], scheme)
    lines += _metric("kvserve_prefix_cache_dropped_writes_total", "counter",
                     "Spills dropped because the writer queue was full.", p["dropped_spills"], scheme)
    lines += _metric("kvserve_prefix_cache_write_errors_total", "counter", "Failed disk writes.",
                     p["write_errors"], scheme)
    for key, help in (("checkpoints_stored", "Checkpoints of window and state layers kept with entries."),
                      ("checkpoint_hits", "Hits that resumed a window or state layer from a checkpoint."),
                      ("checkpoints_evicted", "Checkpoints that left with an evicted entry.")):
        lines += _metric(f"kvserve_prefix_cache_{key}_total", "counter", help, p[key], scheme)
    return lines + _by_label("kvserve_prefix_cache_refused_files_total", "Cache files refused, by reason.",
                             "reason", dict(sorted(p["refused"].items())))
