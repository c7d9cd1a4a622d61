"""The device profile and the warm-up: which model rewrites serve on which device, and an engine
that serves a batch to itself before it says ready, then answers as a cold one."""

from __future__ import annotations

import collections
import logging
import os
import queue

import mlx.core as mx
import mlx.nn as nn
import pytest

from kvserve.cache import parse_scheme
from kvserve.configs import CacheConfig, ConfigError, EngineConfig, ModelConfig
from kvserve.kernels import cuda_programs
from kvserve.server.engine.device import CPU_REWRITES, profile_for
from kvserve.server.engine.projections import ProjectionPart
from kvserve.server.engine.fastpath import TableRoPE
from kvserve.server.engine.loop import Engine
from kvserve.server.engine.model_loader import load_model, make_loader
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.cli import _run as cli_run
from kvserve.server.engine.runner import ModelRunner
from kvserve.server.engine.warmup import WarmupFailed, warmup_requests


def _ropes(model) -> set[type]:
    return {type(m) for _, m in model.named_modules() if isinstance(m, (nn.RoPE, TableRoPE))}


@pytest.mark.parametrize("backend, rope, rewrites, chunk", [
    ("cpu", TableRoPE, CPU_REWRITES, 256), ("cuda", nn.RoPE, ("fused_projections", "few_rows_qmv"), 1024),
    ("metal", nn.RoPE, (), 256)])
def test_each_device_gets_its_own_rewrites(tiny_model_dir, tmp_path, backend, rope, rewrites, chunk):
    """The CPU's table RoPE (slower on a GPU, where mx.fast.rope is one kernel) is installed
    only by the CPU profile; CUDA's stacks the projections (its steps are bound by kernel
    launches), prefills in chunks of 1024 and captures its decode steps; Metal keeps the
    model's own modules."""
    device = profile_for(backend)
    assert device.prefill_step_size == chunk
    loaded = load_model(ModelConfig(model=str(tiny_model_dir), cache_dir=str(tmp_path), weight_format="as-loaded"),
                        parse_scheme("fp16"), "test", device=device)
    assert _ropes(loaded.runner.model) == {rope}
    assert loaded.device is device
    assert device.rewrites == rewrites
    stacked = any(isinstance(m, ProjectionPart) for _, m in loaded.runner.model.named_modules())
    assert stacked is (backend == "cuda")
    assert device.warmup is (backend != "cpu")
    assert device.captured is (backend == "cuda")  # decode steps replayed where building them bounds a step
    assert (loaded.runner._captured is not None) is device.captured


def test_warmup_setting_overrides_the_device_default():
    assert [profile_for("cpu", w).warmup for w in ("auto", "on", "off")] == [False, True, False]
    assert [profile_for("cuda", w).warmup for w in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(ConfigError, match="engine.warmup must be auto, on or off"):
        EngineConfig(warmup="always")
    assert [profile_for("cpu", captured=c).captured for c in ("auto", "on", "off")] == [False, True, False]
    assert [profile_for("cuda", captured=c).captured for c in ("auto", "on", "off")] == [True, True, False]
    with pytest.raises(ConfigError, match="engine.captured_decode must be auto, on or off"):
        EngineConfig(captured_decode="yes")


def test_warmup_requests_fit_the_context_and_leave_one_step_apart():
    rows = warmup_requests(8, prefill_step_size=256, tokens=[5, 6], context=512, step_tokens=256)
    assert [len(r.prompt_tokens) for r in rows] == [5, 4, 261, 389, 495, 495, 495, 495]
    # 2,639 prompt tokens at 248 a step (8 go to decoding rows): 11 steps, one more to spare
    assert [r.params.max_tokens for r in rows] == list(range(13, 21))


@pytest.mark.parametrize("backend, configured, want", [("cuda", {}, (1024, 1024)), ("cpu", {}, (256, 256)),
                                                      ("cuda", {"prefill_step_size": 64}, (64, 64)),
                                                      ("cuda", {"max_step_tokens": 300}, (1024, 300))])
def test_the_scheduler_takes_the_chunk_size_the_config_leaves_to_the_device(tiny_model_dir, tmp_path, backend,
                                                                           configured, want):
    """An engine whose config sets no chunk size prefills in its device profile's chunks
    (the step's token budget follows unless set); a configured size is kept on any device."""
    load = make_loader(ModelConfig(model=str(tiny_model_dir), cache_dir=str(tmp_path), weight_format="as-loaded"),
                       parse_scheme("fp16"), "test", device=profile_for(backend, "off"))
    engine = Engine(load, EngineConfig(**configured))
    engine.start()
    try:
        assert (engine.scheduler.prefill_step_size, engine.scheduler.max_step_tokens) == want
    finally:
        engine.stop(30)


def _unstarted(model_dir, cache_dir, warmup: str) -> Engine:
    config = EngineConfig(max_batch_size=4, prefill_step_size=16, warmup=warmup)
    load = make_loader(ModelConfig(model=str(model_dir), cache_dir=str(cache_dir), weight_format="as-loaded"),
                       parse_scheme("turbo0v4"), "test", cache=CacheConfig(prompt_cache_ram_gb=0.1,
                                                                          prompt_cache_disk_gb=0.1),
                       device=profile_for("cpu", warmup))
    return Engine(load, config)


def _engine(model_dir, cache_dir, warmup: str) -> Engine:
    engine = _unstarted(model_dir, cache_dir, warmup)
    engine.start()
    return engine


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(prompt, SamplingParams(max_tokens=6, temperature=0.0)), events.put)
    tokens = []
    while True:
        event = events.get(timeout=60)
        tokens += event.token_ids
        if event.finish_reason is not None:
            return tokens


def test_the_warm_up_prefills_two_short_prompts_together(tiny_model_dir, tmp_path, monkeypatch):
    """Short prompts that arrive at once prefill as one left-padded batch, whose attention
    reads the padding's mask: on a GPU a kernel program of its own, which a served fp16
    engine on an H200 compiled for seconds while its first requests waited. The warm-up's
    rows 0 and 1 (5 and 4 tokens) are such a pair, and the only one."""
    together, prefill_together = [], ModelRunner._prefill_together

    def spy(self, chunks):
        together.append([c.request.num_prompt_tokens for c in chunks])
        return prefill_together(self, chunks)

    monkeypatch.setattr(ModelRunner, "_prefill_together", spy)
    _engine(tiny_model_dir, tmp_path, "on").stop(30)
    assert together == [[5, 4]]


def test_stop_returns_once_the_engine_thread_has_exited(tiny_model_dir, tmp_path):
    """``Engine.stop`` returns after the engine's OS thread is gone, not only its Python side:
    the thread's C++ thread-local destructors (MLX's compile cache, which the warm-up's
    sampled rows fill) take the GIL, and a script that ended right after ``stop`` aborted
    in them while the interpreter finalized."""
    engine = _engine(tiny_model_dir, tmp_path, "on")
    assert engine.stop(30)
    assert not os.path.exists(f"/proc/self/task/{engine._thread.native_id}")


def test_a_warmed_up_engine_keeps_nothing_and_answers_as_a_cold_one(tiny_model_dir, tmp_path, caplog):
    """The warm-up decodes at every batch size from the full batch down to one; afterwards
    no request, KV byte, prefix entry, metric or buffer kept for reuse remains of it (an
    8B-shape server on an H200 kept ~138 GiB of the device from its warm-up until its first
    requests ended), and a request's greedy tokens are those of an engine that never warmed up."""
    warm = _engine(tiny_model_dir, tmp_path / "warm", "on")
    cached = mx.get_cache_memory()  # read before the next engine allocates
    cold = _engine(tiny_model_dir, tmp_path / "cold", "off")
    try:
        assert cached == 0
        report = warm.warmup
        assert cold.warmup is None
        assert report.error == "" and report.batch_sizes == {1, 2, 3, 4} and report.prefill_chunks >= 4
        runner = warm.model.runner
        assert (warm.inflight, runner.live_requests, runner.kv_bytes) == (0, 0, 0)
        assert runner.prefix.stats()["entries"] == 0
        assert (warm.metrics.generated_tokens, warm.metrics.prompt_tokens) == (0, 0)
        prompt = list(range(100, 140))
        assert _greedy(warm, prompt) == _greedy(cold, prompt)
        assert warm.metrics.generated_tokens == 6
        assert sum(warm.metrics.decode_paths.values()) in (5, 6)  # tokens 2-6 (one more queued ahead)
        # A kernel program compiled after the warm-up is counted and named (on a GPU, one the
        # warm-up missed; on this CPU, one noted by hand).
        assert warm.metrics.kernel_programs == 0
        cuda_programs.note("kvs_late_test", None, [mx.zeros((1,), mx.int32)], [mx.float32])
        with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
            _greedy(warm, prompt)
        assert warm.metrics.kernel_programs == 1
        assert "kernel program compiled while serving: kvs_late_test (int32) -> (float32)" in caplog.text
    finally:
        warm.stop(30)
        cold.stop(30)


@pytest.mark.parametrize("where", ["execute", "warm_stored_chunks"])
def test_a_warm_up_that_fails_fails_the_start_with_its_reason(tiny_model_dir, tmp_path, monkeypatch, capsys, where):
    """The device running out of memory in a warm-up step (whose requests then fail) or in
    its chunks over stored K/V (which no request owns), as two 8B-shaped servers warming up at
    once on one H200 did: ``start`` raises ``WarmupFailed`` with the reason and what to
    change, the engine's thread ends, and ``kvserve serve`` prints it and exits 1. No server
    says ready that could not serve its own warm-up, and none waits forever for a thread
    that died."""
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(ModelRunner, where, out_of_memory)
    engine = _unstarted(tiny_model_dir, tmp_path, "on")
    with pytest.raises(WarmupFailed) as failed:
        engine.start()
    engine._thread.join(30)
    assert not engine._thread.is_alive()
    reason = "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"
    assert engine.warmup.error == (f"engine error: {reason}" if where == "execute" else reason)
    # Each step failed with its requests; or every step ran and the chunks after them failed.
    assert engine.warmup.batch_sizes == (set() if where == "execute" else {1, 2, 3, 4})
    message = str(failed.value)
    assert message.startswith("warm-up: ") and f"failed: {engine.warmup.error}. " in message
    assert "The warm-up's 4 requests (prompts of up to 29 tokens) could not be served" in message
    assert message.endswith("or start without the warm-up (--warmup off)")

    def serve():
        raise failed.value

    assert cli_run(serve) == 1
    assert capsys.readouterr().err == f"kvserve: error: {message}\n"


@pytest.mark.parametrize("scheme, fmt", [("affine4", "QuantizedFormat"), ("fp16", "RawFormat")])
def test_the_warm_up_runs_chunks_over_k_v_already_in_the_scheme(default_model_dir, tmp_path, monkeypatch, scheme, fmt):
    """The warm-up's own prompts attend over their raw prefill only; a question after a
    cached prefix attends over the scheme's stored K/V with a causal mask, and a prompt
    found whole but its last token with none. The warm-up runs those too, at 1, 2 and 9
    queries (one query-row tile and more), on every layer."""
    from kvserve.kernels import dispatch

    seen, attend = [], dispatch.attend
    monkeypatch.setattr(dispatch, "attend", lambda q, kf, *a, **k: seen.append((type(kf).__name__, q.shape[2], a[4]))
                        or attend(q, kf, *a, **k) if q.shape[0] == 1 else attend(q, kf, *a, **k))
    loaded = load_model(ModelConfig(model=str(default_model_dir), cache_dir=str(tmp_path)),
                        parse_scheme(scheme), "test", device=profile_for("cpu"))
    assert loaded.runner.warm_stored_chunks(list(range(5, 21))) == 3
    layers = len(loaded.runner.model.layers)
    chunks = collections.Counter(call for call in seen if call[1] in (1, 2, 9))
    want = {(fmt, 1, None), (fmt, 2, "causal"), (fmt, 9, "causal")}
    if fmt == "RawFormat" and _on_cuda():  # there one fp16 query without a mask is MLX's SDPA (attend_raw)
        want.discard((fmt, 1, None))
    assert set(chunks) == want
    assert min(chunks.values()) >= layers
    assert loaded.runner.kv_bytes == 0


def _on_cuda() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.mark.skipif(not _on_cuda(), reason="counts the kernels MLX's CUDA backend compiles")
def test_no_served_request_waits_on_a_kernel_compile(default_model_dir, tmp_path):
    """The default model on a GPU, in fp16 and affine4, each with an empty kernel folder: the
    warm-up compiles what the server will call (the folder fills before /health says ready),
    and requests afterwards (8 at once of different lengths, greedy and sampled, with
    logprobs; two short ones at once, prefilled as one padded batch; then one alone) compile
    nothing more: no kernel file, and none of kvserve's kernel programs
    (``kvserve.kernels.cuda_programs``, in memory only). The two servers start together: each
    cold warm-up takes minutes of compiling on one CPU core."""
    import httpx

    from servers import ServerProcess
    from together import together

    from kvserve.bench.soak import metrics

    folders = {scheme: tmp_path / scheme / "kernels" for scheme in ("fp16", "affine4")}
    procs = {scheme: ServerProcess(default_model_dir, "--kv-scheme", scheme, "--cache-dir", str(tmp_path / scheme),
                                   env={"MLX_PTX_CACHE_DIR": str(kernels)})
             for scheme, kernels in folders.items()}
    try:
        for scheme, proc in procs.items():
            proc.wait_ready(timeout=900)
            compiled = sorted(p.name for p in folders[scheme].iterdir())
            assert compiled, f"{scheme}: the warm-up compiled nothing"

            def ask(i: int, times: int = 0):
                body = {"model": "default", "max_tokens": 12 + i, "temperature": 0.7 * (i % 2),
                        "logprobs": i == 3, "top_logprobs": 2 if i == 3 else None,
                        "messages": [{"role": "user", "content": "Tell me about the sea. " * (times or 1 + 9 * i)}]}
                return lambda: httpx.post(f"{proc.base_url}/v1/chat/completions", json=body, timeout=120)

            # Then two short prompts of near lengths at once: one left-padded prompt batch.
            replies = together([ask(i) for i in range(8)]) + together([ask(0, 3), ask(0, 4)]) + [ask(2)()]
            assert [r.status_code for r in replies] == [200] * 11
            late = sorted({p.name for p in folders[scheme].iterdir()} - set(compiled))
            assert not late, f"{scheme} compiled while serving: {late}"
            # kvserve's own kernels compile in memory only: the engine counts and names them.
            named = [line for line in proc.output().splitlines() if "compiled while serving" in line]
            assert metrics(proc.base_url)["kvserve_kernel_programs_compiled_total"] == 0, named
    finally:
        for proc in procs.values():
            assert proc.stop() == 0, proc.output()
