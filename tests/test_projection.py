"""`projection`: the few-row tensor-core projection of a batch step.

Which products it takes is checked everywhere; the kernel itself runs where
MLX has a CUDA GPU (against a float64 product of the same bf16 numbers, and
inside `step_forward` against the plain matmul), skipped elsewhere.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from batchgen.cache.fp16 import Fp16BatchCache
from batchgen.kernels import projection, registry
from batchgen.step.compiled import CompiledSteps
from batchgen.transforms.attention import route_attention
from batchgen.transforms.fusion import fuse_model

cuda = pytest.mark.cuda


def bf16(*shape, seed: int):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(mx.bfloat16)


@pytest.mark.parametrize("x_shape,w_shape,dtype,takes", [
    ((8, 896), (1152, 896), mx.bfloat16, True),
    ((1, 64), (32, 64), mx.bfloat16, True),
    ((32, 3584), (18944 * 2, 3584), mx.bfloat16, True),
    ((33, 896), (1152, 896), mx.bfloat16, False),  # more rows than four column tiles
    ((8, 900), (1152, 900), mx.bfloat16, False),  # K not a multiple of 32
    ((8, 896), (1160, 896), mx.bfloat16, False),  # N not a multiple of 32
    ((8, 896), (1152, 896), mx.float32, False),  # the mma is bf16
    ((8, 896), (1152, 640), mx.bfloat16, False),  # mismatched K
    ((2, 8, 896), (1152, 896), mx.bfloat16, False),  # 3-D activations
])  # fmt: skip
def test_which_products_it_takes(monkeypatch, x_shape, w_shape, dtype, takes):
    monkeypatch.setattr(registry, "available", lambda: True)
    monkeypatch.setattr(projection, "MAX_ROWS", 32)
    monkeypatch.setattr(projection, "MAX_WEIGHT_BYTES", 1 << 40)
    assert projection.takes(mx.zeros(x_shape, dtype), mx.zeros(w_shape, dtype)) is takes


def test_nothing_on_a_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(registry, "available", lambda: False)
    assert not projection.takes(mx.zeros((8, 64), mx.bfloat16), mx.zeros((64, 64), mx.bfloat16))


def test_column_tiles_follow_the_rows_and_row_tiles_the_outputs():
    assert [dict(projection.template(r, 896, False))["NT"] for r in (1, 8, 9, 16, 17, 32)] == [1, 1, 2, 2, 3, 4]
    wide = 32 * projection.WIDE_GRID
    assert [dict(projection.template(8, n, True))["FT"] for n in (896, wide - 32, wide, 37888)] == [1, 1, 2, 2]


def test_many_rows_and_large_weights_stay_with_the_matmul(monkeypatch):
    monkeypatch.setattr(registry, "available", lambda: True)
    monkeypatch.setattr(projection, "MAX_WEIGHT_BYTES", 1152 * 896 * 2)
    x = mx.zeros((projection.MAX_ROWS, 896), mx.bfloat16)
    assert projection.takes(x, mx.zeros((1152, 896), mx.bfloat16))
    assert not projection.takes(x, mx.zeros((1184, 896), mx.bfloat16))
    assert not projection.takes(mx.zeros((projection.MAX_ROWS + 1, 896), mx.bfloat16), mx.zeros((32, 896), mx.bfloat16))


def test_the_shipped_limits_cover_a_small_models_layers_and_not_a_7b_ones(monkeypatch):
    monkeypatch.setattr(registry, "available", lambda: True)
    x, x7 = mx.zeros((8, 896), mx.bfloat16), mx.zeros((8, 3584), mx.bfloat16)
    assert projection.takes(x, mx.zeros((4864 * 2, 896), mx.bfloat16))  # the 0.5B shape's gate|up, 17 MB
    assert not projection.takes(x7, mx.zeros((4608, 3584), mx.bfloat16))  # the 7B shape's q|k|v, 33 MB


@cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 31, 32])
@pytest.mark.parametrize("n,k,bias", [(1152, 896, True), (896, 4864, False), (4608, 3584, True), (9728, 896, False)])
def test_kernel_equals_a_float64_product(rows, n, k, bias):
    x, w = bf16(rows, k, seed=1), bf16(n, k, seed=2) * 0.05
    b = bf16(n, seed=3) if bias else None
    got = np.array(projection.PROJECTION.launch(x, w, b).astype(mx.float32))  # the kernel, past its limits too
    want = np.array(x.astype(mx.float32), np.float64) @ np.array(w.astype(mx.float32), np.float64).T
    if bias:
        want += np.array(b.astype(mx.float32), np.float64)
    # float32 sums of bf16 products, rounded to bf16 once: within bf16's half-ulp (2**-8) of each output
    assert np.all(np.abs(got - want) <= 2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max())


@cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_step_forward_through_the_kernel_keeps_the_logits(model_dir, monkeypatch, arch):
    """bf16 steps of a tiny model with the kernel and with plain matmuls, fed
    the same tokens: logits within bf16 rounding; the kernel did run."""
    model, _ = load(str(model_dir(arch)))
    model.set_dtype(mx.bfloat16)
    fuse_model(model, quantized=True)
    route_attention(model)
    cache = [Fp16BatchCache([0, 3, 9], kernels=True) for _ in model.layers]
    model(mx.random.randint(0, 300, (3, 24), key=mx.random.key(1)), cache=cache)
    mx.eval([c.state for c in cache])
    calls = []
    real = projection.PROJECTION.launch
    monkeypatch.setattr(projection.PROJECTION, "launch", lambda *a: calls.append(1) or real(*a))
    inputs = mx.random.randint(0, 300, (6, 3), key=mx.random.key(2)).astype(mx.uint32)
    logits = {}
    for rows in (0, projection.MAX_ROWS):
        monkeypatch.setattr(projection, "MAX_ROWS", rows)
        stepper, c = CompiledSteps(model, True, {}, True), [copy.copy(layer) for layer in cache]
        logits[rows] = mx.stack([stepper(c, y, sample=True)[1].astype(mx.float32) for y in inputs])
    assert calls
    plain, kernel = logits[0], logits[projection.MAX_ROWS]
    assert mx.abs(plain - kernel).max().item() <= 0.03 * mx.abs(plain).max().item()
