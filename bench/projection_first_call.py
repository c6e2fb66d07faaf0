"""Seconds of each few-row projection kernel's first call in a process (its
build) against a second call, on the 0.5B shape's projections (CUDA only).

    python bench/projection_first_call.py

A batch step that first runs at a row count the kernel takes (`projection.takes`)
pays these builds inside the step.
"""

import time

import mlx.core as mx

from batchgen.kernels.projection import available, project, takes

SHAPES = [(2, 1152, 896, True), (2, 896, 896, False), (2, 9728, 896, False), (2, 896, 4864, False),
          (4, 896, 896, False), (8, 1152, 896, True)]  # (rows, n, k, bias) fmt: skip


def main() -> None:
    if not available():
        raise SystemExit("projection_first_call: the kernel runs on CUDA only")
    print("rows n k bias takes call ms")
    for rows, n, k, bias in SHAPES:
        x, w = mx.random.normal((rows, k)).astype(mx.bfloat16), mx.random.normal((n, k)).astype(mx.bfloat16)
        b = mx.zeros((n,), mx.bfloat16) if bias else None
        mx.eval(x, w, *([b] if bias else []))
        for call in range(2):
            start = time.perf_counter()
            mx.eval(project(x, w, b))
            print(rows, n, k, bias, takes(x, w), call, round((time.perf_counter() - start) * 1e3, 1), flush=True)


if __name__ == "__main__":
    main()
