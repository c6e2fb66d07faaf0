// A batch step's projections, y = x @ w.T (+ bias) for a few rows, on tensor cores
// (bf16). Each block owns 16 or 32 consecutive weight rows (outputs), its warps split K,
// and every load is 16 bytes wide, weights straight from memory into mma fragments.
// The fragment trick: m16n8k16's A fragment wants, per lane (group g = lane / 4, t =
// lane % 4), row g's k pairs {2t, 2t+1} and {2t+8, 2t+9}; a 16-byte load gives row g's
// k = 8t .. 8t+7 of a 32-wide block. A dot product does not care in which order its k
// are summed, so the two mma steps of a block take k = 8t+{0,1}, 8t+{2,3} and then
// 8t+{4,5}, 8t+{6,7} as "their" pairs, and the B fragment (x's rows, n = g) takes the
// same k from the same kind of load. Every element of the block is used once; the sums
// are float32.
#include "common.cuh"
// --- body ---
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

