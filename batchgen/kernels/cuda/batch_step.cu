// The compiled batch step's attention (batchgen/step/compiled.py's StepCache): each row
// over its positions in the big buffers, the recent window and its own new token (kn,
// vn), which goes into the window's slot on the way.
#include "common.cuh"
// --- body ---
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  #define QP (q + (size_t)bh * D)
  #define KN (kn + ((size_t)b * HKV + hk) * D)
  #define VN (vn + ((size_t)b * HKV + hk) * D)
#include "step_attend.cuh"

