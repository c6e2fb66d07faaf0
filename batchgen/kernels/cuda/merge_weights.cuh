// Body fragment: the first warp turns the NP lane groups' (m, l) into each partial's
// weight `wt` and the softmax's denominator `tot`; the caller then sums its NP partial
// vectors (in shared memory) with those weights.
  __shared__ float sm[NP], sl[NP], wt[NP], tot_s[1];
  if (sub == 0) { sm[pid] = m; sl[pid] = l; }
  __syncthreads();
  if (warp == 0) {
    float mx_ = -INFINITY;
    for (int x = lane; x < NP; x += 32) mx_ = fmaxf(mx_, sm[x]);
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx_ = fmaxf(mx_, __shfl_xor_sync(0xffffffff, mx_, o));
    float t = 0.0f;
    for (int x = lane; x < NP; x += 32) {
      const float f = sm[x] == -INFINITY ? 0.0f : expf(sm[x] - mx_);
      wt[x] = f;
      t += sl[x] * f;
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
    if (lane == 0) tot_s[0] = t;
  }
  __syncthreads();
  const float tot = tot_s[0];

