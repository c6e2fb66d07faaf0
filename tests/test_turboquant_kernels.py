"""The TurboQuant cache's attention with the tq_scores / tq_values kernels against its
ops path, in a decode loop (CUDA; the kernels' own parity: test_kernel_registry.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchgen.cache import turboquant as tq
from batchgen.kernels import registry

pytestmark = pytest.mark.cuda


def filled_cache(n_tokens: int, dim: int, key_bits: int, value_bits: int, heads: int = 2, seed: int = 0):
    cache = tq.TurboQuantKVCache(key_bits=key_bits, value_bits=value_bits, seed=seed, routed=True)
    k0, k1 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, heads, n_tokens, dim), key=k0)
    values = mx.random.normal((1, heads, n_tokens, dim), key=k1)
    for lo in range(0, n_tokens, 512):  # several chunks: capacity past offset, as in use
        cache.update_and_fetch(keys[:, :, lo : lo + 512], values[:, :, lo : lo + 512])
    mx.eval(cache.key_codes, cache.value_codes)
    return cache


def test_fused_attention_matches_the_ops_path_in_a_decode_loop():
    cache = filled_cache(1000, 128, 5, 3, heads=4)
    outs = []
    for step in range(3):
        k = mx.random.normal((1, 4, 1, 128), key=mx.random.key(100 + step))
        v = mx.random.normal((1, 4, 1, 128), key=mx.random.key(200 + step))
        cache.update_and_fetch(k, v)
        q = mx.random.normal((1, 28, 1, 128), key=mx.random.key(300 + step))
        chunk = cache._chunk
        with registry.using("reference", "tq_scores", "tq_values"):
            plain = cache.attention(q, scale=128**-0.5)
        cache._chunk = chunk  # `attention` consumes the handed-over chunk
        fused = cache.attention(q, scale=128**-0.5)
        outs.append((plain, fused))
    for plain, fused in outs:  # the ops path may multiply in TF32
        assert mx.allclose(plain, fused, rtol=1e-2, atol=1e-3).item()
