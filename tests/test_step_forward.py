"""`step_forward`: the batch step through llama-family models in few primitives."""

from __future__ import annotations

import collections
import copy
import re

import mlx.core as mx
import pytest
from mlx_lm import load

from batchgen.cache.fp16 import Fp16BatchCache
from batchgen.step.compiled import CompiledSteps
from batchgen.transforms.attention import route_attention
from batchgen.transforms.fusion import fuse_model
from batchgen.transforms.quantized import route_quantized
from batchgen.step.forward import _unsupported, make_step_forward

import tiny


def _model(model_dir, arch, fuse=True, dequantize_rows=None, **kw):
    model, _ = load(str(model_dir(arch, **kw)))
    if fuse:
        fuse_model(model, quantized=True)
    route_quantized(model, dequantize_rows)
    route_attention(model)
    return model


def _filled(model, pads: list[int], length: int = 24) -> list:
    cache = [Fp16BatchCache(pads, kernels=True) for _ in model.layers]
    model(mx.random.randint(0, 300, (len(pads), length), key=mx.random.key(1)), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _steps(model, cache, own_forward: bool, steps: int = 40) -> list:
    """Each step's logits through the compiled step (a window flush on the way)."""
    stepper = CompiledSteps(model, False, {}, own_forward)
    cache = [copy.copy(c) for c in cache]
    y, out = mx.array([5, 6, 7], mx.uint32), []
    for _ in range(steps):
        tokens, logits = stepper(cache, y, sample=True)
        out.append(logits)
        y = tokens.astype(mx.uint32)
    return out


_TIED = {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}


@pytest.mark.parametrize("arch,kw,rows", [
    ("qwen2", {}, None),  # q/k/v biases, untied head
    ("llama", {}, None),
    ("llama", _TIED, None),
    ("qwen3", {}, None),  # per-head q/k norms before RoPE
    # quantized: the tied head through the quantized embedding; rows 1: every product
    # dense over the dequantized weight (the route a GPU takes for many rows)
    ("qwen2", {"quantize_bits": 4}, None),
    ("qwen2", {"quantize_bits": 8}, 1),
    ("llama", {**_TIED, "quantize_bits": 4}, None),
    ("llama", {**_TIED, "quantize_bits": 4}, 1),
    ("qwen3", {"quantize_bits": 4}, 1),
    ("qwen3", {"quantize_bits": 8}, None),
])  # fmt: skip
def test_logits_equal_the_models_own_step(model_dir, arch, kw, rows):
    """float32 on the CPU: the same ops in the same order on the same weights,
    so the same logits, bit for bit, over 40 steps and a window flush."""
    model = _model(model_dir, arch, dequantize_rows=rows, **kw)
    assert make_step_forward(model) is not None
    cache = _filled(model, [0, 7, 3])
    theirs, ours = _steps(model, cache, own_forward=False), _steps(model, cache, own_forward=True)
    assert all(mx.array_equal(a, b).item() for a, b in zip(theirs, ours))


@pytest.mark.parametrize("arch,kw,fuse,reason", [
    ("qwen3_moe", {}, True, "model type mlx_lm.models.qwen3_moe"),
    ("qwen2", {}, False, "projections not fused, or of another type"),
    ("qwen2", {"quantize_bits": 4}, False, "projections not fused, or of another type"),
    ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, True,
     "sliding-window layers"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 1024}}, True, "a RoPE variant"),
])  # fmt: skip
def test_models_it_does_not_cover_step_through_their_own_layers(tmp_path, arch, kw, fuse, reason):
    model, _ = load(str(tiny.build_model(arch, tmp_path / arch, **kw)))
    if fuse:
        fuse_model(model, quantized=True)
    assert _unsupported(model) == reason and make_step_forward(model) is None


def test_a_step_evaluates_fewer_primitives(model_dir, tmp_path):
    """What the step saves is primitives (each costs host time on CUDA),
    counted in the graph of one compiled step: on the CPU RoPE, norms and
    attention are many ops each, so the count is of the reshaping around them."""
    model = _model(model_dir, "qwen2")
    counts = {}
    for own in (False, True):
        cache = _filled(model, [0, 2])
        stepper = CompiledSteps(model, False, {}, own)
        mx.eval(stepper(cache, mx.array([1, 2], mx.uint32), sample=False)[0], stepper.keys, stepper.values)
        tokens, _ = stepper(cache, mx.array([3, 4], mx.uint32), sample=False)
        path = tmp_path / f"step_{own}.dot"
        mx.export_to_dot(str(path), tokens, *stepper.keys, *stepper.values)
        counts[own] = collections.Counter(re.findall(r'label ="([^"]+)"', path.read_text()))
    assert sum(counts[True].values()) < sum(counts[False].values())
    shape_ops = [sum(counts[own][k] for k in ("Transpose", "Reshape", "Flatten", "Unflatten")) for own in (False, True)]
    assert shape_ops[1] * 3 <= shape_ops[0], shape_ops  # weights transposed once, heads never, 2-D activations
