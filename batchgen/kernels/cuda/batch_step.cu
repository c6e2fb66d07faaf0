// The compiled batch step's attention (batchgen/step/compiled.py's StepCache): each row
// over its positions in the big buffers, the recent window and its own new token (kn,
// vn), which goes into the window's slot on the way.
#include "common.cuh"
// --- body ---
  const int b = blockIdx.x / (HQ / QB), h = (blockIdx.x % (HQ / QB)) * QB, hk = h / (HQ / HKV);
  #define QP(g) (q + ((size_t)b * HQ + h + (g)) * D)
  #define OUT(g) (out + ((size_t)b * HQ + h + (g)) * D)
  #define KN (kn + ((size_t)b * HKV + hk) * D)
  #define VN (vn + ((size_t)b * HKV + hk) * D)
#include "step_attend.cuh"
