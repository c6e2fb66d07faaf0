"""`batch_decode_attention` (CUDA) against a float64 reference, and the hook
routing a marked batch cache's one-query steps to it.

Runs where MLX has a CUDA GPU (the kernel has no CPU build); skipped elsewhere.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache

from batchgen.kernels import attention

pytestmark = pytest.mark.cuda


def batch_cache(rows: int, kv_heads: int, dim: int, end: int, pads: list[int], dtype, seed: int = 0):
    cache = BatchKVCache(pads)
    k0, k1 = mx.random.split(mx.random.key(seed))
    cache.update_and_fetch(
        mx.random.normal((rows, kv_heads, end, dim), key=k0).astype(dtype),
        mx.random.normal((rows, kv_heads, end, dim), key=k1).astype(dtype),
    )
    mx.eval(cache.keys, cache.values)
    return cache


def reference(q: mx.array, cache: BatchKVCache, scale: float) -> np.ndarray:
    """Each row over its own positions pads[b] .. end - 1, in float64."""
    qn = np.array(q.astype(mx.float32), dtype=np.float64)[:, :, 0]  # (B, Hq, D)
    k = np.array(cache.keys.astype(mx.float32), dtype=np.float64)
    v = np.array(cache.values.astype(mx.float32), dtype=np.float64)
    pads, end = cache.left_padding.tolist(), cache._idx
    B, Hq, D = qn.shape
    group = Hq // k.shape[1]
    out = np.zeros((B, Hq, 1, D))
    for b in range(B):
        for h in range(Hq):
            keys, vals = k[b, h // group, pads[b] : end], v[b, h // group, pads[b] : end]
            s = keys @ qn[b, h] * scale
            p = np.exp(s - s.max())
            out[b, h, 0] = p @ vals / p.sum()
    return out


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads", [(14, 2), (8, 8)])
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
def test_batch_decode_attention_matches_float64(dim, heads, dtype, tol):
    q_heads, kv_heads = heads
    end = 300
    pads = [0, 299, 17, 150, 5]  # 299: a row holding one token
    cache = batch_cache(len(pads), kv_heads, dim, end, pads, dtype)
    q = mx.random.normal((len(pads), q_heads, 1, dim), key=mx.random.key(3)).astype(dtype)
    scale = dim**-0.5
    assert attention.batch_decode_supported(q, cache)
    bounds = attention.batch_cache_bounds(cache)
    got = attention.batch_decode_attention(q, cache.keys, cache.values, cache.left_padding, bounds, scale)
    assert got.shape == q.shape and got.dtype == dtype
    want = reference(q, cache, scale)
    err = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max()
    assert err <= tol, err


def test_hook_routes_marked_batch_caches_only():
    """A marked BatchKVCache's one-query step goes to the kernel (the array
    mask is never built); unmarked ones keep the stock path; both agree."""
    calls = []
    inner = lambda q, k, v, cache, scale, mask, sinks=None: calls.append("stock") or mx.fast.scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=scale, mask=mask)  # fmt: skip
    sdpa = attention._wrap(inner, attention.DEFAULT_MAX_QUERIES)
    pads = [3, 0, 40]
    q = mx.random.normal((3, 4, 1, 64), key=mx.random.key(1))
    new_k, new_v = (mx.random.normal((3, 2, 1, 64), key=mx.random.key(s)) for s in (4, 5))

    def step(cache):  # as a model layer does: the mask for one new token, then the update
        mask = cache.make_mask(1, return_array=True)
        keys, values = cache.update_and_fetch(new_k, new_v)
        return sdpa(q, keys, values, cache=cache, scale=0.125, mask=mask)

    stock = step(batch_cache(3, 2, 64, 64, pads, mx.float32))
    fused = step(attention.mark_cache([batch_cache(3, 2, 64, 64, pads, mx.float32)])[0])
    assert calls == ["stock"]
    assert np.abs(np.array(stock) - np.array(fused)).max() < 1e-4


def compiled_steps_against_uncompiled(kernel: bool, steps: int = 40, fused: bool = False) -> float:
    """Largest logit difference between the compiled step (big buffers plus
    the recent window, flushed when full) and mlx-lm's BatchKVCache stepped
    uncompiled, float32, over `steps` steps. `fused`: the weights fused, so
    that the step runs through `step_forward` (and, with `kernel`, the fused
    step kernel); else through the model's own layers."""
    from batchgen.bench import random_model
    from batchgen.step.compiled import CompiledSteps
    from batchgen.transforms.fusion import fuse_model
    from batchgen.step.forward import make_step_forward

    model, _ = random_model("qwen2.5-0.5b", "float32", None, 0)
    if fused:
        fuse_model(model)
    assert (make_step_forward(model) is not None) == fused
    attention.install_short_attention(model)
    try:
        pads = [0, 9, 3, 30]
        prompt = mx.random.randint(0, 1000, (len(pads), 40), key=mx.random.key(2))
        caches = []
        for _ in range(2):
            cache = attention.mark_cache([BatchKVCache(pads) for _ in model.layers])
            model(prompt, cache=cache)
            mx.eval([c.state for c in cache])
            caches.append(cache)
        plain, fixed = caches
        stepper = CompiledSteps(model, kernel, {})
        y, worst = mx.array([5, 6, 7, 8], mx.uint32), 0.0
        for _ in range(steps):
            want = model(y[:, None], cache=plain)[:, -1, :]
            tokens, got = stepper(fixed, y, sample=True)
            worst = max(worst, np.abs(np.array(got) - np.array(want)).max())
            y = tokens.astype(mx.uint32)
        return worst
    finally:
        attention.uninstall_short_attention(model)


def test_compiled_step_through_the_kernel_matches_the_uncompiled_step():
    """The step kernel (big buffers, window and new token; the window written
    on the way) gives mlx-lm's uncompiled step's logits, across a flush."""
    assert compiled_steps_against_uncompiled(kernel=True) < 1e-3


def test_fused_step_kernel_matches_the_uncompiled_step():
    """`step_forward` with the fused step kernel (q and the new k read from the
    rotated projection, v from the projection) gives the uncompiled step's logits."""
    assert compiled_steps_against_uncompiled(kernel=True, fused=True) < 1e-3
