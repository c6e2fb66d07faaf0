// batch_step.cu for step/forward.py's step: q and the new k read from the fused q|k|v
// projection after RoPE (`q`: (B, HT, D), HT = HQ + 2 HKV heads, all rotated), the new v
// from the projection before it (`heads`), so that nothing is sliced (and copied) out of
// either first.
#include "common.cuh"
// --- body ---
  const int b = blockIdx.x / (HQ / QB), h = (blockIdx.x % (HQ / QB)) * QB, hk = h / (HQ / HKV);
  #define QP(g) (q + ((size_t)b * HT + h + (g)) * D)
  #define OUT(g) (out + ((size_t)b * HQ + h + (g)) * D)
  #define KN (q + ((size_t)b * HT + HQ + hk) * D)
  #define VN (heads + ((size_t)b * HT + HQ + HKV + hk) * D)
#include "step_attend.cuh"
