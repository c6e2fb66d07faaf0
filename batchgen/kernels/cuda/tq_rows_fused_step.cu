// tq_rows_step.cu for step/forward.py's step: q and the new k from the fused projection
// after RoPE, the new v from before it (as batch_fused_step.cu).
#include "common.cuh"
// --- body ---
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  #define QP (q + ((size_t)b * HT + h) * D)
  #define KN (q + ((size_t)b * HT + HQ + hk) * D)
  #define VN (heads + ((size_t)b * HT + HQ + HKV + hk) * D)
#include "tq_rows.cuh"

