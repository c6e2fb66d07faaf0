// Body fragment of the batch step kernels: positions below `base` in the big buffers k,
// v; `base` .. `base + used - 1` in the recent window rk, rv; the step's own token (KN,
// VN) at `base + used`, written into the window's slot `used` on the way (rk_out, rv_out:
// by the first query head of each key head), so that the step writes no big buffer.
  const int base = meta[0], used = meta[1], cap = meta[2], W = meta[3];
  const int start = left_padding[b], stop = base + used + 1;
  const size_t row = (size_t)b * HKV + hk;
  if (h % (HQ / HKV) == 0) {
    for (int i = threadIdx.x; i < W * D; i += blockDim.x) {
      const int slot = i / D;
      const size_t at = row * W * D + i;
      rk_out[at] = slot == used ? KN[i % D] : rk[at];
      rv_out[at] = slot == used ? VN[i % D] : rv[at];
    }
  }

