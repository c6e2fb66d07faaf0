// Body fragment: the warps take the columns from the row's first real position (`start`)
// to `stop`; each lane group keeps an online softmax (running max m, sum l, weighted
// values acc) for each of the block's QB query heads, and the WARPS x CPW partial results
// are merged at the end through shared memory, one head after another. KEY(j) / VAL(j)
// point at position j's vectors, QP(g) / OUT(g) at the block's g-th query head's query
// and output: the kernels that include this differ only in where these live.
// QB = 1: a block per (row, query head). QB = HQ / HKV: a block per (row, kv head), each
// key and value loaded once for all the query heads that read it (a grouped-query
// model's heads otherwise read the same positions HQ / HKV times over).
// TILED: the grouped form with keys and values staged in shared memory (attend_tiled.cuh).
#include "lanes.cuh"
  if constexpr (TILED) {
#include "attend_tiled.cuh"
  } else {
    float qr[QB][PER], acc[QB][PER], mq[QB], lq[QB];
    #pragma unroll
    for (int g = 0; g < QB; g++) {
      ld8(QP(g) + sub * PER, qr[g]);
      #pragma unroll
      for (int i = 0; i < PER; i++) {
        qr[g][i] *= sc;
        acc[g][i] = 0.0f;
      }
      mq[g] = -INFINITY;
      lq[g] = 0.0f;
    }
    for (int j0 = start + warp * UNROLL * CPW; j0 < stop; j0 += WARPS * UNROLL * CPW) {
      float s[QB][UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int j = j0 + u * CPW + grp;
        #pragma unroll
        for (int g = 0; g < QB; g++) s[g][u] = 0.0f;
        if (j < stop) {
          float kx[PER];
          ld8(KEY(j) + sub * PER, kx);
          #pragma unroll
          for (int g = 0; g < QB; g++) {
            #pragma unroll
            for (int i = 0; i < PER; i++) s[g][u] += qr[g][i] * kx[i];
          }
        }
      }
      float mn[QB];
      #pragma unroll
      for (int g = 0; g < QB; g++) mn[g] = lane_sums<UNROLL, LPC, CPW>(s[g], mq[g], j0 + grp, stop);
      // none of this group's columns this round (the warp's last): the same for every head
      if (mn[0] == -INFINITY) continue;
      #pragma unroll
      for (int g = 0; g < QB; g++) {
        const float corr = expf(mq[g] - mn[g]);
        lq[g] *= corr;
        #pragma unroll
        for (int i = 0; i < PER; i++) acc[g][i] *= corr;
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int j = j0 + u * CPW + grp;
        if (j < stop) {
          float vx[PER];
          ld8(VAL(j) + sub * PER, vx);
          #pragma unroll
          for (int g = 0; g < QB; g++) {
            const float p = expf(s[g][u] - mn[g]);
            lq[g] += p;
            #pragma unroll
            for (int i = 0; i < PER; i++) acc[g][i] += p * vx[i];
          }
        }
      }
      #pragma unroll
      for (int g = 0; g < QB; g++) mq[g] = mn[g];
    }
    __shared__ float sacc[NP * D];
    #pragma unroll
    for (int g = 0; g < QB; g++) {
      if (g > 0) __syncthreads();  // the previous head's sums read from sacc and wt
      const float m = mq[g], l = lq[g];
      #pragma unroll
      for (int i = 0; i < PER; i++) sacc[pid * D + sub * PER + i] = acc[g][i];
  #include "merge_weights.cuh"
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.0f;
        #pragma unroll 4
        for (int x = 0; x < NP; x++) o += sacc[x * D + d] * wt[x];
        OUT(g)[d] = tot > 0.0f ? o / tot : 0.0f;
      }
    }
  }
