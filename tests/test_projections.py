"""``fused_projections`` (the CUDA profile's rewrite): every architecture served computes
the same logits with its sibling projections stacked, with dense and quantized weights,
through a prompt and decode steps with mlx-lm's own caches."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from archs import ARCHS, build_model, prompt_tokens
from kvserve.server.engine.projections import ProjectionPart, fuse_projections
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache


def _logits(model, prompt: list[int], steps: int) -> list[mx.array]:
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for _ in range(steps):
        out.append(model(mx.argmax(out[-1]).reshape(1, 1), cache=cache)[0, -1])
    return out


def _weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


CASES = [(arch, False) for arch in sorted(ARCHS)] + [(arch, True) for arch in ("llama", "gemma3_text", "gpt_oss")]


@pytest.mark.parametrize("arch, quantized", CASES, ids=[f"{a}-{'affine4' if q else 'dense'}" for a, q in CASES])
def test_stacked_projections_give_the_models_logits(arch, quantized):
    model = build_model(arch)
    if quantized:
        nn.quantize(model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear)
                    and m.weight.shape[1] % 32 == 0)
    prompt = prompt_tokens(3, 12)
    before, weight_bytes = _logits(model, prompt, 4), _weight_bytes(model)
    groups = fuse_projections(model)
    parts = [m for _, m in model.named_modules() if isinstance(m, ProjectionPart)]
    assert groups > 0 and len(parts) >= 2 * groups
    assert _weight_bytes(model) == weight_bytes  # stacked, not copied beside
    after = _logits(model, prompt, 4)
    for b, a in zip(before, after):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item(), float(mx.abs(a - b).max())


def test_only_plain_siblings_of_one_width_and_format_are_stacked():
    mixed = nn.Module()
    mixed.q_proj, mixed.k_proj, mixed.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 32)
    quant = nn.Module()
    quant.gate_proj, quant.up_proj = nn.QuantizedLinear(64, 32, bits=4), nn.QuantizedLinear(64, 32, bits=8)
    assert fuse_projections(mixed) == fuse_projections(quant) == 0
    assert type(mixed.q_proj) is nn.Linear and type(quant.up_proj) is nn.QuantizedLinear
