"""Prefix-cache checkpoints for sliding-window and recurrent-state layers.

Tiny random-weight models from mlx-lm's classes (``archs.py``): gemma3 and gpt_oss (windows of
16 beside full attention, gpt_oss with attention sinks), qwen3_5 (GatedDeltaNet states beside full attention), falcon_h1 (a Mamba
state and attention inside one layer). Real files on disk for the restart.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from archs import build_model, prompt_tokens
from servers import on_gpu
from stepping import drive

from kvserve.cache import PromptCache, parse_scheme
from kvserve.cache.prefix import Namespace, PrefixCache
from kvserve.cache.prefix.checkpoints import capture
from kvserve.cache.prefix.files import entry_metadata, write_entry
from kvserve.cache.prefix.snapshot import host_tensors, layer_descriptions, restore, take_snapshot
from kvserve.server.engine.checkpoints import MIN_PARTING_GAIN
from kvserve.server.engine.request import Request, SamplingParams
from kvserve.server.engine.runner import RAW_PREFILL_TOKENS, ModelRunner

ARCHS = ("gemma3_text", "gpt_oss", "qwen3_5", "falcon_h1")
SCHEMES = ("fp16", "affine4", "mxfp4", "turbo0v4")  # one per scheme family
SYSTEM = prompt_tokens(1, 70)  # a shared start: 4 windows long


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, build_model(request.param)


def prefill(model, scheme: str, tokens: list[int], cuts: list[int], chunk: int = 8):
    """A raw prefill as the runner runs one: pieces of ``chunk`` tokens, also stopping at
    ``cuts`` (a checkpoint taken at each); converted to the scheme at the end."""
    cache = PromptCache.for_model(model, scheme, quantize_after=RAW_PREFILL_TOKENS)
    stops = sorted({*range(chunk, len(tokens), chunk), *cuts, len(tokens)})
    taken, at = [], 0
    for stop in stops:
        model(mx.array(tokens[at:stop])[None], cache=cache)
        cache.maybe_convert()
        if stop in cuts:
            taken.append(capture(cache))
        at = stop
    cache.convert()
    cache.quantize_after = 0
    return cache, taken, stops


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_checkpoint_restores_exactly_what_the_cache_held_there(arch_model, scheme):
    """Resumed from a checkpoint, the model computes bit for bit what a cache prefilled to
    that length computes: its window and state layers are the checkpoint's, its full layers
    the entry's own, trimmed. (On a GPU the attention kernels' reductions follow the
    buffers' capacity, which a trimmed copy keeps: equal to float rounding there.)"""
    _, model = arch_model
    tokens = prompt_tokens(2, 60)
    cache, taken, stops = prefill(model, scheme, tokens, cuts=[20, 37])
    snap = take_snapshot(cache, taken)
    assert snap.checkpoints[0].num_tokens == 20  # (a window's own end may reach back to 37)
    follow = mx.array(prompt_tokens(3, 4))[None]
    for p in (20, 37):
        assert any(lo <= p <= hi for lo, hi in snap.spans)
        restored = restore(snap, p)
        reference, _, _ = prefill(model, scheme, tokens[:p], cuts=[s for s in stops if s < p])
        for step in (follow, follow[:, :1]):  # a chunk, then one token
            got, want = model(step, cache=restored), model(step, cache=reference)
            same = mx.allclose(got, want, rtol=0, atol=1e-4) if on_gpu() else mx.array_equal(got, want)
            assert same, (p, float(mx.max(mx.abs(got - want))))


def test_lengths_between_checkpoints_are_not_served_where_a_state_cannot_trim(arch_model):
    arch, model = arch_model
    tokens = prompt_tokens(2, 60)
    cache, taken, _ = prefill(model, "fp16", tokens, cuts=[20, 37])
    spans = take_snapshot(cache, taken).spans
    if arch in ("gemma3_text", "gpt_oss"):  # a window reaches back from each checkpoint and the end
        assert any(lo < 20 for lo, _ in spans) and any(lo < 60 - 1 for lo, hi in spans if hi == 60)
    else:
        assert spans == ((20, 20), (37, 37), (60, 60))


# --- the engine: re-sends, shared system prompts, a grid, a restart ---------------------

def generate(runner: ModelRunner, prompt: list[int], rid: str, boundaries=(), n: int = 6) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the prefix cache gave."""
    request = Request(list(prompt), SamplingParams(max_tokens=n, temperature=0.0), request_id=rid,
                      boundaries=tuple(boundaries))
    cached: dict[str, int] = {}
    original = runner.execute

    def execute(plan):
        result = original(plan)
        cached.update(result.cached)
        return result

    runner.execute = execute
    try:
        return drive(runner, [request], prefill=16).tokens[rid], cached.get(rid, 0)
    finally:
        runner.execute = original


def runner_for(model, scheme: str, disk=None, every: int = 0) -> ModelRunner:
    pc = PrefixCache(Namespace("tiny", "tok", scheme), ram_bytes=1 << 26, disk_dir=disk,
                     disk_bytes=1 << 26 if disk else 0)
    return ModelRunner(model, parse_scheme(scheme), prefix=pc, checkpoint_every=every)


def test_a_resend_and_a_shared_system_prompt_hit_and_decode_as_cold(arch_model, tmp_path):
    _, model = arch_model
    first, second = SYSTEM + prompt_tokens(2, 40), SYSTEM + prompt_tokens(3, 12)  # past a window
    runner = runner_for(model, "fp16", disk=tmp_path)
    cold_first, cached = generate(runner, first, "a", boundaries=[len(SYSTEM)])
    again, cached_again = generate(runner, first, "b")
    shared, cached_shared = generate(runner, second, "c", boundaries=[len(SYSTEM)])
    assert (cached, cached_again, cached_shared) == (0, len(first) - 1, len(SYSTEM))
    cold_second, _ = generate(ModelRunner(model, parse_scheme("fp16")), second, "d")
    assert again == cold_first and shared == cold_second
    stats = runner.prefix.stats()
    assert stats["checkpoints_stored"] >= 1 and stats["checkpoint_hits"] >= 1
    runner.prefix.close()

    restarted = runner_for(model, "fp16", disk=tmp_path)  # the SSD tier, after a restart
    third = SYSTEM + prompt_tokens(4, 9)
    after, cached_after = generate(restarted, third, "e")
    assert cached_after == len(SYSTEM) and restarted.prefix.stats()["disk_hits"] == 1
    assert after == generate(ModelRunner(model, parse_scheme("fp16")), third, "f")[0]
    restarted.prefix.close()


@pytest.mark.parametrize("scheme", ["affine4", "turbo0v4"])
def test_a_grid_checkpoint_serves_a_prompt_that_parts_mid_message(scheme):
    model = build_model("qwen3_5")
    runner = runner_for(model, scheme, every=32)
    generate(runner, SYSTEM + prompt_tokens(2, 15), "a")
    _, cached = generate(runner, SYSTEM[:50] + prompt_tokens(5, 10), "b")
    assert cached == 32  # the grid point inside the 50 shared tokens


def test_where_a_second_prompt_parts_the_third_resumes(arch_model):
    """Without message ends or a grid (completions), the second prompt with a known start
    keeps a checkpoint where it parts from the first; the third with that start hits it."""
    _, model = arch_model
    runner = runner_for(model, "fp16")
    system = prompt_tokens(1, MIN_PARTING_GAIN + 30)  # a shorter shared start is not worth a cut
    cached = [generate(runner, system + prompt_tokens(seed, 40), f"r{seed}")[1] for seed in (2, 3, 4)]
    assert cached == [0, 0, len(system)]


def test_prompts_prefilled_together_keep_their_last_token_checkpoints(monkeypatch):
    """Left-padded prompts end in one column: the batched prefill stops before it, so each
    row keeps the checkpoint a re-send resumes from."""
    runner = runner_for(build_model("qwen3_5"), "fp16")
    batches = []
    together = runner._prefill_together
    monkeypatch.setattr(runner, "_prefill_together", lambda chunks: batches.append(len(chunks)) or together(chunks))
    prompts = [prompt_tokens(2, 30), prompt_tokens(3, 28)]
    drive(runner, [Request(p, SamplingParams(max_tokens=4, temperature=0.0), request_id=f"t{i}")
                   for i, p in enumerate(prompts)], prefill=64, step_tokens=128)
    assert batches == [2]
    assert [generate(runner, p, f"again{i}")[1] for i, p in enumerate(prompts)] == [29, 27]


def test_message_ends_are_where_the_rendered_messages_end(default_model_dir):
    """The first message's end and the last few, as the chat template renders them; a
    template that ends a prefix differently (here: none does) only shortens what is shared."""
    from mlx_lm.tokenizer_utils import load

    from kvserve.server.http.conversation import message_ends, render_prompt
    from kvserve.server.http.tools import ToolFormat

    tokenizer = load(default_model_dir)
    fmt = ToolFormat.of(tokenizer)
    chat = [{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "Hi there."},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    tokens = render_prompt(tokenizer, chat, None, fmt)
    ends = message_ends(tokenizer, chat, None, fmt, tokens)
    assert [tokenizer.decode(tokens[e - 2:e]) for e in ends] == ["<|im_end|>\n"] * 4
    assert len(ends) == 4  # message 1, then messages 3-5 (the last three before the prompt's own)
    assert tokenizer.decode(tokens[:ends[0]]).count("<|im_end|>") == 1


# --- the store: budgets, eviction, refusals -----------------------------------------------

def stored(model, scheme="affine4", n=40):
    cache, taken, _ = prefill(model, scheme, prompt_tokens(2, n), cuts=[16, 24])
    return prompt_tokens(2, n), cache, taken


def test_checkpoint_bytes_count_in_the_budget_and_their_eviction_is_counted():
    model = build_model("qwen3_5")
    tokens, cache, taken = stored(model)
    snap_bytes = take_snapshot(cache, taken).nbytes
    assert snap_bytes > take_snapshot(cache).nbytes  # the checkpoints' copies are counted
    pc = PrefixCache(Namespace("tiny", "tok", "affine4"), ram_bytes=snap_bytes + snap_bytes // 2)
    assert pc.insert(tokens, cache, taken)
    assert pc.stats()["ram_bytes"] == snap_bytes and pc.stats()["checkpoints_stored"] == 2
    other, cache2, taken2 = prompt_tokens(9, 40), *stored(model)[1:]
    assert pc.insert(other, cache2, taken2)  # evicts the first: no disk tier to spill to
    stats = pc.stats()
    assert stats["ram_entries"] == 1 and stats["checkpoints_evicted"] == 2
    assert pc.lookup(tokens[:20] + [5]) is None
    assert pc.lookup(other[:20] + [5]).num_tokens == 16  # the longest checkpoint inside 20


def test_the_next_turn_keeps_the_checkpoints_of_the_turn_before():
    """Prompt and reply extend the prompt's entry: one entry then serves both (the prompt's
    own end becomes a checkpoint), the shorter is dropped."""
    model = build_model("qwen3_5")
    tokens, cache, taken = stored(model)
    pc = PrefixCache(Namespace("tiny", "tok", "affine4"), ram_bytes=1 << 26)
    pc.insert(tokens, cache, taken)
    model(mx.array(prompt_tokens(7, 5))[None], cache=cache)
    longer = tokens + prompt_tokens(7, 5)
    assert pc.insert(longer, cache)
    assert pc.stats()["entries"] == 1
    assert [pc.lookup(tokens[:m] + [3]).num_tokens for m in (20, 40)] == [16, 40]


def test_a_file_whose_checkpoint_names_a_missing_layer_is_refused_and_deleted(tmp_path):
    model = build_model("qwen3_5")
    tokens, cache, taken = stored(model)
    ns = Namespace("tiny", "tok", "affine4")
    snap = take_snapshot(cache, taken)
    layers = layer_descriptions(snap)
    listed = json.loads(layers["checkpoints"])
    listed[0][1] = [99]  # a layer the model does not have
    layers["checkpoints"] = json.dumps(listed)
    path = tmp_path / ns.entry_name(tokens)
    write_entry(path, entry_metadata(ns, tokens, snap.spans, layers), host_tensors(snap))
    pc = PrefixCache(ns, ram_bytes=1 << 26, disk_dir=tmp_path, disk_bytes=1 << 26)
    assert pc.lookup(tokens[:20] + [1]) is None
    assert pc.stats()["refused"]["corrupt"] == 1 and not path.exists()
    pc.close()
