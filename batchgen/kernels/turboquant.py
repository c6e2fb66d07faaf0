"""Fused CUDA kernels for attention straight from TurboQuant's packed codes.

The plain-ops path (`turboquant.CodedHistory` with `fused=False`) unpacks every cached
token's codes into an L x d array of codebook values per layer and step, through a
dozen small ops, and then multiplies. On a GPU decode step that chain, not the
bytes, is the cost. These two kernels read the packed uint32 words directly:

    scores:  s[m, j] = scale_j * sum_i q[m, i] * table[code_j(i)]
    values:  o[c, m, i] = sum_{j in chunk c} p[m, j] * table[code_j(i)]

for the M = group x queries rows of one kv head (decode: M = heads per kv head;
a prompt-lookup verify pass: x its 2..K+1 queries). Code i of a row sits at bit
i * BITS of the row's little-endian bit stream (`turboquant.pack_codes`); 3- and
5-bit codes may straddle two words. `values` splits the tokens into chunks of
CHUNK so that a long history still fills the GPU; the chunks' partial sums are
added by one `mx.sum` afterwards.

Shapes: q (B*Hkv, M, D) float32; codes (B*Hkv, capacity, W) uint32, the cache's
whole buffer (rows past n unused, so nothing is copied per step); scales
(B*Hkv, capacity) float16; p (B*Hkv, M, n) float32, already multiplied by the
value scales. Only the first n rows are read (`meta` = [n, capacity]).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import mlx.core as mx

MAX_ROWS = 64  # M above this (long prefill chunks) stays on the ops path
VALUE_CHUNK = 64  # tokens per partial sum in `values`
_SCORE_THREADS = 128

_UNPACK = """
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
"""

_SCORES = """
  __shared__ float sq[M * D];
  __shared__ float stab[1 << BITS];
  const int bh = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  for (int t = threadIdx.x; t < M * D; t += blockDim.x) sq[t] = q[(size_t)bh * M * D + t];
  for (int t = threadIdx.x; t < (1 << BITS); t += blockDim.x) stab[t] = table[t];
  __syncthreads();
  const int n = meta[0], cap = meta[1];
  if (j >= n) return;
  const unsigned int* row = codes + ((size_t)bh * cap + j) * W;
  unsigned int words[W];
  #pragma unroll
  for (int w = 0; w < W; w++) words[w] = row[w];
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  #pragma unroll
  for (int i = 0; i < D; i++) {
    const float v = stab[tq_code<BITS>(words, i)];
    #pragma unroll
    for (int m = 0; m < M; m++) acc[m] += sq[m * D + i] * v;
  }
  const float sc = __half2float(scales[(size_t)bh * cap + j]) * (1.0f / sqrtf((float)D));
  #pragma unroll
  for (int m = 0; m < M; m++) out[((size_t)bh * M + m) * n + j] = acc[m] * sc;
"""

_VALUES = """
  __shared__ float stab[1 << BITS];
  const int bh = blockIdx.y, c = blockIdx.x, i = threadIdx.x;
  for (int t = i; t < (1 << BITS); t += blockDim.x) stab[t] = table[t];
  __syncthreads();
  const int n = meta[0], cap = meta[1];
  const int j0 = c * CHUNK, j1 = min(n, j0 + CHUNK);
  float acc[M];
  #pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  const unsigned int* rows = codes + (size_t)bh * cap * W;
  const float* pb = p + (size_t)bh * M * n;
  for (int j = j0; j < j1; j++) {
    const float v = stab[tq_code<BITS>(rows + (size_t)j * W, i)];
    #pragma unroll
    for (int m = 0; m < M; m++) acc[m] += pb[(size_t)m * n + j] * v;
  }
  float* o = out + (((size_t)bh * gridDim.x + c) * M) * D + i;
  #pragma unroll
  for (int m = 0; m < M; m++) o[(size_t)m * D] = acc[m];
"""


_constants: dict = {}


def constant(key, make):
    """Small input arrays (kernel metadata, scales) made once per value: every layer
    of a step shares one host-to-device copy instead of making its own."""
    if key not in _constants:
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = make()
    return _constants[key]


_last_meta: list = [None, None]  # (fields, array) of the last step


def step_meta(fields: tuple) -> mx.array:
    """`step`'s meta array for `fields`, made on the device where it can be.

    Every layer of a step shares one array. From one step to the next the fields
    usually move by 0 or 1 each (the position, the window's edge): that array is the
    last one plus a small constant, one device op, instead of a new host array whose
    first use by a kernel costs a host-to-device transfer (H200 probe: 0.1-0.5 ms a
    step, 0.5B shape). Any other change makes a host array.
    """
    last_fields, last = _last_meta
    if fields == last_fields:
        return last
    delta = None if last_fields is None else tuple(a - b for a, b in zip(fields, last_fields))
    if delta is not None and len(fields) == len(last_fields) and set(delta) <= {0, 1}:
        meta = last + constant(("delta", delta), lambda: mx.array(delta, dtype=mx.int32))
    else:
        meta = mx.array(fields, dtype=mx.int32)
    _last_meta[:] = [fields, meta]
    return meta


def available() -> bool:
    """CUDA present and the default device a GPU (the kernels have no CPU path)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda and cuda.is_available() and mx.default_device() == mx.gpu)


def supported(rows: int, dim: int, bits: int) -> bool:
    """Shapes the kernels take: the queries (M x D floats) fit in 32 kB of shared
    memory, and a block of D threads can load the 2**bits-entry table."""
    if rows > MAX_ROWS or dim % 32 or not 32 <= dim <= 256 or 1 << bits > dim:
        return False
    return _bucket(rows) * dim <= 8192


@lru_cache(maxsize=None)
def _kernel(name: str, source: str):
    inputs = ["q", "codes", "scales", "table", "meta"] if name == "tq_scores" else ["p", "codes", "table", "meta"]
    return mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=["out"], source=source, header=_UNPACK)


def _bucket(rows: int) -> int:
    """Rows padded to a few sizes, so that the kernels compile a handful of times."""
    for m in (1, 2, 4, 8, 16, 32, 64):
        if rows <= m:
            return m
    raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")


def _pad_rows(x: mx.array, m: int) -> mx.array:
    rows = x.shape[1]
    return x if rows == m else mx.pad(x, [(0, 0), (0, m - rows), (0, 0)])


def scores(q: mx.array, codes: mx.array, scales: mx.array, table: mx.array, bits: int, n: int) -> mx.array:
    """q (BH, M, D) float32 against the first n coded rows: (BH, M, n) float32."""
    bh, rows, dim = q.shape
    m, words = _bucket(rows), codes.shape[-1]
    meta = mx.array([n, codes.shape[1]], dtype=mx.int32)
    out = _kernel("tq_scores", _SCORES)(
        inputs=[_pad_rows(q, m), codes, scales, table, meta],
        template=[("BITS", bits), ("D", dim), ("M", m), ("W", words)],
        grid=(-(-n // _SCORE_THREADS) * _SCORE_THREADS, bh, 1),
        threadgroup=(_SCORE_THREADS, 1, 1),
        output_shapes=[(bh, m, n)],
        output_dtypes=[mx.float32],
    )[0]
    return out[:, :rows] if m != rows else out


def values(p: mx.array, codes: mx.array, table: mx.array, bits: int, dim: int) -> mx.array:
    """Weights p (BH, M, n) float32 over the first n coded rows: (BH, M, dim) float32."""
    bh, rows, n = p.shape
    m, words = _bucket(rows), codes.shape[-1]
    chunks = -(-n // VALUE_CHUNK)
    meta = mx.array([n, codes.shape[1]], dtype=mx.int32)
    partial = _kernel("tq_values", _VALUES)(
        inputs=[_pad_rows(p, m), codes, table, meta],
        template=[("BITS", bits), ("D", dim), ("M", m), ("W", words), ("CHUNK", VALUE_CHUNK)],
        grid=(chunks * dim, bh, 1),
        threadgroup=(dim, 1, 1),
        output_shapes=[(bh, chunks, m, dim)],
        output_dtypes=[mx.float32],
    )[0]
    out = partial.sum(axis=1)
    return out[:, :rows] if m != rows else out


# ---------------------------------------------------------------------------
# One decode step over the whole cache, and the encoder it shares with prefill
#
# The kernels above serve the ops path one piece at a time; a decode step there
# is still dozens of small ops per layer (encode the new token, sinks, window,
# masks, softmax, rotations), which bound it on a GPU at every context length.
# `step` is the step's whole attention in one kernel:
#   * block (row, kv head, chunk c) takes positions [c * span, (c + 1) * span),
#     TILE at a time: scores of the group's G query heads into shared memory
#     (exact positions against the scaled query, coded ones against the rotated
#     query: (R q).(R k) = q.k), an online softmax per head, then thread i adds
#     coordinate i of the probability-weighted values (below D = 256 two threads,
#     each half the positions), coded ones in the rotated domain, exact ones in
#     the plain one;
#   * at D = 128 the coded positions' two products run on tensor cores instead
#     (mma with fp16 codebook levels, rotated queries and weights, float32 sums):
#     a warp scores 32 positions 8 at a time and sums 16 coordinates over the
#     tile; H200, 7B shape at 32k: 41.3 us a launch against 51.7-53.6 on CUDA
#     cores, within 6e-5 of the float32 reference (at D = 64, the 0.5B shape, it
#     was slower: 28 launches at 32k 1.23 ms against 0.84); key levels two at a
#     time (one 2 KB-bit field, one load of an fp16 pair) and value codes staged
#     16 bytes a load: 18% fewer instructions, 39.0 us against 40.9;
#   * the block that finishes a (row, kv head) last (a counter the kernel keeps
#     and resets) combines its chunks' (max, sum, two accumulators) per query head
#     and takes the rotated sum back with the inverse rotation: no second launch
#     (28 steps, H200: 7B at 8k 1.54 ms against 1.78 with a merge kernel, 32k
#     2.00 against 2.25; 0.5B at 32k 1.49 against 1.68);
#   * the cache's recent positions live in a small window of slots (exact
#     vectors and their codes) that the blocks copy forward (slot s by chunk
#     s mod C) with the new token in its slot, encoded there by two warps with
#     the routine (`tq_encode_warp`) that also encodes prefill chunks, so a
#     token's codes never depend on the path.
# Reading rule (as `turboquant._rotated_attention`): position j < S is a sink
# (exact); e0 <= j <= p exact (the query's window); otherwise codes, from the
# big buffers below cb, from the window's slot j - r0 above.

_STEP_HEADER = _UNPACK + """
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
"""

_ENCODE = """
  __shared__ unsigned char idx[D];
  const size_t r = blockIdx.x;  // one warp a vector
  tq_encode_warp<D, BITS, W>(x + r * D, 1, sign, tab, edge, idx, codes + r * W, scales + r);
"""

_STEP = """
  constexpr int NT = D > 64 ? 256 : 128, NW = NT / 32, TILE = NT;
  constexpr int WK = D * KB / 32, WV = D * VB / 32, WC = WK + WV;
  // books: the rotation's signs, the scale, then each codebook's levels and edges.
  const float* sign = books;
  const float *ktab = books + D + 1, *kedge = ktab + (1 << KB), *vtab = kedge + (1 << KB) - 1;
  const float* vedge = vtab + (1 << VB);
  const int p = meta[0], S = meta[1], cap = meta[2], cb = meta[3], r0 = meta[4];
  const int C = meta[5], e0 = meta[6], N = meta[7], SS = meta[8], span = meta[9];
  const int bk = blockIdx.x / C, c = blockIdx.x % C, b = bk / HKV, hk = bk % HKV;
  const int lo = c * span, hi = min(p + 1, lo + span);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lg = lane >> 2, lt = lane & 3;  // the mma fragments' lane (group, thread in group)
  const size_t kv = (size_t)bk;
  // q, the new key and value come straight from the model (often transposed views):
  // read through their strides, no copy.
  const auto* qb = q + b * q_strides[0] + hk * G * q_strides[1];
  const auto* knp = kn + b * kn_strides[0] + hk * kn_strides[1];
  const auto* vnp = vn + b * vn_strides[0] + hk * vn_strides[1];
  const long long kns = kn_strides[3], vns = vn_strides[3];
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
  // moves forward: block c copies the slots s = c (mod C), the new token into slot
  // p - r0; two warps of the last block (the fewest positions) encode it.
  const int slot = p - r0;
  for (int s = c; s < N; s += C) {
    const size_t row = kv * N + s;
    for (int t = tid; t < D; t += NT) {
      wx_out[(row * 2) * D + t] = s == slot ? knp[t * kns] : wx[(row * 2) * D + t];
      wx_out[(row * 2 + 1) * D + t] = s == slot ? vnp[t * vns] : wx[(row * 2 + 1) * D + t];
    }
    if (s == slot) continue;
    for (int t = tid; t < WC; t += NT) wc_out[row * WC + t] = wc[row * WC + t];
    if (tid < 2) wq_out[row * 2 + tid] = wq[row * 2 + tid];
  }
  const size_t at = kv * N + slot;
  if (c == C - 1 && warp == 0)
    tq_encode_warp<D, KB, WK>(knp, kns, sign, ktab, kedge, eidx, wc_out + at * WC, wq_out + at * 2);
  if (c == C - 1 && warp == 1)
    tq_encode_warp<D, VB, WV>(vnp, vns, sign, vtab, vedge, eidx + D, wc_out + at * WC + WK, wq_out + at * 2 + 1);

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
        const auto* kr = j == p ? knp : (j < S ? sk + (kv * SS + j) * D : wx + ((kv * N + j - r0) * 2) * D);
        const long long ks = j == p ? kns : 1;
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
      const float x = static_cast<float>(j == p ? vnp[i * vns] : wx[((kv * N + j - r0) * 2 + 1) * D + i]);
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
      float* o = part + ((size_t)(b * HKV * G + hk * G + g) * C + c) * tq_part_floats(D);
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
      unsigned* n = const_cast<unsigned*>(count) + bk;
      last = atomicAdd(n, 1u) == (unsigned)(C - 1);
      if (last) *n = 0u;
    }
    __syncthreads();
    if (last) {
      __threadfence();
      const size_t h0 = (size_t)b * HKV * G + hk * G;  // the group's first query head
      tq_merge_chunks<D, G, NT>(part + h0 * C * tq_part_floats(D), C, sign, out + h0 * D, sc, qr, qp, fl);
    }
  }
"""

STEP_BLOCKS = 512  # blocks aimed at per step and layer (of 128 or 256 threads, 56-96 registers a thread)


def encode_supported(dim: int) -> bool:
    """Head dims `encode` (and the step's encoder) take: powers of two 64..256, the
    rotation a Hadamard transform across a warp's lanes. Any codebook (1-5 bits)."""
    return dim in (64, 128, 256)


def step_supported(dim: int, group: int, key_bits: int, value_bits: int) -> bool:
    """Shapes `step` takes: `encode_supported` dims, the group's queries in shared
    memory (G x D floats, twice, the heads padded to a multiple of 4: still at most
    1024 floats for D >= 64) and a tile of value codes."""
    return encode_supported(dim) and 1 <= group and group * dim <= 1024 and key_bits <= 5 and value_bits <= 4


def _threads(dim: int) -> int:
    """The step kernel's threads a block (NT), also the positions it scores a tile
    (TILE): 8 warps from D = 128 (H200, 7B shape at 32k: 53.6 us a launch against
    62.3-63.5 with 4 warps and 128-position tiles, which D = 64 keeps)."""
    return 256 if dim > 64 else 128


# name -> (input names, output names, body) of the step mode kernels.
STEP_KERNELS = {
    "tq_encode": (["x", "sign", "tab", "edge"], ["codes", "scales"], _ENCODE),
    "tq_step": (["q", "kn", "vn", "sk", "sv", "kc", "kq", "vc", "vq", "wx", "wc", "wq", "books", "meta", "count"],
                ["out", "part", "wx_out", "wc_out", "wq_out"], _STEP),
}  # fmt: skip


@lru_cache(maxsize=None)
def _step_kernel(name: str, body: Optional[str] = None):
    """One of STEP_KERNELS (`body` replaces its source: benchmarks time variants)."""
    inputs, outputs, source = STEP_KERNELS[name]
    # tq_step reads q and the new token through their strides; everything else it
    # takes is contiguous by construction (TurboQuantKVCache._enter_step).
    return mx.fast.cuda_kernel(name=name if body is None else f"{name}_{abs(hash(body))}", input_names=inputs,
                               output_names=outputs, source=body or source, header=_STEP_HEADER,
                               ensure_row_contiguous=name != "tq_step")  # fmt: skip


def encode(x: mx.array, sign: mx.array, table: mx.array, edges: mx.array, bits: int):
    """turboquant.quantize on the GPU: x (..., D) -> codes (..., W) uint32, scales (...) float16."""
    dim = x.shape[-1]
    words = -(-dim * bits // 32)
    rows = x.size // dim
    codes, scales = _step_kernel("tq_encode")(
        inputs=[x, sign, table, edges],
        template=[("D", dim), ("BITS", bits), ("W", words)],
        grid=(rows * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(*x.shape[:-1], words), x.shape[:-1]],
        output_dtypes=[mx.uint32, mx.float16],
    )
    return codes, scales


def step_chunks(positions: int, rows: int, dim: int) -> tuple:
    """(chunks, span): positions split into chunks of whole tiles (`_threads(dim)`
    positions), about STEP_BLOCKS blocks over `rows` (batch x kv heads), and at most
    a tile's worth of chunks a row (the merge: a lane a chunk per warp pass, NT / 32
    passes; a weight a head and chunk in the score tile)."""
    tile = _threads(dim)
    tiles = -(-positions // tile)
    per = max(1, -(-tiles * rows // STEP_BLOCKS), -(-tiles // tile))
    span = per * tile
    return -(-positions // span), span


def step_books(signs, key_levels, key_edges, value_levels, value_edges, scale: float) -> mx.array:
    """`step`'s constants as one float32 array (one kernel input, not seven): the
    rotation's signs (D), the attention scale, the key codebook's levels and edges,
    the value codebook's."""
    parts = [signs, mx.array([scale], mx.float32), key_levels, key_edges, value_levels, value_edges]
    return mx.concatenate([x.astype(mx.float32).reshape(-1) for x in parts])


@lru_cache(maxsize=256)
def _step_launch(B: int, n_heads: int, dim: int, kv_heads: int, bits: tuple, slots: int, chunks: int,
                 dtype) -> dict:  # fmt: skip
    """The step kernel's keyword arguments besides inputs (made once per shape). A
    decode step of a small model is bound by host work per launch, which grows with
    the launch's arguments: hence few inputs, outputs and template constants."""
    (kb, vb), threads = bits, _threads(dim)
    words = dim * (kb + vb) // 32
    # Outputs: out, part (the kernel's tq_part_floats(D) = 2D + 4 floats a head and
    # chunk), then the window's next arrays.
    step = dict(
        template=[("D", dim), ("G", n_heads // kv_heads), ("HKV", kv_heads), ("KB", kb), ("VB", vb)],
        grid=(B * kv_heads * chunks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, n_heads, 1, dim), (B * n_heads, chunks, 2 * dim + 4), (B, kv_heads, slots, 2, dim),
                       (B, kv_heads, slots, words), (B, kv_heads, slots, 2)],
        output_dtypes=[dtype, mx.float32, dtype, mx.uint32, mx.float16],
    )  # fmt: skip
    return step


def step_counters(rows: int) -> mx.array:
    """The step kernel's finished-block counters, one a (row, kv head), shared by every
    launch: zero at a launch's start, as the last block of each row sets it back.

    Launches on one stream run one after another, so one set serves them all. A real
    buffer of at least 64 bytes: mx.zeros may be a broadcast scalar (the kernel
    would overrun it), and MLX keeps arrays of at most 8 bytes in managed memory, where
    each GPU atomic cost ~2 us (H200: with 2 kv heads the step took 4.5x as long)."""
    return constant(("count", rows), lambda: mx.array([0] * max(16, rows), dtype=mx.uint32))


def step(q, new, sinks, coded, window, books, meta, chunks: int, bits: tuple):
    """One decode step's attention (see above). q (B, Hq, 1, D); new = (k, v)
    (B, Hkv, 1, D); sinks = (k, v) (B, Hkv, SS, D); coded = (kc, kq, vc, vq) the
    big buffers; window = (wx (B, Hkv, N, 2, D) exact keys and values, wc (B, Hkv,
    N, WK + WV) key then value codes, wq (B, Hkv, N, 2) their scales); books from
    `step_books`; meta int32 [p, S, cap, cb, r0, chunks, e0, N, SS, span]. Returns
    (out (B, Hq, 1, D) in q's dtype, the window's next arrays)."""
    B, n_heads, _, dim = q.shape
    kv_heads = new[0].shape[1]
    launch = _step_launch(B, n_heads, dim, kv_heads, bits, window[0].shape[2], chunks, q.dtype)
    count = step_counters(B * kv_heads)
    outs = _step_kernel("tq_step")(inputs=[q, *new, *sinks, *coded, *window, books, meta, count], **launch)
    return outs[0], tuple(outs[2:])
