// One-query attention over a left-padded batch cache (mlx-lm's BatchKVCache after its
// update): row b over its own positions left_padding[b] .. meta[0] - 1 of one buffer
// (meta: [write position, capacity]). MLX's CUDA backend has no fused one-query
// attention that takes a mask; this reads each row from its own first position instead.
#include "common.cuh"
// --- body ---
  const int b = blockIdx.x / (HQ / QB), h = (blockIdx.x % (HQ / QB)) * QB, hk = h / (HQ / HKV);
  #define QP(g) (q + ((size_t)b * HQ + h + (g)) * D)
  #define OUT(g) (out + ((size_t)b * HQ + h + (g)) * D)
  const int start = left_padding[b], stop = meta[0], cap = meta[1];
  const size_t row = (size_t)b * HKV + hk;
  #define KEY(j) (k + (row * cap + (j)) * D)
  #define VAL(j) (v + (row * cap + (j)) * D)
#include "attend.cuh"
