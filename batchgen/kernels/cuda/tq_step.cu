// One decode step of one job's TurboQuant cache, or a short pass of up to W tokens (a
// prompt-lookup verify pass): the whole attention of a layer in one launch (reading
// rule: turboquant/reference.py).
//   * grid y is the pass's token: query qi sits at position p = p0 + qi and reads
//     positions 0 .. p. With at most W tokens every token of the pass lies in each later
//     query's exact window, so no query reads a code this launch writes: the pass's
//     exact keys and values come straight from kn / vn (token i at i times their
//     axis-2 stride);
//   * block (row, kv head, chunk c) takes positions [c * span, (c + 1) * span), TILE at a
//     time: scores of the group's G query heads into shared memory (exact positions
//     against the scaled query, coded ones against the rotated query: (R q).(R k) = q.k),
//     an online softmax per head, then thread i adds coordinate i of the
//     probability-weighted values (below D = 256 two threads, each half the positions),
//     coded ones in the rotated domain, exact ones in the plain one;
//   * at D = 128 the coded positions' two products run on tensor cores instead (mma with
//     fp16 codebook levels, rotated queries and weights, float32 sums): a warp scores 32
//     positions 8 at a time and sums 16 coordinates over the tile; key levels two at a
//     time (one 2 KB-bit field, one load of an fp16 pair), value codes staged 16 bytes a
//     load (bench/RESULTS.md#turboquant-step-kernel);
//   * the block that finishes a (row, kv head) last (a counter the kernel keeps and
//     resets) combines its chunks' (max, sum, two accumulators) per query head and takes
//     the rotated sum back with the inverse rotation: no second launch;
//   * the cache's recent positions live in a small window of slots (exact vectors and
//     their codes) that the blocks copy forward (slot s by chunk s mod C) with the new
//     token in its slot, encoded there by two warps with the routine (tq_encode_warp)
//     that also encodes prefill chunks.
// Reading rule: position j < S is a sink (exact); e0 <= j <= p exact (the query's
// window); otherwise codes, from the big buffers below cb, from the window's slot j - r0
// above. meta: [p0, S, cap, cb, r0, C (chunks), e0 (the first query's), N (window slots),
// SS (sink rows), span, W (the window)]; query qi's e0 is max(e0, p - W + 1).
// Outputs by query: out (B, tokens, Hq, D), part and count (query, row, kv head) first.
#include "common.cuh"
// --- body ---
  constexpr int NT = D > 64 ? 256 : D > 32 ? 128 : 64, NW = NT / 32, TILE = NT;
  constexpr int WK = D * KB / 32, WV = D * VB / 32, WC = WK + WV;
  // books: the rotation's signs, the scale, then each codebook's levels and edges.
  const float* sign = books;
  const float *ktab = books + D + 1, *kedge = ktab + (1 << KB), *vtab = kedge + (1 << KB) - 1;
  const float* vedge = vtab + (1 << VB);
  const int p0 = meta[0], S = meta[1], cap = meta[2], cb = meta[3], r0 = meta[4];
  const int C = meta[5], N = meta[7], SS = meta[8], span = meta[9], W = meta[10];
  const int qi = blockIdx.y, NQ = gridDim.y, p = p0 + qi, e0 = max(meta[6], p - W + 1);
  const int rows = gridDim.x / C;  // B * HKV
  const int bk = blockIdx.x / C, c = blockIdx.x % C, b = bk / HKV, hk = bk % HKV;
  const int lo = c * span, hi = min(p + 1, lo + span);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lg = lane >> 2, lt = lane & 3;  // the mma fragments' lane (group, thread in group)
  const size_t kv = (size_t)bk;
  // q, the new key and value come straight from the model (often transposed views):
  // read through their strides, no copy.
  const auto* qb = q + b * q_strides[0] + hk * G * q_strides[1] + qi * q_strides[2];
  const auto* knp = kn + b * kn_strides[0] + hk * kn_strides[1];  // the pass's first token
  const auto* vnp = vn + b * vn_strides[0] + hk * vn_strides[1];
  const long long kns = kn_strides[3], vns = vn_strides[3], knq = kn_strides[2], vnq = vn_strides[2];
  // Coded positions' products on tensor cores where they were measured faster (H200:
  // D = 128, the 7B shape); elsewhere a thread a position (scores) and a lane a
  // coordinate (values) on CUDA cores. mma tiles: KT k-steps of 16 coordinates, HT
  // tiles of 8 heads, MT tiles of 16 value coordinates a warp; a warp scores 32
  // positions of a tile.
  constexpr bool MMA = D == 128;
  constexpr int GP = (G + 3) / 4 * 4, K = NT / D, KT = D / 16, HT = (G + 7) / 8, MT = D / 16 / NW;
  constexpr int RUN = D / 4, SPS = TILE + 8;
  static_assert(K == 1 || (K == 2 && 2 * D <= TILE), "value groups");
  static_assert(!MMA || (G <= 16 && MT >= 1 && TILE == 32 * NW), "mma tiles");
  __shared__ __align__(16) float qp[GP * D], qr[GP * D], sc[GP * TILE];
  __shared__ float tk[1 << KB], tv[1 << VB];
  __shared__ unsigned tk2[MMA ? 1 << (2 * KB) : 1];
  __shared__ unsigned tv2[MMA ? 1 << (2 * VB) : 1];
  __shared__ float fm[G], fl[G], fc[16], sks[MMA ? TILE : 1], svs[TILE];
  __shared__ __align__(16) unsigned int svc[TILE * WV + 1];  // + 1: an mma lane reads two words from its codes' first
  __shared__ __half sp[MMA ? G * SPS : 1];
  __shared__ unsigned char eidx[2 * D];

  // The window (slot s: exact key, exact value; key then value codes; two scales)
  // moves forward: block c of the first query copies the slots s = c (mod C), the
  // pass's tokens into slots p0 - r0 ..; two warps of query qi's last block (the fewest
  // positions) encode token qi.
  const int slot0 = p0 - r0;
  for (int s = c; s < (qi == 0 ? N : 0); s += C) {
    const size_t row = kv * N + s;
    const int ni = s - slot0;  // the pass's token ni, if 0 <= ni < NQ
    const bool fresh = ni >= 0 && ni < NQ;
    for (int t = tid; t < D; t += NT) {
      wx_out[(row * 2) * D + t] = fresh ? knp[ni * knq + t * kns] : wx[(row * 2) * D + t];
      wx_out[(row * 2 + 1) * D + t] = fresh ? vnp[ni * vnq + t * vns] : wx[(row * 2 + 1) * D + t];
    }
    if (fresh) continue;
    for (int t = tid; t < WC; t += NT) wc_out[row * WC + t] = wc[row * WC + t];
    if (tid < 2) wq_out[row * 2 + tid] = wq[row * 2 + tid];
  }
  const size_t at = kv * N + p - r0;
  if (c == C - 1 && warp == 0)
    tq_encode_warp<D, KB, WK>(knp + qi * knq, kns, sign, ktab, kedge, eidx, wc_out + at * WC, wq_out + at * 2);
  if (c == C - 1 && warp == 1)
    tq_encode_warp<D, VB, WV>(vnp + qi * vnq, vns, sign, vtab, vedge, eidx + D, wc_out + at * WC + WK,
                              wq_out + at * 2 + 1);

  // Scaled queries of the group, plain and rotated (unnormalised: coded scores take
  // 1 / D), stored coordinate-major with the heads padded to GP: a coordinate's GP
  // values are GP / 4 float4 loads (the exact positions' scores).
  const float qs = books[D];
  for (int t = tid; t < GP * D; t += NT) {
    const int g = t % GP, i = t / GP;
    const float x = g < G ? static_cast<float>(qb[g * q_strides[1] + i * q_strides[3]]) * qs : 0.0f;
    qp[t] = x;
    qr[t] = x * sign[i];
  }
  for (int t = tid; t < (1 << KB); t += NT) tk[t] = ktab[t];
  for (int t = tid; t < (1 << VB); t += NT) tv[t] = vtab[t];
  if (MMA) {
    // Levels as the fp16 mma operands hold them, two at a time: key entry a | b << KB
    // is (level a, level b), one load for two adjacent codes of a row (one 2 KB-bit
    // field); value entry a | b << VB, one load for a coordinate at two positions.
    for (int t = tid; t < (1 << (2 * KB)); t += NT) tk2[t] = tq_h2(ktab[t & ((1 << KB) - 1)], ktab[t >> KB]);
    for (int t = tid; t < (1 << (2 * VB)); t += NT) tv2[t] = tq_h2(vtab[t & ((1 << VB) - 1)], vtab[t >> VB]);
  }
  if (tid < 16) fc[tid] = 1.0f;
  if (tid < G) { fm[tid] = -INFINITY; fl[tid] = 0.0f; }
  __syncthreads();
  tq_wht<D>(qr, GP, GP, 1);

  // Coded positions on tensor cores (mma m16n8k16: fp16 operands, float32 sums).
  //   scores (16 heads x 8 positions) = Qr (16 x D) . levels of the keys' codes (D x 8);
  //   sums (16 coordinates x 8 heads) += levels of the values' codes . P^T (weights
  //   times the value scales, 0 at exact positions).
  // An mma's k index may stand for any coordinate so long as both operands agree: a
  // lane's key codes are one run of its row (codes RUN * lt + 4s .. + 3 in k-step s).
  unsigned qa[KT][4];
  tq_query_fragments<D, G, GP>(qa, qr, lg, lt);
  float o[MT][HT][4];
  #pragma unroll
  for (int m = 0; m < MT; m++) {
    #pragma unroll
    for (int h = 0; h < HT; h++) o[m][h][0] = o[m][h][1] = o[m][h][2] = o[m][h][3] = 0.0f;
  }

  // Values on CUDA cores (exact ones always, coded ones without MMA): K groups of D
  // lanes (K = 2 below D = 256), group k takes positions k mod K.
  const int i = tid % D, k = tid / D;
  auto from = [&](int j) { return j + ((k - j) & (K - 1)); };
  // Coded position j's key codes: the big buffer's row below cb, else its window slot's.
  auto key_row = [&](int j) { return j < cb ? kc + (kv * cap + j - S) * WK : wc + (kv * N + j - r0) * WC; };
  float ar[GP], ap[GP];
  #pragma unroll
  for (int g = 0; g < GP; g++) { ar[g] = 0.0f; ap[g] = 0.0f; }
  for (int t0 = lo; t0 < hi; t0 += TILE) {
    const int t1 = min(hi, t0 + TILE);
    // The tile's coded values (codes, scales) into shared memory in one coalesced
    // pass: thread i then reads them there, not position after position from memory.
    // MMA: the key scales too (divided by D), and both scales 0 at exact positions.
    const int c0 = max(t0, S), c1 = min(t1, e0);
    // 16 bytes a load where every row starts 16-byte aligned (D = 128: WV, WK, WC
    // multiples of 4 words). Not unrolled: unrolled, the 16-byte loads took ptxas to
    // 143 registers a thread (nvcc 13.0), a block an SM.
    constexpr int VW = WV % 4 == 0 && WK % 4 == 0 ? 4 : 1;
    #pragma unroll 1
    for (int t = tid; t < (c1 - c0) * (WV / VW); t += NT) {
      const int j = c0 + t / (WV / VW), x = VW * (t % (WV / VW));
      const unsigned* r = (j < cb ? vc + (kv * cap + j - S) * WV : wc + (kv * N + j - r0) * WC + WK) + x;
      unsigned* d = svc + (j - t0) * WV + x;
      if (VW == 4) *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(r);
      else *d = *r;
    }
    for (int j = (MMA ? t0 : c0) + tid; j < (MMA ? t1 : c1); j += NT) {
      const bool coded = j >= c0 && j < c1, big = j < cb;
      const size_t r = big ? kv * cap + j - S : (kv * N + j - r0) * 2;
      if (MMA) sks[j - t0] = coded ? __half2float(big ? kq[r] : wq[r]) * (1.0f / D) : 0.0f;
      svs[j - t0] = coded ? __half2float(big ? vq[r] : wq[r + 1]) : 0.0f;
    }
    if (MMA) __syncthreads();
    // Coded scores: warp w the positions t0 + 32w .., 8 at a time (lane: position lg's
    // codes; score columns 2lt, 2lt + 1). Positions outside [c0, c1) read row c0 or
    // c1 - 1 and are not stored.
    #pragma unroll
    for (int u = 0; u < (MMA ? 4 : 0); u++) {
      const int j8 = t0 + 32 * warp + 8 * u;
      if (j8 >= c1 || j8 + 8 <= c0) continue;
      const int jr = min(max(j8 + lg, c0), c1 - 1);
      const unsigned* row = key_row(jr);
      unsigned w[(RUN * KB + 31) / 32];
      tq_span<KB, RUN, WK>(w, row, RUN * lt);
      float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      #pragma unroll
      for (int s = 0; s < KT; s++) {
        const unsigned b0 = tk2[tq_bits<2 * KB>(w, 4 * s * KB)], b1 = tk2[tq_bits<2 * KB>(w, (4 * s + 2) * KB)];
        tq_mma(s & 1 ? s1 : s0, qa[s], b0, b1);  // two chains of dependent mma, not one
      }
      #pragma unroll
      for (int e = 0; e < 2; e++) {
        const int j = j8 + 2 * lt + e;
        if (j < c0 || j >= c1) continue;
        const float f = sks[j - t0];
        if (lg < G) sc[(j - t0) * GP + lg] = (s0[e] + s1[e]) * f;
        if (lg + 8 < G) sc[(j - t0) * GP + lg + 8] = (s0[2 + e] + s1[2 + e]) * f;
      }
    }
    // Scores on CUDA cores, a thread a position: exact ones, and coded ones without MMA.
    for (int j = t0 + tid; j < t1; j += NT) {
      if (MMA && j >= c0 && j < c1) continue;
      float s[GP];
      #pragma unroll
      for (int g = 0; g < GP; g++) s[g] = 0.0f;
      if (j < S || j >= e0) {
        const auto* kr = j >= p0 ? knp + (j - p0) * knq
                                 : (j < S ? sk + (kv * SS + j) * D : wx + ((kv * N + j - r0) * 2) * D);
        const long long ks = j >= p0 ? kns : 1;
        for (int d = 0; d < D; d++) tq_fma4<GP>(s, qp + d * GP, static_cast<float>(kr[d * ks]));
      } else if (!MMA) {
        const unsigned int* row = key_row(j);
        // A group of codes fills whole words (32 / gcd(KB, 32) codes): its words in
        // registers, its codes unrolled; the groups are not (registers).
        constexpr int GC = 32 / tq_gcd32(KB), GW = KB / tq_gcd32(KB);
        for (int gi = 0; gi < D / GC; gi++) {
          unsigned int w[GW];
          #pragma unroll
          for (int x = 0; x < GW; x++) w[x] = row[gi * GW + x];
          #pragma unroll
          for (int u = 0; u < GC; u++) tq_fma4<GP>(s, qr + (gi * GC + u) * GP, tk[tq_code<KB>(w, u)]);
        }
        const float f = __half2float(j < cb ? kq[kv * cap + j - S] : wq[(kv * N + j - r0) * 2]) * (1.0f / D);
        #pragma unroll
        for (int g = 0; g < GP; g++) s[g] *= f;
      }
      #pragma unroll
      for (int g = 0; g < GP; g += 4)
        *reinterpret_cast<float4*>(sc + (j - t0) * GP + g) = make_float4(s[g], s[g + 1], s[g + 2], s[g + 3]);
    }
    __syncthreads();
    const int n16 = (t1 - t0 + 15) & ~15;  // the value products' positions, whole k-steps
    for (int g = warp; g < G; g += NW) {  // online softmax, a warp per head
      float mt = -INFINITY;
      for (int t = lane; t < t1 - t0; t += 32) mt = fmaxf(mt, sc[t * GP + g]);
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffff, mt, o));
      const float mo = fm[g], mn = fmaxf(mo, mt);
      float ls = 0.0f;
      for (int t = lane; t < (MMA ? n16 : t1 - t0); t += 32) {
        const float e = t < t1 - t0 ? expf(sc[t * GP + g] - mn) : 0.0f;
        if (t < t1 - t0) sc[t * GP + g] = e;
        if (MMA) sp[g * SPS + t] = __float2half_rn(e * svs[t < t1 - t0 ? t : 0]);
        ls += e;
      }
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) ls += __shfl_xor_sync(0xffffffff, ls, o);
      __syncwarp();
      if (lane == 0) {
        const float f = expf(mo - mn);
        fc[g] = f;
        fl[g] = fl[g] * f + ls;
        fm[g] = mn;
      }
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; g++) { ar[g] *= fc[g]; ap[g] *= fc[g]; }
    for (int j = from(t0); j < min(t1, S); j += K)
      tq_fma4<GP>(ap, sc + (j - t0) * GP, static_cast<float>(sv[(kv * SS + j) * D + i]));
    for (int j = from(max(t0, max(e0, S))); j < min(t1, p + 1); j += K) {
      const float x = static_cast<float>(j >= p0 ? vnp[(j - p0) * vnq + i * vns]
                                                 : wx[((kv * N + j - r0) * 2 + 1) * D + i]);
      tq_fma4<GP>(ap, sc + (j - t0) * GP, x);
    }
    if (!MMA) {
      for (int j = from(c0); j < c1; j += K)
        tq_fma4<GP>(ar, sc + (j - t0) * GP, tv[tq_code<VB>(svc + (j - t0) * WV, i)] * svs[j - t0]);
    }
    // MMA: the coded sums onto this tile's maximum (columns: heads 8h + 2lt, + 1), then
    // the tile's products.
    #pragma unroll
    for (int m = 0; m < MT; m++) {
      #pragma unroll
      for (int h = 0; h < HT; h++) {
        const float fa = fc[8 * h + 2 * lt], fb = fc[8 * h + 2 * lt + 1];
        o[m][h][0] *= fa;
        o[m][h][1] *= fb;
        o[m][h][2] *= fa;
        o[m][h][3] *= fb;
      }
    }
    if (MMA && c1 > c0) tq_value_products<D, G, VB, WV, SPS, MT, HT>(o, sp, svc, tv2, n16, warp, lg, lt);
    __syncthreads();
  }
  // MMA: coded sums (rotated) into qr, head-major (the queries' buffer is free now).
  // Group 1's sums through the score tile to group 0 (2 * GP * D <= GP * TILE).
  #pragma unroll
  for (int m = 0; m < (MMA ? MT : 0); m++) {
    const int x = 16 * (warp * MT + m) + 2 * lg;
    #pragma unroll
    for (int h = 0; h < HT; h++) {
      #pragma unroll
      for (int e = 0; e < 2; e++) {
        const int g = 8 * h + 2 * lt + e;
        if (g < G) { qr[g * D + x] = o[m][h][e]; qr[g * D + x + 1] = o[m][h][2 + e]; }
      }
    }
  }
  if (K > 1 && k == 1) {
    #pragma unroll
    for (int g = 0; g < G; g++) { sc[g * D + i] = ar[g]; sc[(GP + g) * D + i] = ap[g]; }
  }
  __syncthreads();
  if (tid < D) {
    #pragma unroll
    for (int g = 0; g < G; g++) {
      float* o = part + ((size_t)((qi * rows + bk) * G + g) * C + c) * tq_part_floats(D);
      o[tid] = MMA ? qr[g * D + tid] : (K > 1 ? ar[g] + sc[g * D + tid] : ar[g]);
      o[D + tid] = K > 1 ? ap[g] + sc[(GP + g) * D + tid] : ap[g];
      if (tid == 0) { o[2 * D] = fm[g]; o[2 * D + 1] = fl[g]; }
    }
  }
  // The block that finishes this (row, kv head) last merges its chunks, so the step is
  // one launch. Each block's partial is made visible, then counted in `count`, an input
  // the kernel writes: the last block sets it back to 0, as the next launch must find it.
  {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      unsigned* n = const_cast<unsigned*>(count) + qi * rows + bk;
      last = atomicAdd(n, 1u) == (unsigned)(C - 1);
      if (last) *n = 0u;
    }
    __syncthreads();
    if (last) {
      __threadfence();
      const size_t h0 = (size_t)(qi * rows + bk) * G;  // the group's first query head's partials
      tq_merge_chunks<D, G, NT>(part + h0 * C * tq_part_floats(D), C, sign,
                                out + ((size_t)(b * NQ + qi) * HKV + hk) * G * D, sc, qr, qp, fl);
    }
  }

