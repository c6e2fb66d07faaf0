"""The attention dispatch (transforms/attention.py) and the batch attention kernel ops
around it: which cache answers for itself, and the compiled step through the kernels.

On the CPU the ops' references stand in for the kernels (`registry.using("standin")`),
so the code around a kernel runs as it does on a GPU; on CUDA the kernels run (their
parity with the references: tests/test_kernel_registry.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, KVCache

from batchgen.cache.fp16 import Fp16BatchCache, Fp16Cache
from batchgen.kernels import registry
from batchgen.transforms.attention import route_attention, routed_modules, unroute_attention


@pytest.fixture
def kernels_here():
    """The kernels where MLX has a CUDA GPU, their references standing in elsewhere."""
    if registry.available():
        yield
    else:
        with registry.using("standin"):
            yield


def batch_cache(cls, pads: list[int], kv_heads=2, dim=64, end=64, seed=0, **kw):
    cache = cls(pads, **kw)
    k0, k1 = mx.random.split(mx.random.key(seed))
    cache.update_and_fetch(mx.random.normal((len(pads), kv_heads, end, dim), key=k0),
                           mx.random.normal((len(pads), kv_heads, end, dim), key=k1))  # fmt: skip
    mx.eval(cache.keys, cache.values)
    return cache


def test_dispatch_lets_each_cache_answer_and_restores_the_stock_path(model_dir):
    """batchgen's caches answer (or decline with NotImplemented); mlx-lm's own take the
    stock path; unrouting puts mlx-lm's function back."""
    from mlx_lm import load
    from mlx_lm.models import qwen3

    model, _ = load(str(model_dir("qwen3")))
    unroute_attention()  # whatever earlier tests of this process routed
    assert route_attention(model) == ["mlx_lm.models.qwen3"] and routed_modules() == ["mlx_lm.models.qwen3"]
    assert route_attention(model) == ["mlx_lm.models.qwen3"]  # idempotent
    sdpa = qwen3.scaled_dot_product_attention
    q = mx.random.normal((1, 4, 6, 16), key=mx.random.key(1))
    k = v = mx.random.normal((1, 2, 10, 16), key=mx.random.key(2))
    calls = []

    class Answering(KVCache):
        def attention(self, queries, keys, values, scale, mask, sinks=None):
            calls.append("answered")
            return mx.zeros(queries.shape)

    class Declining(KVCache):
        def attention(self, queries, keys, values, scale, mask, sinks=None):
            calls.append("declined")
            return NotImplemented

    stock = base.scaled_dot_product_attention(q, k, v, cache=KVCache(), scale=0.25, mask="causal")
    assert mx.array_equal(sdpa(q, k, v, cache=Answering(), scale=0.25, mask="causal"), mx.zeros(q.shape))
    assert mx.array_equal(sdpa(q, k, v, cache=Declining(), scale=0.25, mask="causal"), stock)
    assert mx.array_equal(sdpa(q, k, v, cache=KVCache(), scale=0.25, mask="causal"), stock)
    assert calls == ["answered", "declined"]
    # Fp16Cache: short passes as plain ops (same numbers), one token through the stock path.
    short = Fp16Cache()
    assert mx.allclose(sdpa(q, k, v, cache=short, scale=0.25, mask="causal"), stock, atol=1e-5)
    assert short.attention(q[:, :, :1], k, v, scale=0.25, mask=None) is NotImplemented
    assert Fp16Cache(max_queries=0).attention(q, k, v, scale=0.25, mask="causal") is NotImplemented
    unroute_attention()
    assert qwen3.scaled_dot_product_attention is base.scaled_dot_product_attention and not routed_modules()


def test_batch_cache_steps_through_the_decode_kernel(kernels_here, monkeypatch, model_dir):
    """An Fp16BatchCache's one-query step goes to `batch_decode` (each row from its own
    first position, no mask array); mlx-lm's BatchKVCache keeps the stock path; both
    agree."""
    from mlx_lm import load
    from mlx_lm.models import llama

    route_attention(load(str(model_dir("llama")))[0])
    sdpa = llama.scaled_dot_product_attention
    launched = []
    op = registry.OPS["batch_decode"]
    monkeypatch.setattr(op, "kernel_form", lambda *a, form=op.kernel_form: launched.append(1) or form(*a))
    pads = [3, 0, 40]
    q = mx.random.normal((3, 4, 1, 64), key=mx.random.key(1))
    new_k, new_v = (mx.random.normal((3, 2, 1, 64), key=mx.random.key(s)) for s in (4, 5))

    def step(cache):  # as a model layer does: the mask for one new token, then the update
        mask = cache.make_mask(1, return_array=True)
        keys, values = cache.update_and_fetch(new_k, new_v)
        return sdpa(q, keys, values, cache=cache, scale=0.125, mask=mask)

    stock = step(batch_cache(BatchKVCache, pads))
    assert not launched
    fused = step(batch_cache(Fp16BatchCache, pads, kernels=True))
    assert launched == [1]
    assert np.abs(np.array(stock) - np.array(fused)).max() < 1e-4
    unroute_attention()


def compiled_steps_against_uncompiled(path, kernel: bool, steps: int = 40, fused: bool = False) -> float:
    """Largest logit difference between the compiled step (big buffers plus the recent
    window, flushed when full) and mlx-lm's BatchKVCache stepped uncompiled, float32,
    over `steps` steps. `fused`: the weights fused, so that the step runs through
    `step_forward` (and, with `kernel`, the fused step kernel); else through the model's
    own layers."""
    from mlx_lm import load

    from batchgen.step.compiled import CompiledSteps
    from batchgen.step.forward import make_step_forward
    from batchgen.transforms.fusion import fuse_model

    model, _ = load(str(path))
    if fused:
        fuse_model(model, quantized=True)
    assert (make_step_forward(model) is not None) == fused
    route_attention(model)
    try:
        pads = [0, 9, 3, 30]
        prompt = mx.random.randint(0, 300, (len(pads), 40), key=mx.random.key(2))
        caches = []
        for kind in (BatchKVCache, Fp16BatchCache):
            cache = [kind(pads) for _ in model.layers]
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
        unroute_attention()


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_step_through_the_kernel_matches_the_uncompiled_step(kernels_here, model_dir, monkeypatch, fused):
    """The step kernel (big buffers, window and new token; the window written on the
    way) gives mlx-lm's uncompiled step's logits across a flush; `fused`: through
    `step_forward` and the fused step kernel (q and the new k read from the rotated
    projection, v from the projection)."""
    path = model_dir("qwen2", hidden_size=256)  # head dim 64, one the kernels take
    op = registry.OPS["batch_fused_step" if fused else "batch_step"]
    traced = []
    monkeypatch.setattr(op, "kernel_form", lambda *a, form=op.kernel_form: traced.append(1) or form(*a))
    assert compiled_steps_against_uncompiled(path, kernel=True, fused=fused) < 1e-3
    assert traced  # the recording went through the kernel op (each layer, each recording)
