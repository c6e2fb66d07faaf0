// TurboQuant's probability-weighted values straight from packed value codes:
//   o[c, m, i] = sum_{j in chunk c} p[m, j] * table[code_j(i)]
// p (BH, M, n) float32, already multiplied by the value scales; codes as tq_scores'.
// The positions are split into chunks of CHUNK so that a long history still fills the
// GPU; the caller adds the chunks' partial sums. A thread a coordinate i.
#include "common.cuh"
// --- body ---
  __shared__ float stab[1 << BITS];
  const int bh = blockIdx.y, c = blockIdx.x, i = threadIdx.x;
  for (int t = i; t < (1 << BITS); t += blockDim.x) stab[t] = table[t];
  __syncthreads();
  const int n = meta[0], cap = meta[1];
  const int j0 = c * CHUNK, j1 = min(n, j0 + CHUNK);
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  const unsigned int* rows = codes + (size_t)bh * cap * W;
  const float* pb = p + (size_t)bh * M * n;
  for (int j = j0; j < j1; j++) {
    const float v = stab[tq_code<BITS>(rows + (size_t)j * W, i)];
    #pragma unroll
    for (int m = 0; m < M; m++) acc[m] += pb[(size_t)m * n + j] * v;
  }
  float* o = out + (((size_t)bh * gridDim.x + c) * M) * D + i;
  #pragma unroll
  for (int m = 0; m < M; m++) o[(size_t)m * D] = acc[m];

