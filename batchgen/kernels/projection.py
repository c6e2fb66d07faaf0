"""A batch step's projections, y = x @ w.T (+ bias) for a few rows, on tensor cores
(CUDA; source cuda/projection.cu).

A batched decode step multiplies a handful of rows (one token per job) by every weight
matrix of the model. For a small model each product is bound by its launch: MLX hands it
to cuBLASLt, which spends host time on every call (a descriptor, a heuristic query, a
captured launch). This kernel, written for the shape, launches for less. Large weights
stay with cuBLASLt, which reads them faster one product after another
(bench/RESULTS.md#projection-kernel).

bf16 only (the mma here is bf16), rows <= `MAX_ROWS`, weights of at most
`MAX_WEIGHT_BYTES`, K and N multiples of 32; anything else is a plain matmul (`takes`).
"""

from __future__ import annotations

import mlx.core as mx

from .registry import Op, register

# Where the kernel pays: a product this small is bound by its launch; past 8 rows, or
# 20 MB of weights, cuBLASLt reads the weights faster (bench/RESULTS.md#projection-kernel).
MAX_ROWS = 8
MAX_WEIGHT_BYTES = 20 << 20
WARPS = 8
WIDE_GRID = 256  # blocks of two 16-row tiles from this many on; fewer: one tile a block, twice the blocks

INPUTS = ("x", "w", "bias")
OUTPUTS = ("y",)


def takes(x: mx.array, w: mx.array) -> bool:
    """Whether `project(x, w)` runs the kernel: CUDA, bf16, x (rows, K) with
    rows <= MAX_ROWS, w (N, K) of at most MAX_WEIGHT_BYTES, K and N multiples of 32."""
    return PROJECTION.takes(x, w)


def _runs(x: mx.array, w: mx.array, bias: mx.array | None = None) -> bool:
    if x.ndim != 2 or w.ndim != 2 or x.dtype != mx.bfloat16 or w.dtype != mx.bfloat16:
        return False
    (rows, k), (n, wk) = x.shape, w.shape
    return k == wk and 0 < rows <= MAX_ROWS and w.nbytes <= MAX_WEIGHT_BYTES and k % 32 == 0 and n % 32 == 0


def row_tiles(n: int) -> int:
    """16-row tiles of w a block owns (FT): two where that still leaves `WIDE_GRID` blocks."""
    return 2 if n // 32 >= WIDE_GRID else 1


def template(rows: int, n: int, bias: bool) -> list:
    """The kernel's constants for `rows` rows of x and n outputs."""
    return [("NT", -(-rows // 8)), ("FT", row_tiles(n)), ("WARPS", WARPS), ("HAS_BIAS", int(bias))]


def _kernel(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    rows, n = x.shape[0], w.shape[0]
    threads = 32 * WARPS
    return PROJECTION.kernel()(
        inputs=[x, w, x if bias is None else bias],  # without a bias the kernel never reads its third input
        template=template(rows, n, bias is not None),
        grid=(n // (16 * row_tiles(n)) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )[0]


def _reference(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    y = x @ w.T
    return y if bias is None else y + bias


def _examples():
    def rand(shape, seed):
        return (mx.random.normal(shape, key=mx.random.key(seed)) * 0.05).astype(mx.bfloat16)

    return [((rand((rows, k), 1), rand((n, k), 2), rand((n,), 3) if bias else None), {})
            for rows, k, n, bias in ((1, 896, 1152, False), (8, 896, 9728, True), (3, 1536, 256, True))]  # fmt: skip


PROJECTION = register(Op(
    "few_row_projection", "projection.cu", INPUTS, OUTPUTS, launch=_kernel, reference=_reference, runs=_runs,
    examples=_examples, tolerance=1e-2,  # bf16 outputs
))  # fmt: skip


def project(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (rows, K) @ w (N, K).T (+ bias (N,)) -> (rows, N): the kernel where `takes(x, w)`."""
    return PROJECTION(x, w, bias)
