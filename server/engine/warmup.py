"""Warm-up: the requests an engine serves to itself before the server says ready, so that no
client request waits on a kernel compile.

On a GPU every new kernel (an MLX operation in a new dtype or layout, a fused attention
kernel and its first-call check against the reference, a sampling path) compiles at its
first call: a first server on a fresh machine made its first clients wait 36-43 s (TTFT p99,
`docs/benchmarks/gpu-serve.md`). The warm-up serves, through the same scheduler and runner
as any request, ``max_batch_size`` requests whose prompts are prefilled together and in
chunks and whose rows leave the batch one step apart, so decode steps run at every batch
size from the full batch down to one, greedy and sampled, with and without logprobs and
penalties.

    >>> rs = warmup_requests(4, prefill_step_size=16, tokens=[7, 8, 9])
    >>> [(len(r.prompt_tokens), r.params.max_tokens, r.params.greedy) for r in rs]
    [(5, 7, True), (4, 8, False), (21, 9, True), (29, 10, False)]
    >>> [r.params.logprobs for r in rs], [r.params.presence_penalty for r in rs]
    ([False, True, False, False], [0.0, 0.0, 0.0, 0.5])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.server.engine.request import Request, SamplingParams

WARMUP_PREFIX = "warmup-"


@dataclass
class WarmupReport:
    """What the warm-up ran: decode batch sizes seen, steps, seconds, kernel files and
    kvserve kernel programs compiled (``kvserve.kernels.cuda_programs``)."""

    batch_sizes: set[int] = field(default_factory=set)
    prefill_chunks: int = 0
    steps: int = 0
    seconds: float = 0.0
    compiled: int = 0  # kernel files the device's cache folder gained
    programs: int = 0  # kvserve's kernel programs compiled (in memory only, every process)
    error: str = ""

    def describe(self) -> str:
        sizes = sorted(self.batch_sizes)
        span = f"{sizes[0]}-{sizes[-1]}" if sizes else "none"
        failed = f"; failed: {self.error}" if self.error else ""
        return (f"warm-up: {self.steps} steps, {self.prefill_chunks} prompt chunks, decode batch sizes {span}, "
                f"{self.compiled} kernel files and {self.programs} kernel programs compiled, "
                f"{self.seconds:.1f} s{failed}")


class WarmupFailed(RuntimeError):
    """The warm-up could not serve its own requests, so the server does not say ready: what
    failed there would fail its first clients too. On a GPU that is most often memory: two
    8B-shaped servers warming up at once on one H200 both ran out of it, and one such server
    alone still held 138 of the H200's ~140 GiB when it said ready (MLX lets each process
    keep freed buffers up to nearly all of the device, counting only its own).

        >>> e = WarmupFailed(WarmupReport(steps=3, error="engine error: out of memory"), 4, 29)
        >>> print(str(e).split("; failed: ")[1].split(": where")[0])
        engine error: out of memory. The warm-up's 4 requests (prompts of up to 29 tokens) could not be served
    """

    def __init__(self, report: WarmupReport, requests: int, longest: int):
        super().__init__(f"{report.describe()}. The warm-up's {requests} requests (prompts of up to {longest} "
                         "tokens) could not be served: where another process shares the device, it may "
                         "hold most of its memory (MLX keeps what a process has freed), so give this server "
                         "a device of its own; else lower --max-batch-size or --kv-memory, or start without "
                         "the warm-up (--warmup off)")


def warmup_requests(batch: int, prefill_step_size: int, tokens: list[int], context: int = 0,
                    step_tokens: int = 0) -> list[Request]:
    """``batch`` requests over ``tokens`` repeated: row i has a prompt of
    ``5 + i * prefill_step_size // 2`` tokens (the last ones cross a chunk boundary; at most
    what ``context`` leaves, where given), but row 1 has 4: rows 0 and 1 prefill together,
    row 1 left-padded by one slot, as short prompts that arrive at once are (on a GPU their
    attention under the padding's mask is a kernel program of its own, which a served engine
    compiled for seconds while its first requests waited). Rows join the batch as their
    prompts complete and leave one step apart: each generates ``lead + 1 + i`` tokens, where ``lead`` is the steps
    all prompts need at ``step_tokens`` per step (less one token per decoding row), so the
    batch grows to ``batch`` rows and shrinks back to one. Odd rows sample at temperature
    0.8 with top-p and top-k, row 1 asks for logprobs, row 3 adds a penalty."""
    lengths = []
    for i in range(batch):
        n = 4 if i == 1 else 5 + i * max(prefill_step_size // 2, 1)
        lengths.append(max(1, min(n, context - 2 * batch - 1)) if context else n)
    per_step = max((step_tokens or prefill_step_size) - batch, 1)
    lead = -(-sum(lengths) // per_step) + 1
    requests = []
    for i, n in enumerate(lengths):
        prompt = (tokens * (n // max(len(tokens), 1) + 1))[:n]
        sampled = i % 2 == 1
        params = SamplingParams(max_tokens=lead + 1 + i, temperature=0.8 if sampled else 0.0,
                                top_p=0.95 if sampled else 1.0, top_k=40 if sampled else 0, seed=i,
                                logprobs=i == 1, top_logprobs=2 if i == 1 else 0,
                                presence_penalty=0.5 if i == 3 else 0.0)
        requests.append(Request(prompt_tokens=prompt, params=params, request_id=f"{WARMUP_PREFIX}{i}"))
    return requests


CHUNKS_OVER_STORED = (1, 2, 9)  # tokens of each warm-up chunk over stored K/V (below)


def chunks_over_stored(model, cache, tokens: list[int]) -> int:
    """Prompt chunks over K/V already in the scheme (a question after a cached prefix),
    which the warm-up's requests never run (their chunks attend over the raw prefill): into
    ``cache`` (a new B = 1 cache of the model), ``tokens``, converted to the scheme, then
    chunks of 1, 2 and 9 tokens, so the attention kernels for them are compiled before any
    request needs them. Returns the chunks run. One token is a prompt found whole in the
    prefix cache but its last token, whose chunk has no mask (a program of its own, which a
    served engine on an H200 compiled for seconds while its requests waited); 2 tokens are 2 x (query
    heads per KV head) rows under a causal mask, 8 or fewer where a KV head serves up to 4
    query heads (one row tile); 9 tokens are always more."""
    import mlx.core as mx  # here: the scheduler imports this module without MLX

    model(mx.array(tokens)[None], cache=cache)
    cache.convert()
    cache.quantize_after = 0
    for n in CHUNKS_OVER_STORED:
        mx.eval(model(mx.array((tokens * n)[:n])[None], cache=cache))
    return len(CHUNKS_OVER_STORED)


def is_warmup(request_id: str) -> bool:
    """A warm-up request: the prefix cache keeps nothing of it."""
    return request_id.startswith(WARMUP_PREFIX)


def warmup_tokens(tokenizer) -> list[int]:
    """Prompt tokens of an ordinary sentence, without the special tokens a template adds."""
    ids = list(tokenizer.encode("The warm-up of a server: one short sentence, said again and again.",
                                add_special_tokens=False))
    return ids or [0]
