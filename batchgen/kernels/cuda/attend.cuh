// Body fragment: a block per (row, query head) (QB = 1) or, on a wide grid, per (row, kv
// head) serving its QB query heads (attend_tiled.cuh: each key and value loaded once for
// them, where a grouped-query model's heads otherwise read the same positions QB times).
// QB = 1: the warps take the columns from the row's first real position (`start`) to
// `stop`; each lane group keeps an online softmax (running max m, sum l, weighted values
// acc), and the WARPS x CPW partial results are merged at the end through shared memory.
// KEY(j) / VAL(j) point at position j's vectors, QP(g) / OUT(g) at the block's g-th query
// head's query and output: the kernels that include this differ only in where these live.
#include "lanes.cuh"
  if constexpr (QB > 1) {
#include "attend_tiled.cuh"
  } else {
    float qr[PER], acc[PER];
    ld8(QP(0) + sub * PER, qr);
    #pragma unroll
    for (int i = 0; i < PER; i++) {
      qr[i] *= sc;
      acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j0 = start + warp * UNROLL * CPW; j0 < stop; j0 += WARPS * UNROLL * CPW) {
      float s[UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int j = j0 + u * CPW + grp;
        s[u] = 0.0f;
        if (j < stop) {
          float kx[PER];
          ld8(KEY(j) + sub * PER, kx);
          #pragma unroll
          for (int i = 0; i < PER; i++) s[u] += qr[i] * kx[i];
        }
      }
      const float mn = lane_sums<UNROLL, LPC, CPW>(s, m, j0 + grp, stop);
      if (mn == -INFINITY) continue;  // none of this group's columns this round (the warp's last)
      const float corr = expf(m - mn);
      l *= corr;
      #pragma unroll
      for (int i = 0; i < PER; i++) acc[i] *= corr;
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int j = j0 + u * CPW + grp;
        if (j < stop) {
          const float p = expf(s[u] - mn);
          float vx[PER];
          ld8(VAL(j) + sub * PER, vx);
          l += p;
          #pragma unroll
          for (int i = 0; i < PER; i++) acc[i] += p * vx[i];
        }
      }
      m = mn;
    }
    __shared__ float sacc[NP * D];
    #pragma unroll
    for (int i = 0; i < PER; i++) sacc[pid * D + sub * PER + i] = acc[i];
  #include "merge_weights.cuh"
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float o = 0.0f;
      #pragma unroll 4
      for (int x = 0; x < NP; x++) o += sacc[x * D + d] * wt[x];
      OUT(0)[d] = tot > 0.0f ? o / tot : 0.0f;
    }
  }
