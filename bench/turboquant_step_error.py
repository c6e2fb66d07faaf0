"""How far the CUDA step kernel (`turboquant_kernels.step`) lands from the plain-ops
reference of the test suite, float32, over a few decode steps a shape.

    python bench/turboquant_step_error.py

Prints `max_rel_err HEADS DIM POSITIONS ERR` a shape: the largest |kernel - reference|
over the steps, over the reference's largest value (at least 1). CUDA only.
"""

import sys

import mlx.core as mx

sys.path.insert(0, "tests")
import test_turboquant_step as T  # noqa: E402  (the reference lives with its tests)

from batchgen import turboquant as tq  # noqa: E402
from batchgen import turboquant_kernels as kernels  # noqa: E402

SHAPES = [((28, 4), 128, 3000), ((14, 2), 64, 700), ((32, 2), 64, 900)]  # (heads, kv heads), D, positions
STEPS = 20


def worst_error(heads: tuple, dim: int, n: int) -> float:
    n_heads, kv_heads = heads
    total = n + STEPS
    k, v = T.kv(total, 31, heads=kv_heads, dim=dim, dtype=mx.float32)
    q = mx.random.normal((1, n_heads, total, dim), key=mx.random.key(32))
    cache = tq.TurboQuantKVCache(4)
    cache.routed = True
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    cache.attention(q[:, :, n - 1 :], scale=dim**-0.5, mask=None)
    real, worst = kernels.step, 0.0
    for t in range(n, total):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        calls = []
        kernels.step = lambda *a: calls.append(a) or real(*a)
        try:
            out = cache.attention(q[:, :, t : t + 1], scale=dim**-0.5, mask=None)
        finally:
            kernels.step = real
        want, _ = T.reference_step(*calls[0])
        worst = max(worst, mx.abs(out - want).max().item() / max(1.0, mx.abs(want).max().item()))
    return worst


if __name__ == "__main__":
    if not kernels.available():
        sys.exit("needs MLX with a CUDA GPU")
    for heads, dim, n in SHAPES:
        print("max_rel_err", heads, dim, n, f"{worst_error(heads, dim, n):.2e}", flush=True)
