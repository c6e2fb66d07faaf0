"""The fused CUDA kernels against TurboQuant's plain-ops attention path.

Runs where MLX has a CUDA GPU (the kernels have no CPU build); skipped elsewhere.
float32 activations, so the two paths differ only by summation order.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchgen import turboquant as tq
from batchgen import turboquant_kernels as kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs MLX with a CUDA GPU")


def filled_cache(n_tokens: int, dim: int, key_bits: int, value_bits: int, heads: int = 2, seed: int = 0):
    cache = tq.TurboQuantKVCache(key_bits=key_bits, value_bits=value_bits, seed=seed)
    k0, k1 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, heads, n_tokens, dim), key=k0)
    values = mx.random.normal((1, heads, n_tokens, dim), key=k1)
    for lo in range(0, n_tokens, 512):  # several chunks: capacity past offset, as in use
        cache.update_and_fetch(keys[:, :, lo : lo + 512], values[:, :, lo : lo + 512])
    mx.eval(cache.key_codes, cache.value_codes)
    return cache


def both_paths(fn):
    tq.FUSED_KERNELS = False
    try:
        plain = fn()
        mx.eval(plain)
    finally:
        tq.FUSED_KERNELS = True
    fused = fn()
    mx.eval(fused)
    return plain, fused


@pytest.mark.parametrize("n_tokens", [5, 300, 2500])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [(5, 3), (4, 4), (4, 2), (2, 2)])
@pytest.mark.parametrize("rows", [(7, 1), (2, 6), (4, 16)])  # (group, queries)
def test_fused_scores_and_values_equal_the_ops_path(n_tokens, dim, bits, rows):
    group, n_q = rows
    cache = filled_cache(n_tokens, dim, *bits)
    coded = tq.CodedHistory(cache, mx.float32)
    q = mx.random.normal((1, 2, group, n_q, dim), key=mx.random.key(7))
    plain, fused = both_paths(lambda: coded.scores(q))
    assert plain.shape == fused.shape == (1, 2, group, n_q, coded.n)
    assert mx.allclose(plain, fused, rtol=1e-4, atol=1e-4).item()
    p = mx.softmax(plain, axis=-1)
    plain, fused = both_paths(lambda: coded.values(p))
    assert plain.shape == fused.shape == (1, 2, group, n_q, dim)
    assert mx.allclose(plain, fused, rtol=1e-4, atol=1e-5).item()


def test_fused_attention_equals_ops_attention_in_a_decode_loop():
    cache = filled_cache(1000, 128, 5, 3, heads=4)
    outs = []
    for step in range(3):
        k = mx.random.normal((1, 4, 1, 128), key=mx.random.key(100 + step))
        v = mx.random.normal((1, 4, 1, 128), key=mx.random.key(200 + step))
        cache.update_and_fetch(k, v)
        q = mx.random.normal((1, 28, 1, 128), key=mx.random.key(300 + step))
        chunk = cache._chunk
        tq.FUSED_KERNELS = False
        try:
            plain = cache.attention(q, scale=128**-0.5)
        finally:
            tq.FUSED_KERNELS = True
        cache._chunk = chunk  # `attention` consumes the handed-over chunk
        fused = cache.attention(q, scale=128**-0.5)
        outs.append((plain, fused))
    for plain, fused in outs:
        assert mx.allclose(plain, fused, rtol=1e-4, atol=1e-5).item()
