// Body fragment: attend.cuh's grouped form, a block per (row, kv head) and its QB query
// heads. The block copies TILE positions' keys and values at a time into shared memory
// (cp.async; the next tile's copy runs under this tile's sums), and each warp serves HPW
// of the QB heads over every position of a tile, so a lane keeps HPW heads' query and
// sums. (Each lane keeping all QB heads, the keys and values read straight from global
// memory, took about three times the registers and more time a step: bench/RESULTS.md
// "Batch attention kernel".) A warp's CPW lane groups take
// a tile's columns in turn and merge by shuffles at the end.
  using KP = decltype(KEY(start));
  constexpr int ES = sizeof(*KEY(start)), ROWB = D * ES;  // bytes an element, a position's key
  constexpr int TILE = 8192 / ROWB, CH = ROWB / 16;        // positions a tile (8 KB of keys), 16-byte copies a position
  constexpr int HPW = (QB + WARPS - 1) / WARPS;            // heads a warp
  __shared__ __align__(16) unsigned char tiles[2][2][TILE * ROWB];  // [buffer][keys, values]
  float qr[HPW][PER], acc[HPW][PER], mq[HPW], lq[HPW];
  #pragma unroll
  for (int i = 0; i < HPW; i++) {
    const int g = warp + i * WARPS;
    if (g < QB) {
      ld8(QP(g) + sub * PER, qr[i]);
    } else {  // a slot past the block's heads: sums nothing it writes
      #pragma unroll
      for (int e = 0; e < PER; e++) qr[i][e] = 0.0f;
    }
    #pragma unroll
    for (int e = 0; e < PER; e++) {
      qr[i][e] *= sc;
      acc[i][e] = 0.0f;
    }
    mq[i] = -INFINITY;
    lq[i] = 0.0f;
  }
  const int n_tiles = stop > start ? (stop - start + TILE - 1) / TILE : 0;
  auto copy_tile = [&](int buf, int j0) {
    for (int x = threadIdx.x; x < 2 * TILE * CH; x += blockDim.x) {
      const int kv = x / (TILE * CH), y = x % (TILE * CH), p = y / CH, c = y % CH, j = j0 + p;
      if (j < stop) {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(kv ? VAL(j) : KEY(j)) + c * 16;
        cp_async16(&tiles[buf][kv][p * ROWB + c * 16], src);
      }
    }
    cp_async_commit();
  };
  if (n_tiles > 0) copy_tile(0, start);
  for (int t = 0; t < n_tiles; t++) {
    const int j0 = start + t * TILE, buf = t & 1;
    const int last = min(stop, j0 + TILE);  // past the tile's positions, or past `stop`
    if (t + 1 < n_tiles) {
      copy_tile(buf ^ 1, j0 + TILE);
    } else {
      cp_async_commit();  // an empty group: the wait below always leaves one group pending
    }
    cp_async_wait<1>();
    __syncthreads();  // tile t in shared memory for every warp
    const KP ks = reinterpret_cast<KP>(tiles[buf][0]), vs = reinterpret_cast<KP>(tiles[buf][1]);
    for (int p0 = 0; j0 + p0 < last; p0 += UNROLL * CPW) {
      float s[HPW][UNROLL];
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int p = p0 + u * CPW + grp;
        #pragma unroll
        for (int i = 0; i < HPW; i++) s[i][u] = 0.0f;
        if (j0 + p < last) {
          float kx[PER];
          ld8(ks + p * D + sub * PER, kx);
          #pragma unroll
          for (int i = 0; i < HPW; i++) {
            #pragma unroll
            for (int e = 0; e < PER; e++) s[i][u] += qr[i][e] * kx[e];
          }
        }
      }
      float mn[HPW];
      #pragma unroll
      for (int i = 0; i < HPW; i++) mn[i] = lane_sums<UNROLL, LPC, CPW>(s[i], mq[i], j0 + p0 + grp, last);
      if (mn[0] == -INFINITY) continue;  // none of this group's columns yet: the same for every head
      #pragma unroll
      for (int i = 0; i < HPW; i++) {
        const float corr = expf(mq[i] - mn[i]);
        lq[i] *= corr;
        #pragma unroll
        for (int e = 0; e < PER; e++) acc[i][e] *= corr;
      }
      #pragma unroll
      for (int u = 0; u < UNROLL; u++) {
        const int p = p0 + u * CPW + grp;
        if (j0 + p < last) {
          float vx[PER];
          ld8(vs + p * D + sub * PER, vx);
          #pragma unroll
          for (int i = 0; i < HPW; i++) {
            const float pr = expf(s[i][u] - mn[i]);
            lq[i] += pr;
            #pragma unroll
            for (int e = 0; e < PER; e++) acc[i][e] += pr * vx[e];
          }
        }
      }
      #pragma unroll
      for (int i = 0; i < HPW; i++) mq[i] = mn[i];
    }
    __syncthreads();  // every warp done with this buffer before tile t + 2 is copied into it
  }
  #pragma unroll
  for (int i = 0; i < HPW; i++) {
    float m = mq[i], l = lq[i];
    #pragma unroll
    for (int o = LPC; o < 32; o <<= 1) {  // the warp's CPW lane groups' sums, one softmax
      const float m2 = __shfl_xor_sync(0xffffffff, m, o), l2 = __shfl_xor_sync(0xffffffff, l, o);
      const float mm = fmaxf(m, m2);
      const float f1 = m == -INFINITY ? 0.0f : expf(m - mm), f2 = m2 == -INFINITY ? 0.0f : expf(m2 - mm);
      l = l * f1 + l2 * f2;
      #pragma unroll
      for (int e = 0; e < PER; e++) acc[i][e] = acc[i][e] * f1 + __shfl_xor_sync(0xffffffff, acc[i][e], o) * f2;
      m = mm;
    }
    const int g = warp + i * WARPS;
    if (g < QB && grp == 0) {
      #pragma unroll
      for (int e = 0; e < PER; e++) OUT(g)[sub * PER + e] = l > 0.0f ? acc[i][e] / l : 0.0f;
    }
  }
