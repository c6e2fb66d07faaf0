// turboquant/codec.py's quantize on the GPU, one warp a vector (tq_encode_warp): the
// same routine encodes the step kernel's new token, so a token's codes never depend on
// the path that stored it.
#include "common.cuh"
// --- body ---
  __shared__ unsigned char idx[D];
  const size_t r = blockIdx.x;  // one warp a vector
  tq_encode_warp<D, BITS, W>(x + r * D, 1, sign, tab, edge, idx, codes + r * W, scales + r);

