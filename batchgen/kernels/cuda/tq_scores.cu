// TurboQuant scores straight from packed key codes, for the M = group x queries rows
// of one kv head (a decode step: the heads of a kv head; a verify pass: times its
// queries):   s[m, j] = scale_j / sqrt(D) * sum_i q[m, i] * table[code_j(i)]
// q (BH, M, D) float32, rotated; codes (BH, capacity, W) uint32, the cache's whole
// buffer (rows past n unused, so nothing is copied per call); scales (BH, capacity)
// float16; meta [n, capacity]. A thread a position j; the block's queries and the
// codebook in shared memory.
#include "common.cuh"
// --- body ---
  __shared__ float sq[M * D];
  __shared__ float stab[1 << BITS];
  const int bh = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  for (int t = threadIdx.x; t < M * D; t += blockDim.x) sq[t] = q[(size_t)bh * M * D + t];
  for (int t = threadIdx.x; t < (1 << BITS); t += blockDim.x) stab[t] = table[t];
  __syncthreads();
  const int n = meta[0], cap = meta[1];
  if (j >= n) return;
  const unsigned int* row = codes + ((size_t)bh * cap + j) * W;
  unsigned int words[W];
  #pragma unroll
  for (int w = 0; w < W; w++) words[w] = row[w];
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  #pragma unroll
  for (int i = 0; i < D; i++) {
    const float v = stab[tq_code<BITS>(words, i)];
    #pragma unroll
    for (int m = 0; m < M; m++) acc[m] += sq[m * D + i] * v;
  }
  const float sc = __half2float(scales[(size_t)bh * cap + j]) * (1.0f / sqrtf((float)D));
  #pragma unroll
  for (int m = 0; m < M; m++) out[((size_t)bh * M + m) * n + j] = acc[m] * sc;

