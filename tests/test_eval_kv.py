"""``kvserve eval-kv`` on a tiny random-weight llama.

The model: hidden 128, 2 layers, 2 query heads, 1 KV head (head_dim 64: quantized groups
need head_dim >= 32 and a multiple of the group), vocab 256; its tokens are the bytes of the
evaluation text, so the same text drives it that drives the real evaluation.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from kvserve.cache import SCHEME_NAMES, UnknownScheme
from kvserve.server.engine import eval_kv
from kvserve.server.engine.eval_kv import (
    EvalContext,
    SchemeReport,
    format_markdown,
    kl_divergence,
    load_eval_text,
    negative_log_likelihood,
    parse_scheme_list,
    perplexity,
    run_eval,
    to_json,
)

N, K = 64, 16  # prompt tokens, eval tokens
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 64


@pytest.fixture(scope="module")
def model():
    mx.random.seed(7)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=LAYERS,
                           intermediate_size=256, num_attention_heads=2, num_key_value_heads=KV_HEADS,
                           head_dim=HEAD_DIM, rms_norm_eps=1e-5, vocab_size=256)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return list(load_eval_text().encode("utf-8"))


@pytest.fixture(scope="module")
def reports(model, tokens) -> dict[str, SchemeReport]:
    return {r.scheme: r for r in run_eval(model, tokens, ["affine8", "affine4"], N, K)}


# --- the metrics, by hand ---


def test_kl_divergence_matches_a_hand_computed_example():
    # p = [1/2, 1/2], q = softmax([0, ln 3]) = [1/4, 3/4]:
    # KL(p || q) = 1/2 ln(1/2 / 1/4) + 1/2 ln(1/2 / 3/4) = 1/2 ln(4/3)
    ref = np.array([[0.0, 0.0], [2.0, -1.0]])
    other = np.array([[0.0, math.log(3.0)], [2.0, -1.0]])
    kl = kl_divergence(ref, other)
    assert kl[0] == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-14)
    assert kl[1] == 0.0
    # Shift-invariant and overflow-free: logits in the thousands give the same numbers.
    assert kl_divergence(ref + 5000.0, other - 3000.0)[0] == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-12)


def test_kl_is_not_symmetric_and_direction_is_reference_first():
    ref, other = np.array([[0.0, 0.0]]), np.array([[0.0, math.log(3.0)]])
    # KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2)
    assert kl_divergence(other, ref)[0] == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-14)


def test_perplexity_of_a_uniform_distribution_is_its_size():
    logits = np.zeros((3, 8))
    nll = negative_log_likelihood(logits, np.array([0, 5, 7]))
    assert nll == pytest.approx([math.log(8.0)] * 3, rel=1e-14)
    assert perplexity(nll) == pytest.approx(8.0, rel=1e-12)


# --- the evaluation on a real (tiny) model ---


def test_fp16_against_fp16_is_exactly_zero(reports):
    floor = reports["fp16"]
    assert floor.error is None
    assert floor.kl_mean == 0.0 and floor.kl_p99 == 0.0 and floor.kl_max == 0.0
    assert floor.prefill_kl == 0.0
    assert floor.top1_agreement == 1.0
    assert floor.ppl_scheme == floor.ppl_fp16


def test_affine8_moves_the_distribution_a_little(reports):
    r = reports["affine8"]
    assert r.error is None
    assert 0.0 < r.kl_mean < 0.01
    assert r.kl_mean <= r.kl_p99 <= r.kl_max
    assert r.prefill_kl > 0.0  # affine caches quantize during prefill too
    assert r.top1_agreement >= 0.75  # random weights leave near-ties: one flip is 1/16


def test_affine4_moves_it_more_than_affine8(reports):
    assert reports["affine4"].kl_mean > reports["affine8"].kl_mean


def test_report_fields_and_bytes(reports):
    assert list(reports) == ["fp16", "affine8", "affine4"]  # fp16 first: the noise floor
    fp16, a8 = reports["fp16"], reports["affine8"]
    for r in reports.values():
        assert r.positions == K and r.kv_tokens == N + K
        assert r.ppl_fp16 == fp16.ppl_fp16 and r.ppl_scheme > 1.0
        assert r.seconds > 0.0
    # Random weights are float32, and the fp16 cache stores them as float16: K + V, every layer.
    assert fp16.cache_dtypes == ("float16",)
    assert fp16.stored_bytes_per_token == LAYERS * KV_HEADS * 2 * HEAD_DIM * 2
    # affine8, group 64: 64 one-byte values + a float32 scale and bias per component.
    assert a8.stored_bytes_per_token == LAYERS * KV_HEADS * 2 * (HEAD_DIM + 4 + 4)
    assert a8.compression_stored == pytest.approx(fp16.stored_bytes_per_token / a8.stored_bytes_per_token)
    # Allocation is in 256-slot granules: 80 tokens sit in 256 slots.
    assert fp16.allocated_bytes_per_token == pytest.approx(fp16.stored_bytes_per_token * 256 / (N + K))
    assert fp16.compression_stored == 1.0 and fp16.compression_allocated == 1.0


def test_a_failing_scheme_is_reported_and_the_others_still_run(model, tokens):
    # Groups of 128 do not fit a head of 64: the cache refuses on the first forward.
    out = run_eval(model, tokens, ["affine8-g128", "affine8"], 8, 2)
    assert [r.scheme for r in out] == ["fp16", "affine8-g128", "affine8"]
    assert out[1].error.startswith("ValueError: head_dim 64") and out[1].kl_mean is None
    assert out[2].error is None and out[2].kl_mean > 0.0
    assert "failed: ValueError" in format_markdown(out, _context())


def test_progress_lines(model, tokens):
    lines: list[str] = []
    run_eval(model, tokens, ["fp16"], 8, eval_kv.PROGRESS_EVERY, lines.append)
    assert f"fp16: {eval_kv.PROGRESS_EVERY}/{eval_kv.PROGRESS_EVERY}" in lines
    assert any(line.startswith("reference fp16:") for line in lines)


def test_too_short_a_text_is_refused(model):
    with pytest.raises(ValueError, match="needed"):
        run_eval(model, list(range(10)), ["fp16"], 8, 8)


# --- output ---


def _context() -> EvalContext:
    return EvalContext(command="kvserve eval-kv --schemes affine8", date="2025-01-01 00:00 UTC",
                       machine="test", mlx=mx.__version__, mlx_lm="0", model="tiny", weights="f32",
                       text="bytes", prompt_tokens=N, eval_tokens=K, seconds=1.0)


def test_json_output_parses(reports):
    data = json.loads(to_json(list(reports.values()), _context()))
    assert data["context"]["prompt_tokens"] == N
    assert [r["scheme"] for r in data["reports"]] == ["fp16", "affine8", "affine4"]
    assert data["reports"][0]["kl_mean"] == 0.0 and data["reports"][1]["error"] is None


def test_markdown_has_one_row_per_scheme(reports):
    text = format_markdown(list(reports.values()), _context())
    rows = [line for line in text.splitlines() if line.startswith(("| affine", "| fp16"))]
    assert len(rows) == 3
    assert "`kvserve eval-kv --schemes affine8`" in text


def test_scheme_lists():
    assert parse_scheme_list("all") == list(SCHEME_NAMES)
    assert parse_scheme_list("turbo0v4, affine4-g64") == ["turbo0v4", "affine4"]
    with pytest.raises(UnknownScheme):
        parse_scheme_list("fp8")


def test_main_refuses_an_unknown_scheme(capsys):
    assert eval_kv.main(["--schemes", "fp8"]) == 2
    assert "unknown KV scheme" in capsys.readouterr().err


def test_main_json_end_to_end(tiny_model_dir, capsys):
    code = eval_kv.main(["--model", str(tiny_model_dir), "--schemes", "fp16", "--prompt-tokens", "16",
                         "--eval-tokens", "4", "--weight-format", "as-loaded", "--json"])
    out = capsys.readouterr()
    assert code == 0
    data = json.loads(out.out)
    assert data["reports"][0]["kl_mean"] == 0.0 and data["reports"][0]["positions"] == 4
    assert "fp16: 4/4" in out.err
