"""The fused CUDA kernels against a float64 reference of the same sums.

Runs where MLX has a CUDA GPU (the kernels have no CPU build); skipped elsewhere.
The reference decodes the codes elementwise (no matmul: float32 matmuls on the GPU
may run in TF32, ~1e-3 relative) and sums in float64 with numpy.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchgen.cache import turboquant as tq
from batchgen.kernels import turboquant as kernels

pytestmark = pytest.mark.cuda


def filled_cache(n_tokens: int, dim: int, key_bits: int, value_bits: int, heads: int = 2, seed: int = 0):
    cache = tq.TurboQuantKVCache(key_bits=key_bits, value_bits=value_bits, seed=seed)
    k0, k1 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, heads, n_tokens, dim), key=k0)
    values = mx.random.normal((1, heads, n_tokens, dim), key=k1)
    for lo in range(0, n_tokens, 512):  # several chunks: capacity past offset, as in use
        cache.update_and_fetch(keys[:, :, lo : lo + 512], values[:, :, lo : lo + 512])
    mx.eval(cache.key_codes, cache.value_codes)
    return cache


def decoded(codes, scales, bits: int, dim: int, n: int) -> np.ndarray:
    """(B, H, n, dim) float64: scale / sqrt(d) x codebook values, decoded elementwise."""
    levels = np.array(tq._levels(codes[:, :, :n], bits, dim), dtype=np.float64)
    return levels * np.array(scales[:, :, :n].astype(mx.float32), dtype=np.float64)[..., None] / np.sqrt(dim)


def close(fused: mx.array, exact: np.ndarray, tol: float) -> bool:
    err = np.abs(np.array(fused, dtype=np.float64) - exact).max()
    return err <= tol * max(1.0, np.abs(exact).max())


# Each (bits, dim, rows bucket) builds its own kernels (~1-3 s each on the H200), so
# the grid covers every bit width and dim at decode shape, and longer row counts once.
CASES = [(n, d, b, (7, 1)) for n in (5, 2500) for d in (64, 128) for b in ((5, 3), (4, 4), (2, 2))] + [
    (n, 128, (5, 3), rows) for n in (5, 2500) for rows in ((2, 6), (4, 16))]  # fmt: skip


@pytest.mark.parametrize("n_tokens,dim,bits,rows", CASES)  # rows: (group, queries)
def test_fused_scores_and_values_match_float64(n_tokens, dim, bits, rows):
    group, n_q = rows
    cache = filled_cache(n_tokens, dim, *bits)
    coded = tq.CodedHistory(cache, mx.float32)
    n = coded.n
    q = mx.random.normal((1, 2, group, n_q, dim), key=mx.random.key(7))
    s = coded.scores(q)
    assert s.shape == (1, 2, group, n_q, n)
    k = decoded(cache.key_codes, cache.key_norms, cache.key_bits, dim, n)
    exact = np.einsum("bhgld,bhnd->bhgln", np.array(q, dtype=np.float64), k)
    assert close(s, exact, 1e-5)
    p = mx.softmax(s, axis=-1)
    o = coded.values(p)
    assert o.shape == (1, 2, group, n_q, dim)
    v = decoded(cache.value_codes, cache.value_norms, cache.value_bits, dim, n)
    assert close(o, np.einsum("bhgln,bhnd->bhgld", np.array(p, dtype=np.float64), v), 1e-5)


def test_fused_attention_matches_the_ops_path_in_a_decode_loop():
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
    for plain, fused in outs:  # the ops path may multiply in TF32
        assert mx.allclose(plain, fused, rtol=1e-2, atol=1e-3).item()
