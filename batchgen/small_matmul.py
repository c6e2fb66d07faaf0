"""Projections of a few rows (batched decode, prompt-lookup verify) as one CUDA kernel.

On MLX's CUDA backend a one-row matmul runs MLX's own gemv kernel, but a matmul
of 2 or more rows goes to cuBLASLt, and each such call builds its descriptors,
asks cuBLASLt for an algorithm and captures the launch into a graph, on the host,
every time. A decode step of a batch of 8 rows makes about a hundred of those
(four projections a layer plus the head); the step is host-bound, so that cost
is the step's time (bench/small_matmul_probe.py measures it against this kernel).

`small_matmul(x, w)` computes x (M, K) @ w (N, K)^T for M up to `MAX_ROWS`: each
warp owns `R` output columns and its lanes walk K in 16-byte loads of w; the
rows of x are read through L1 (every warp of a block reads the same x). Weights
are read once per block of rows, accumulation is float32, and a row's result
does not depend on how many rows share the call (same order of sums), so a
job's text does not depend on its batch mates.

`install_small_matmul(model)` is the load-time transform: every plain
`nn.Linear` becomes a `RowsLinear`, which takes this path for 2..`MAX_ROWS`
rows on CUDA and `nn.Linear`'s otherwise (one row, long prompt chunks, CPU).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from .turboquant_kernels import available as cuda_available

MAX_ROWS = 16  # rows above this go to cuBLASLt (tensor cores win once the host cost is shared)
WARPS = 4  # warps per block

_HEADER = """
template <typename T>
__device__ inline void sm_load8(const T* p, float* f, bool vec) {
  if (vec) {
    if constexpr (sizeof(T) == 2) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      const T* h = reinterpret_cast<const T*>(&u);
      #pragma unroll
      for (int j = 0; j < 8; j++) f[j] = static_cast<float>(h[j]);
      return;
    } else if constexpr (sizeof(T) == 4) {
      const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
      f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
      return;
    }
  }
  #pragma unroll
  for (int j = 0; j < 8; j++) f[j] = static_cast<float>(p[j]);
}
"""

# y (M, N) = x (M, K) . w (N, K)^T (+ bias): warp -> R columns, lane -> every 32nd run
# of 8 along K, then a warp sum. Block y: rows m0 .. m0 + MT - 1 (K % 8 == 0).
_BODY = """
  const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
  const int m0 = blockIdx.y * MT;
  if (n0 >= N) return;
  const bool vec = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15) == 0;
  float acc[R][MT];
  #pragma unroll
  for (int r = 0; r < R; r++) {
    #pragma unroll
    for (int m = 0; m < MT; m++) acc[r][m] = 0.0f;
  }
  const T* wr[R];
  #pragma unroll
  for (int r = 0; r < R; r++) wr[r] = w + (size_t)min(n0 + r, N - 1) * K;
  for (int k = lane * 8; k < K; k += 256) {
    float wf[R][8];
    #pragma unroll
    for (int r = 0; r < R; r++) sm_load8(wr[r] + k, wf[r], vec);
    #pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m0 + m < M) {
        float xf[8];
        sm_load8(x + (size_t)(m0 + m) * K + k, xf, vec);
        #pragma unroll
        for (int r = 0; r < R; r++) {
          #pragma unroll
          for (int j = 0; j < 8; j++) acc[r][m] += wf[r][j] * xf[j];
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; r++) {
    #pragma unroll
    for (int m = 0; m < MT; m++) {
      float v = acc[r][m];
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0 && n0 + r < N && m0 + m < M) {
        BIAS_LINE
        y[(size_t)(m0 + m) * N + n0 + r] = static_cast<T>(v);
      }
    }
  }
"""

KERNELS = {  # name: (inputs, outputs, body)
    "small_matmul": (["x", "w"], ["y"], _BODY.replace("BIAS_LINE", "")),
    "small_matmul_bias": (["x", "w", "bias"], ["y"], _BODY.replace("BIAS_LINE", "v += static_cast<float>(bias[n0 + r]);")),
}


@lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs, body = KERNELS[name]
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=body, header=_HEADER)


def launch(rows: int, n: int, dtype) -> dict:
    """Grid and template constants for `rows` x `n` outputs: up to 8 rows a block
    (in buckets, so a few variants compile), R columns a warp (4 for 8-row blocks:
    more reuse of each x load; 2 otherwise)."""
    mt = next(b for b in (2, 4, 8) if rows <= b or b == 8)
    r = 4 if mt == 8 else 2
    per_block = WARPS * r
    return {
        "grid": (-(-n // per_block) * WARPS * 32, -(-rows // mt), 1),
        "threadgroup": (WARPS * 32, 1, 1),
        "template": [("T", dtype), ("R", r), ("MT", mt)],
    }


def supported(x: mx.array, w: mx.array) -> bool:
    """What the kernel takes: 2-D x of 1..MAX_ROWS rows, one float dtype, K a multiple of 8."""
    return (x.ndim == 2 and w.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1]
            and x.shape[1] % 8 == 0 and x.dtype == w.dtype and x.dtype in (mx.bfloat16, mx.float16, mx.float32))  # fmt: skip


def small_matmul(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (M, K) @ w (N, K)^T (+ bias (N,)) on CUDA, for `supported` shapes."""
    if not supported(x, w):
        raise ValueError(f"small_matmul takes x (1..{MAX_ROWS}, K) and w (N, K) of one float dtype with K % 8 == 0, "
                         f"got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")  # fmt: skip
    rows, n = x.shape[0], w.shape[0]
    name, inputs = ("small_matmul", [x, w]) if bias is None else ("small_matmul_bias", [x, w, bias.astype(x.dtype)])
    return _kernel(name)(inputs=inputs, output_shapes=[(rows, n)], output_dtypes=[x.dtype],
                         **launch(rows, n, x.dtype))[0]  # fmt: skip


class RowsLinear(nn.Linear):
    """`nn.Linear` whose calls of 2..MAX_ROWS rows run `small_matmul` (CUDA)."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        rows = x.size // x.shape[-1] if x.ndim else 0
        if 2 <= rows <= MAX_ROWS and x.dtype == w.dtype and x.shape[-1] % 8 == 0:
            y = small_matmul(x.reshape(rows, x.shape[-1]), w, self.get("bias"))
            return y.reshape(*x.shape[:-1], w.shape[0])
        return super().__call__(x)


def install_small_matmul(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` a `RowsLinear` (in place: same
    weights, same parameters); returns how many. Nothing where CUDA is absent."""
    if not cuda_available():
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RowsLinear  # only __call__ differs; the weights stay where they are
            count += 1
    return count
