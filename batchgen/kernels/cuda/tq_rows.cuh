// Body fragment: TurboQuant batch rows' step (batchgen/cache/turboquant_rows.py). As
// attend.cuh, a block per (row, query head) and lane groups over the row's columns with
// an online softmax; each column's key read exact (a pointer into the sinks, tail,
// window or the new token) or from its codes (a lane's 8 coordinates of the packed row,
// against the rotated query), its value added to one of two sums: the exact values'
// (plain domain) and the coded values' (rotated domain). The block rotates its query and
// takes the second sum back itself (a Walsh-Hadamard transform in shared memory).
// Column j of row b (its position j - left_padding[b]): the new token at j = p = base +
// used, window slots above base, sinks (positions below S), the tail (base - E .. base -
// 1) within the query's window (j > p - WIN), and codes (big buffers) below that. A coded
// column's norm scales each lane's part of its score before the lanes' sum.
#include "window.cuh"
#include "lanes.cuh"
  static_assert(KB <= 5 && VB <= 5, "a lane's 8 codes lie within two words");
  const int p = base + used;
  const float unit = rsqrtf((float)D);
  __shared__ float hq[D], ktab[1 << KB], vtab[1 << VB];
  for (int t = threadIdx.x; t < (1 << KB); t += blockDim.x) ktab[t] = tabs[t];
  for (int t = threadIdx.x; t < (1 << VB); t += blockDim.x) vtab[t] = tabs[(1 << KB) + t];
  for (int d = threadIdx.x; d < D; d += blockDim.x) hq[d] = static_cast<float>(QP[d]) * sc * signs[d];
  tq_fwht<D>(hq);
  float qr[PER], qh[PER], acc[PER], acr[PER];
  ld8(QP + sub * PER, qr);
  #pragma unroll
  for (int i = 0; i < PER; i++) {
    qr[i] *= sc;
    qh[i] = hq[sub * PER + i] * unit;
    acc[i] = 0.0f;
    acr[i] = 0.0f;
  }
  #define SEL(j, which) ((j) >= base ? ((j) < p ? r##which + (row * W + (j) - base) * D : which##NEW) \
      : (j) - start < S ? s##which + (row * S + (j) - start) * D \
      : (j) > p - WIN ? t##which + (row * E + (j) - base + E) * D : nullptr)
  #define kNEW KN
  #define vNEW VN
  float m = -INFINITY, l = 0.0f;
  for (int j0 = start + warp * UNROLL * CPW; j0 < stop; j0 += WARPS * UNROLL * CPW) {
    float s[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int j = j0 + u * CPW + grp;
      s[u] = 0.0f;
      if (j < stop) {
        const auto* kr = SEL(j, k);
        if (kr != nullptr) {
          float kx[PER];
          ld8(kr + sub * PER, kx);
          #pragma unroll
          for (int i = 0; i < PER; i++) s[u] += qr[i] * kx[i];
        } else {
          const unsigned long long c = tq_bits8<KB>(kcode + (row * cap + j) * KW, sub);
          #pragma unroll
          for (int i = 0; i < PER; i++) s[u] += qh[i] * ktab[(c >> (i * KB)) & ((1u << KB) - 1u)];
          s[u] *= __half2float(knorm[row * cap + j]) * unit;
        }
      }
    }
    const float mn = lane_sums<UNROLL, LPC, CPW>(s, m, j0 + grp, stop);
    if (mn == -INFINITY) continue;  // none of this group's columns this round (the warp's last)
    const float corr = expf(m - mn);
    l *= corr;
    #pragma unroll
    for (int i = 0; i < PER; i++) {
      acc[i] *= corr;
      acr[i] *= corr;
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int j = j0 + u * CPW + grp;
      if (j < stop) {
        const float w = expf(s[u] - mn);
        l += w;
        const auto* vr = SEL(j, v);
        if (vr != nullptr) {
          float vx[PER];
          ld8(vr + sub * PER, vx);
          #pragma unroll
          for (int i = 0; i < PER; i++) acc[i] += w * vx[i];
        } else {
          const float f = w * __half2float(vnorm[row * cap + j]) * unit;
          const unsigned long long c = tq_bits8<VB>(vcode + (row * cap + j) * VW, sub);
          #pragma unroll
          for (int i = 0; i < PER; i++) acr[i] += f * vtab[(c >> (i * VB)) & ((1u << VB) - 1u)];
        }
      }
    }
    m = mn;
  }
  __shared__ float sacc[NP * D], sacr[NP * D];
  #pragma unroll
  for (int i = 0; i < PER; i++) {
    sacc[pid * D + sub * PER + i] = acc[i];
    sacr[pid * D + sub * PER + i] = acr[i];
  }
#include "merge_weights.cuh"
  float plain = 0.0f;
  const int d = threadIdx.x;
  if (d < D) {
    float rot = 0.0f;
    #pragma unroll 4
    for (int x = 0; x < NP; x++) {
      plain += sacc[x * D + d] * wt[x];
      rot += sacr[x * D + d] * wt[x];
    }
    hq[d] = rot;
  }
  tq_fwht<D>(hq);  // the coded values' sum back from the rotated domain: R^-1 y = signs * H y / sqrt(D)
  if (d < D) out[(size_t)bh * D + d] = tot > 0.0f ? (plain + hq[d] * unit * signs[d]) / tot : 0.0f;
