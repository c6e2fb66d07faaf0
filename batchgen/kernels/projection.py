"""A batch step's projections, y = x @ w.T (+ bias) for a few rows, on tensor cores (CUDA).

A batched decode step multiplies a handful of rows (one token per job) by
every weight matrix of the model. For a small model each product is bound by
its launch: MLX hands it to cuBLASLt, which spends host time on every call (a
descriptor, a heuristic query, a captured launch). This kernel, written for
the shape, launches for less (0.5B shape, 8 rows, H200: 11-14 us a product
against 15-18; a step of an 8-row run 3.63 -> 2.91 ms). Each block owns 16 or
32 consecutive weight rows (outputs), its warps split K, and every load is 16
bytes wide, weights straight from memory into `mma.sync` fragments. Large
weights stay with cuBLASLt, which reads them faster one product after another.

The fragment trick: m16n8k16's A fragment wants, per lane (group g = lane/4,
t = lane%4), row g's k pairs {2t, 2t+1} and {2t+8, 2t+9}; a 16-byte load
gives row g's k = 8t .. 8t+7 of a 32-wide block. A dot product does not
care in which order its k are summed, so the two mma steps of a block take
k = 8t+{0,1}, 8t+{2,3} and then 8t+{4,5}, 8t+{6,7} as "their" pairs, and the
B fragment (x's rows, n = g) takes the same k from the same kind of load.
Every element of the block is used once; the sums are float32.

bf16 only (the mma here is bf16), rows <= `MAX_ROWS`, weights of at most
`MAX_WEIGHT_BYTES`, K and N multiples of 32; anything else is a plain matmul
(`takes`). The CPU never gets here.
"""

from __future__ import annotations

import mlx.core as mx

from .turboquant import available

# Where the kernel pays, measured in compiled steps (bench/projection_probe.py, H200,
# bench/results/2026-11-30-h200-v): a product this small is bound by its launch, and
# this launch costs less than cuBLASLt's (0.5B shape, 2 / 8 rows: 3.02 -> 2.41, 2.94 ->
# 2.73 ms a step). Beyond it cuBLASLt reads the weights faster than this kernel does
# one product after another (7B shape, 8 rows, qkv and o alone: 6.01 -> 6.33 ms; at 32
# rows every product slower); at 16 rows the step and the throughput runs disagreed.
MAX_ROWS = 8
MAX_WEIGHT_BYTES = 20 << 20
WARPS = 8
WIDE_GRID = 256  # blocks of two 16-row tiles from this many on; fewer: one tile a block, twice the blocks

SOURCE = r"""
  // y (M, N) = x (M, K) . w (N, K)^T (+ bias): NT column tiles of 8 rows, FT row tiles of 16 outputs.
  constexpr int U = 8 / FT;  // 32-wide k blocks a warp loads before it multiplies: 16 loads of 16 bytes in flight
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int M = x_shape[0], K = x_shape[1], KB = K / 32;
  const int N = gridDim.x * FT * 16, n0 = blockIdx.x * FT * 16;
  __shared__ float red[FT * 16][NT * 8];
  for (int i = threadIdx.x; i < FT * 16 * NT * 8; i += blockDim.x) (&red[0][0])[i] = 0.f;

  const uint4* wrow[FT][2];  // rows g and g + 8 of each 16-row tile, at k = 8t
  #pragma unroll
  for (int f = 0; f < FT; ++f)
    #pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[f][h] = reinterpret_cast<const uint4*>(w + (size_t)(n0 + 16 * f + 8 * h + g) * K) + t;
  const uint4* xrow[NT];
  bool xin[NT];
  #pragma unroll
  for (int j = 0; j < NT; ++j) {
    xin[j] = 8 * j + g < M;
    xrow[j] = reinterpret_cast<const uint4*>(x + (size_t)(xin[j] ? 8 * j + g : 0) * K) + t;
  }
  float acc[FT][NT][4];
  #pragma unroll
  for (int f = 0; f < FT; ++f)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int r = 0; r < 4; ++r) acc[f][j][r] = 0.f;

  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int kb0 = warp * U; kb0 < KB; kb0 += WARPS * U) {
    uint4 a[U][FT][2];
    #pragma unroll
    for (int u = 0; u < U; ++u)
      #pragma unroll
      for (int f = 0; f < FT; ++f)
        #pragma unroll
        for (int h = 0; h < 2; ++h) a[u][f][h] = kb0 + u < KB ? wrow[f][h][(kb0 + u) * 4] : zero;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kb0 + u >= KB) break;
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 b = xin[j] ? xrow[j][(kb0 + u) * 4] : zero;
        #pragma unroll
        for (int f = 0; f < FT; ++f) {
          mma_bf16(acc[f][j], a[u][f][0].x, a[u][f][1].x, a[u][f][0].y, a[u][f][1].y, b.x, b.y);
          mma_bf16(acc[f][j], a[u][f][0].z, a[u][f][1].z, a[u][f][0].w, a[u][f][1].w, b.z, b.w);
        }
      }
    }
  }
  __syncthreads();  // red is zeroed
  // C fragment: rows (outputs) g, g + 8; columns (x rows) 2t, 2t + 1
  #pragma unroll
  for (int f = 0; f < FT; ++f)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int r = 0; r < 4; ++r) atomicAdd(&red[16 * f + g + 8 * (r >> 1)][8 * j + 2 * t + (r & 1)], acc[f][j][r]);
  __syncthreads();
  for (int i = threadIdx.x; i < FT * 16 * NT * 8; i += blockDim.x) {
    const int m = i / (FT * 16), c = i % (FT * 16);
    if (m < M) {
      float v = red[c][m];
      if (HAS_BIAS) v += static_cast<float>(bias[n0 + c]);
      y[(size_t)m * N + n0 + c] = static_cast<__nv_bfloat16>(v);
    }
  }
"""

HEADER = r"""
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

INPUTS = ("x", "w", "bias")
OUTPUTS = ("y",)
_kernel: list = []


def takes(x: mx.array, w: mx.array) -> bool:
    """Whether `project(x, w)` runs the kernel: CUDA, bf16, x (rows, K) with
    rows <= MAX_ROWS, w (N, K) of at most MAX_WEIGHT_BYTES, K and N multiples of 32."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != mx.bfloat16 or w.dtype != mx.bfloat16:
        return False
    (rows, k), (n, wk) = x.shape, w.shape
    return (k == wk and 0 < rows <= MAX_ROWS and w.nbytes <= MAX_WEIGHT_BYTES and k % 32 == 0 and n % 32 == 0
            and available())  # fmt: skip


def row_tiles(n: int) -> int:
    """16-row tiles of w a block owns (FT): two where that still leaves `WIDE_GRID` blocks."""
    return 2 if n // 32 >= WIDE_GRID else 1


def template(rows: int, n: int, bias: bool) -> list:
    """The kernel's constants for `rows` rows of x and n outputs."""
    return [("NT", -(-rows // 8)), ("FT", row_tiles(n)), ("WARPS", WARPS), ("HAS_BIAS", int(bias))]


def project(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (rows, K) @ w (N, K).T (+ bias (N,)) -> (rows, N), where `takes(x, w)`."""
    if not _kernel:
        _kernel.append(mx.fast.cuda_kernel(name="few_row_projection", input_names=list(INPUTS),
                                           output_names=list(OUTPUTS), source=SOURCE, header=HEADER))  # fmt: skip
    rows, n = x.shape[0], w.shape[0]
    threads = 32 * WARPS
    return _kernel[0](
        inputs=[x, w, x if bias is None else bias],  # without a bias the kernel never reads its third input
        template=template(rows, n, bias is not None),
        grid=(n // (16 * row_tiles(n)) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
    )[0]
