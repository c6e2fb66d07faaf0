// TurboQuant batch rows' compiled step (TurboQuantStepCache), fed the step's new key and value.
#include "common.cuh"
// --- body ---
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  #define QP (q + (size_t)bh * D)
  #define KN (kn + ((size_t)b * HKV + hk) * D)
  #define VN (vn + ((size_t)b * HKV + hk) * D)
#include "tq_rows.cuh"

