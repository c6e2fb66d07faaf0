// Device helpers shared by batchgen's CUDA kernels (one header for all of them).
//
// Each kernel op is a `.cu` file beside this one: helpers it alone needs, then a line
// `// --- body ---` and the kernel's body, which MLX's `mx.fast.cuda_kernel` wraps in a
// signature built from the op's input and output names (batchgen/kernels/registry.py).
// `#include "x.cuh"` lines are expanded by that loader (each file once per kernel);
// fragments included after the body line are pieces of a body, not headers.

// ---------------------------------------------------------------------------------------
// Loads

// Eight consecutive values as float: one 16-byte load for 16-bit types where the address
// allows it (every row starts at a multiple of D >= 32 elements), else eight plain loads.
template <typename T>
__device__ __forceinline__ void ld8(const T* p, float* x) {
  #pragma unroll
  for (int i = 0; i < 8; i++) x[i] = static_cast<float>(p[i]);
}
template <typename H2, typename T>
__device__ __forceinline__ void ld8_pairs(const T* p, float* x) {
  if ((reinterpret_cast<size_t>(p) & 15) != 0) {
    #pragma unroll
    for (int i = 0; i < 8; i++) x[i] = static_cast<float>(p[i]);
    return;
  }
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const unsigned int u[4] = {w.x, w.y, w.z, w.w};
  #pragma unroll
  for (int i = 0; i < 4; i++) {
    const H2 h = *reinterpret_cast<const H2*>(&u[i]);
    x[2 * i] = static_cast<float>(h.x);
    x[2 * i + 1] = static_cast<float>(h.y);
  }
}
template <>
__device__ __forceinline__ void ld8<__nv_bfloat16>(const __nv_bfloat16* p, float* x) { ld8_pairs<__nv_bfloat162>(p, x); }
template <>
__device__ __forceinline__ void ld8<__half>(const __half* p, float* x) { ld8_pairs<__half2>(p, x); }

// 16 bytes global -> shared without a register stop (cp.async, sm_80 on), waited on by
// group; a source not 16-byte aligned is copied by plain loads instead.
__device__ __forceinline__ void cp_async16(void* dst, const unsigned char* src) {
  if ((reinterpret_cast<size_t>(src) & 15) != 0) {
    #pragma unroll
    for (int i = 0; i < 16; i++) static_cast<unsigned char*>(dst)[i] = src[i];
    return;
  }
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The batch attention kernels' lane groups (lanes.cuh): each of a warp's CPW columns is
// read by LPC lanes, UNROLL rounds of columns at a time. Sums each column's score over its
// lanes (s, in place) and returns the running maximum m taken over the columns in range
// (first, the group's first column this round: first + u * CPW < stop).
template <int UNROLL, int LPC, int CPW>
__device__ __forceinline__ float lane_sums(float* s, float m, int first, int stop) {
  #pragma unroll
  for (int u = 0; u < UNROLL; u++) {
    #pragma unroll
    for (int o = LPC / 2; o > 0; o >>= 1) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
    if (first + u * CPW < stop) m = fmaxf(m, s[u]);
  }
  return m;
}

// ---------------------------------------------------------------------------------------
// TurboQuant's packed codes (turboquant/codec.py: pack_codes)

// WIDTH bits of a little-endian bit stream from bit pos; code i of BITS-bit codes.
template <int WIDTH>
__device__ __forceinline__ unsigned int tq_bits(const unsigned int* row, int pos) {
  const int w = pos >> 5, s = pos & 31;
  unsigned int c = row[w] >> s;
  if (s + WIDTH > 32) c |= row[w + 1] << (32 - s);
  return c & ((1u << WIDTH) - 1u);
}
template <int BITS>
__device__ __forceinline__ unsigned int tq_code(const unsigned int* row, int i) {
  return tq_bits<BITS>(row, i * BITS);
}

template <int N>
__device__ __forceinline__ void tq_fwht(float* h) {  // h = H h (Sylvester order, unnormalized); every thread calls it
  for (int len = 1; len < N; len <<= 1) {
    __syncthreads();
    for (int t = threadIdx.x; t < N / 2; t += blockDim.x) {
      const int i = (t / len) * 2 * len + (t % len);
      const float a = h[i], c = h[i + len];
      h[i] = a + c;
      h[i + len] = a - c;
    }
  }
  __syncthreads();
}
template <int BITS>
__device__ __forceinline__ unsigned long long tq_bits8(const unsigned int* row, int sub) {
  // coordinates 8 sub .. 8 sub + 7 of a packed row, the first in the lowest BITS bits (8 BITS <= 40 bits
  // from a bit offset that is a multiple of 8: within two words)
  const int pos = sub * 8 * BITS, w = pos >> 5, s = pos & 31;
  unsigned long long x = row[w];
  if (s + 8 * BITS > 32) x |= static_cast<unsigned long long>(row[w + 1]) << 32;
  return x >> s;
}

__host__ __device__ constexpr int tq_gcd32(int b) {
  int g = 1;
  while (g < 32 && b % (2 * g) == 0) g *= 2;
  return g;
}

// Two floats as the fp16 pair an mma operand register holds (the first in the low half).
__device__ __forceinline__ unsigned tq_h2(float lo, float hi) {
  return (unsigned)__half_as_ushort(__float2half_rn(lo)) | ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}

// c += a . b for one warp: a 16 x 16, b 16 x 8 fp16, c 16 x 8 float32 (PTX's fragment
// layouts: lane (g, t) = (lane / 4, lane % 4) holds a's rows g, g + 8 at columns 2t, 2t + 1,
// 2t + 8, 2t + 9; b's rows 2t, 2t + 1, 2t + 8, 2t + 9 of column g; c's rows g, g + 8 at
// columns 2t, 2t + 1).
__device__ __forceinline__ void tq_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Codes first .. first + COUNT - 1 of a packed row of ROWW words, shifted so that
// code first + u is tq_code<BITS>(v, u). The run starts on a word when first * BITS
// is a multiple of 32; else one more word is read where the row has it.
template <int BITS, int COUNT, int ROWW>
__device__ __forceinline__ void tq_span(unsigned* v, const unsigned* row, int first) {
  constexpr int NV = (COUNT * BITS + 31) / 32;
  constexpr bool ALIGNED = COUNT * BITS % 32 == 0;
  const int bit = first * BITS, w0 = bit >> 5, off = bit & 31;
  unsigned w[NV + 1];
  #pragma unroll
  for (int x = 0; x < NV; x++) w[x] = row[w0 + x];
  w[NV] = !ALIGNED && w0 + NV < ROWW ? row[w0 + NV] : 0u;
  #pragma unroll
  for (int x = 0; x < NV; x++) v[x] = ALIGNED ? w[x] : __funnelshift_r(w[x], w[x + 1], off);
}

// The rotated queries (qr: coordinate-major, heads padded to GP) as mma A fragments, a
// k-step s of 16 coordinates each: lane (g, t) holds heads g, g + 8 (0 past G) at the
// coordinates of its key codes, D / 4 * t + 4s .. + 3 (see tq_step's scores).
template <int D, int G, int GP>
__device__ __forceinline__ void tq_query_fragments(unsigned (*qa)[4], const float* qr, int g, int t) {
  auto qh = [&](int x, int h) { return h < G ? qr[x * GP + h] : 0.0f; };
  #pragma unroll
  for (int s = 0; s < D / 16; s++) {
    const int x = D / 4 * t + 4 * s;
    qa[s][0] = tq_h2(qh(x, g), qh(x + 1, g));
    qa[s][1] = tq_h2(qh(x, g + 8), qh(x + 1, g + 8));
    qa[s][2] = tq_h2(qh(x + 2, g), qh(x + 3, g));
    qa[s][3] = tq_h2(qh(x + 2, g + 8), qh(x + 3, g + 8));
  }
}

// One warp's coded sums over a tile's first n16 positions: o[m][h] (16 coordinates x 8
// heads) += value levels (16 coordinates x 16 positions) . weights (16 positions x 8
// heads), a k-step of 16 positions at a time. Warp w's coordinates x = 16 (w MT + m) + 2g
// (row g) and x + 1 (row g + 8), at positions 2t, 2t + 1, 2t + 8, 2t + 9 of each k-step.
// sp: the weights, fp16, head-major (row stride SPS); svc: the tile's value codes, WV
// words a position, one word past the last; tv2: pairs of levels (a | b << VB: a, b).
template <int D, int G, int VB, int WV, int SPS, int MT, int HT>
__device__ __forceinline__ void tq_value_products(float (*o)[HT][4], const __half* sp, const unsigned* svc,
                                                  const unsigned* tv2, int n16, int warp, int g, int t) {
  constexpr unsigned VM = (1u << VB) - 1u;
  const unsigned* rows = svc + 2 * t * WV;
  for (int ks = 0; ks < n16; ks += 16, rows += 16 * WV) {
    unsigned pb[HT][2];
    #pragma unroll
    for (int h = 0; h < HT; h++) {
      const int head = g + 8 * h;
      const __half* w = sp + head * SPS + ks + 2 * t;
      pb[h][0] = head < G ? *reinterpret_cast<const unsigned*>(w) : 0u;
      pb[h][1] = head < G ? *reinterpret_cast<const unsigned*>(w + 8) : 0u;
    }
    #pragma unroll
    for (int m = 0; m < MT; m++) {
      // Codes of x and x + 1 at each position: 2 VB bits from bit x VB of its row.
      const int bit = (16 * (warp * MT + m) + 2 * g) * VB, vw = bit >> 5, vs = bit & 31;
      unsigned v[4];
      #pragma unroll
      for (int e = 0; e < 4; e++) {
        const unsigned* r = rows + ((e & 1) + 8 * (e >> 1)) * WV + vw;
        v[e] = __funnelshift_r(r[0], r[1], vs);
      }
      // a: (x; positions 2t, 2t + 1), (x + 1; same), (x; + 8, + 9), (x + 1; + 8, + 9)
      const unsigned a[4] = {tv2[(v[0] & VM) | (v[1] & VM) << VB], tv2[(v[0] >> VB & VM) | (v[1] & VM << VB)],
                             tv2[(v[2] & VM) | (v[3] & VM) << VB], tv2[(v[2] >> VB & VM) | (v[3] & VM << VB)]};
      #pragma unroll
      for (int h = 0; h < HT; h++) tq_mma(o[m][h], a, pb[h][0], pb[h][1]);
    }
  }
}

__device__ __forceinline__ void tq_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void tq_store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void tq_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Unnormalised Walsh-Hadamard transform (natural order, as mx.hadamard_transform
// times sqrt(D)) of `count` arrays of D floats in shared memory, by the block.
// Element i of array a is x[a * astride + i * estride].
template <int D>
__device__ __forceinline__ void tq_wht(float* x, int count, int estride = 1, int astride = D) {
  for (int h = 1; h < D; h <<= 1) {
    for (int t = threadIdx.x; t < count * (D / 2); t += blockDim.x) {
      const int a = t / (D / 2), r = t % (D / 2);
      float* y = x + a * astride;
      const int i = (r / h) * 2 * h + (r % h);
      const float u = y[i * estride], v = y[(i + h) * estride];
      y[i * estride] = u + v;
      y[(i + h) * estride] = u - v;
    }
    __syncthreads();
  }
}

// A chunk's partial for one query head: D coded sums (rotated), D exact sums, maximum,
// sum, and 2 floats of padding, so that rows start 16-byte aligned.
__host__ __device__ constexpr int tq_part_floats(int d) { return 2 * d + 4; }

// The step's merge, by the block that finishes a (row, kv head) last: the C <= NT
// chunks' partials (pb: G heads x C chunks x E = tq_part_floats(D)), written by other blocks and so
// read from L2 (__ldcg), into the G heads' outputs. A warp a head takes every chunk's
// (maximum, sum) in one pass, then the chunks' weights exp(m_c - M) (w: G x C) and the
// total; every thread then sums a float4 column of a head's coded or exact sums over the
// chunks (many loads in flight, not a chain); the coded sums go back through the inverse
// rotation (H, then the signs and 1 / D). ys, as: G x D; ls: G.
template <int D, int G, int NT, typename T>
__device__ __forceinline__ void tq_merge_chunks(const float* pb, int C, const float* sign, T* out, float* w,
                                                float* ys, float* as, float* ls) {
  constexpr int E = tq_part_floats(D), NW = NT / 32, Q = D / 4;
  const int tid = threadIdx.x, lane = tid & 31;
  for (int g = tid >> 5; g < G; g += NW) {
    const float* ph = pb + (size_t)g * C * E + 2 * D;
    float2 ml[NT / 32];
    float m = -INFINITY;
    #pragma unroll
    for (int k = 0; k < NT / 32; k++) {
      const int c = lane + 32 * k;
      ml[k] = c < C ? __ldcg(reinterpret_cast<const float2*>(ph + (size_t)c * E)) : make_float2(-INFINITY, 0.0f);
      m = fmaxf(m, ml[k].x);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    float l = 0.0f;
    #pragma unroll
    for (int k = 0; k < NT / 32; k++) {
      const int c = lane + 32 * k;
      if (c < C) {
        const float f = expf(ml[k].x - m);
        w[g * C + c] = f;
        l += ml[k].y * f;
      }
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffff, l, o);
    if (lane == 0) ls[g] = l;
  }
  __syncthreads();
  // Column x of head g: x < Q the coded sums' coordinates 4x .. 4x + 3, else the exact
  // sums' 4(x - Q) ..: either way floats 4x .. 4x + 3 of the chunk's row.
  for (int t = tid; t < 2 * G * Q; t += NT) {
    const int g = t / (2 * Q), x = t % (2 * Q);
    const float* ph = pb + (size_t)g * C * E + 4 * x;
    const float* wg = w + g * C;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    #pragma unroll 8
    for (int c = 0; c < C; c++) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(ph + (size_t)c * E));
      const float f = wg[c];
      a.x += v.x * f;
      a.y += v.y * f;
      a.z += v.z * f;
      a.w += v.w * f;
    }
    *reinterpret_cast<float4*>(x < Q ? ys + g * D + 4 * x : as + g * D + 4 * (x - Q)) = a;
  }
  __syncthreads();
  tq_wht<D>(ys, G);
  for (int t = tid; t < G * D; t += NT) tq_store(out + t, (as[t] + ys[t] * sign[t % D] * (1.0f / D)) / ls[t / D]);
}

// acc[g] += w[g] * x for the GP (a multiple of 4) values at w, 16-byte aligned
// shared memory: float4 loads.
template <int GP>
__device__ __forceinline__ void tq_fma4(float* acc, const float* w, float x) {
  #pragma unroll
  for (int g = 0; g < GP; g += 4) {
    const float4 y = *reinterpret_cast<const float4*>(w + g);
    acc[g] += y.x * x;
    acc[g + 1] += y.y * x;
    acc[g + 2] += y.z * x;
    acc[g + 3] += y.w * x;
  }
}

// turboquant.quantize for one vector of D values, by one warp (no block-wide
// barrier, so that any warp of any block can take it): codes of sqrt(D) R x / |x|
// (R x = H(s * x) / sqrt(D); lane l holds coordinates l * D/32 ..) against the
// codebook's edges, packed as pack_codes packs them, and the scale
// |x| sqrt(D) / |levels|. `idx`: D bytes of shared memory for this warp.
template <int D, int BITS, int W, typename T>
__device__ void tq_encode_warp(const T* x, long long stride, const float* sign, const float* tab, const float* edge,
                               unsigned char* idx, unsigned int* codes, __half* scale) {
  constexpr int PER = D / 32;
  const int lane = threadIdx.x & 31;
  float y[PER];
  float part = 0.0f;
  #pragma unroll
  for (int e = 0; e < PER; e++) {
    y[e] = static_cast<float>(x[(lane * PER + e) * stride]);
    part += y[e] * y[e];
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffff, part, o);
  const float norm = sqrtf(part);
  const float inv = 1.0f / fmaxf(norm, 1e-30f);
  #pragma unroll
  for (int e = 0; e < PER; e++) y[e] = y[e] * inv * sign[lane * PER + e];
  // Walsh-Hadamard butterflies: index bits below PER inside a lane, the rest across
  // lanes (partner lane ^ m holds the same e; the one with the bit set takes a - b).
  #pragma unroll
  for (int h = 1; h < PER; h <<= 1) {
    #pragma unroll
    for (int e = 0; e < PER; e++) {
      if (!(e & h)) {
        const float a = y[e], b = y[e + h];
        y[e] = a + b;
        y[e + h] = a - b;
      }
    }
  }
  #pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    #pragma unroll
    for (int e = 0; e < PER; e++) {
      const float other = __shfl_xor_sync(0xffffffff, y[e], m);
      y[e] = (lane & m) ? other - y[e] : y[e] + other;
    }
  }
  float c2 = 0.0f;
  #pragma unroll
  for (int e = 0; e < PER; e++) {
    int k = 0;
    #pragma unroll
    for (int t = 0; t < (1 << BITS) - 1; t++) k += y[e] > edge[t];
    idx[lane * PER + e] = (unsigned char)k;
    c2 += tab[k] * tab[k];
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) c2 += __shfl_xor_sync(0xffffffff, c2, o);
  __syncwarp();
  for (int w = lane; w < W; w += 32) {
    unsigned int word = 0u;
    const int first = (32 * w) / BITS, last = min(D - 1, (32 * w + 31) / BITS);
    for (int i = first; i <= last; i++) {
      const int sh = i * BITS - 32 * w;
      word |= sh >= 0 ? ((unsigned int)idx[i] << sh) : ((unsigned int)idx[i] >> (-sh));
    }
    codes[w] = word;
  }
  if (lane == 0) *scale = __float2half_rn(fminf(norm * sqrtf((float)D) / fmaxf(sqrtf(c2), 1e-30f), 65504.0f));
  __syncwarp();
}

// ---------------------------------------------------------------------------------------
// Tensor cores

// c (16 x 8, float32) += a (16 x 16) . b (16 x 8) in bf16, one warp: m16n8k16's fragments.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

