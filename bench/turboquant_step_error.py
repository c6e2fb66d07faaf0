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

from batchgen.kernels import turboquant as kernels  # noqa: E402

SHAPES = [((28, 4), 128, 3000), ((14, 2), 64, 700), ((32, 2), 64, 900)]  # (heads, kv heads), D, positions
STEPS = 20


def worst_error(heads: tuple, dim: int, n: int) -> float:
    worst = 0.0
    for _, _, out, want, _ in T.kernel_steps(heads, dim, n, STEPS, mx.float32):
        worst = max(worst, mx.abs(out - want).max().item() / max(1.0, mx.abs(want).max().item()))
    return worst


if __name__ == "__main__":
    if not kernels.available():
        sys.exit("needs MLX with a CUDA GPU")
    for heads, dim, n in SHAPES:
        print("max_rel_err", heads, dim, n, f"{worst_error(heads, dim, n):.2e}", flush=True)
