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
# `step` is the step's whole attention in one kernel plus a small merge:
#   * block (row, kv head, chunk c) takes positions [c * span, (c + 1) * span),
#     TILE at a time: scores of the group's G query heads into shared memory
#     (exact positions against the scaled query, coded ones against the rotated
#     query: (R q).(R k) = q.k), an online softmax per head, then thread i adds
#     coordinate i of the probability-weighted values (below D = 256 two threads,
#     each half the positions), coded ones in the rotated domain, exact ones in
#     the plain one;
#   * at D = 128 (`tq_step_mma`) the coded positions run on tensor cores instead
#     (mma with fp16 codebook levels, rotated queries and weights, float32 sums),
#     each warp its own 16 positions at a time with its own online softmax, the
#     weights never leaving registers; the exact positions join at the end;
#   * `merge` combines the chunks' (max, sum, two accumulators) per query head
#     and takes the rotated sum back with the inverse rotation;
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

_STEP_OPEN = """
  constexpr int NT = D > 64 ? 256 : 128, NW = NT / 32;
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
  const size_t kv = (size_t)bk;
  // q, the new key and value come straight from the model (often transposed views):
  // read through their strides, no copy.
  const auto* qb = q + b * q_strides[0] + hk * G * q_strides[1];
  const auto* knp = kn + b * kn_strides[0] + hk * kn_strides[1];
  const auto* vnp = vn + b * vn_strides[0] + hk * vn_strides[1];
  const long long kns = kn_strides[3], vns = vn_strides[3];
  constexpr int GP = (G + 3) / 4 * 4;
  __shared__ __align__(16) float qp[GP * D], qr[GP * D];
  __shared__ float fm[G], fl[G], fc[G];
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
  // values are GP / 4 float4 loads (one shared-memory load per head was the cost).
  const float qs = books[D];
  for (int t = tid; t < GP * D; t += NT) {
    const int g = t % GP, i = t / GP;
    const float x = g < G ? static_cast<float>(qb[g * q_strides[1] + i * q_strides[3]]) * qs : 0.0f;
    qp[t] = x;
    qr[t] = x * sign[i];
  }
  if (tid < G) { fm[tid] = -INFINITY; fl[tid] = 0.0f; }
  __syncthreads();
  tq_wht<D>(qr, GP, GP, 1);
  // Exact position j's key and value rows: the new token's (strided), a sink's, a window slot's.
  auto exact_key = [&](int j) { return j == p ? knp : (j < S ? sk + (kv * SS + j) * D : wx + ((kv * N + j - r0) * 2) * D); };
  auto exact_value = [&](int j, int i) {
    return static_cast<float>(j == p ? vnp[i * vns] : (j < S ? sv[(kv * SS + j) * D + i] : wx[((kv * N + j - r0) * 2 + 1) * D + i]));
  };
  // Coded position j's rows of codes and their scales: the big buffers' below cb, else its window slot's.
  auto key_row = [&](int j) { return j < cb ? kc + (kv * cap + j - S) * WK : wc + (kv * N + j - r0) * WC; };
  auto value_row = [&](int j) { return j < cb ? vc + (kv * cap + j - S) * WV : wc + (kv * N + j - r0) * WC + WK; };
  auto key_scale = [&](int j) { return __half2float(j < cb ? kq[kv * cap + j - S] : wq[(kv * N + j - r0) * 2]); };
  auto value_scale = [&](int j) { return __half2float(j < cb ? vq[kv * cap + j - S] : wq[(kv * N + j - r0) * 2 + 1]); };
"""

# Online softmax of a tile's scores (sc: n positions x GP heads) into the block's running
# maxima fm, sums fl and last factors fc, a warp a head; the scores become their weights.
_STEP_SOFTMAX = """
    for (int g = warp; g < G; g += NW) {
      float mt = -INFINITY;
      for (int t = lane; t < n; t += 32) mt = fmaxf(mt, sc[t * GP + g]);
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffff, mt, o));
      const float mo = fm[g], mn = fmaxf(mo, mt);
      float lt = 0.0f;
      for (int t = lane; t < n; t += 32) {
        const float e = expf(sc[t * GP + g] - mn);
        sc[t * GP + g] = e;
        lt += e;
      }
      #pragma unroll
      for (int o = 16; o > 0; o >>= 1) lt += __shfl_xor_sync(0xffffffff, lt, o);
      __syncwarp();
      if (lane == 0) {
        const float f = expf(mo - mn);
        fc[g] = f;
        fl[g] = fl[g] * f + lt;
        fm[g] = mn;
      }
    }
"""

# Scores of exact position j (a thread a position) into its row of sc.
_STEP_EXACT_SCORES = """
      {
        const auto* kr = exact_key(j);
        const long long ks = j == p ? kns : 1;
        float s[GP];
        #pragma unroll
        for (int g = 0; g < GP; g++) s[g] = 0.0f;
        for (int d = 0; d < D; d++) tq_fma4<GP>(s, qp + d * GP, static_cast<float>(kr[d * ks]));
        #pragma unroll
        for (int g = 0; g < GP; g += 4) *reinterpret_cast<float4*>(srow + g) = make_float4(s[g], s[g + 1], s[g + 2], s[g + 3]);
      }
"""

# The block's partial (coded sums, rotated; exact sums; maximum; sum) a head of the group.
_STEP_CLOSE = """
  if (tid < D) {
    #pragma unroll
    for (int g = 0; g < G; g++) {
      float* o = part + ((size_t)(b * HKV * G + hk * G + g) * C + c) * (2 * D + 2);
      o[tid] = CODED_SUM;
      o[D + tid] = ap[g];
      if (tid == 0) { o[2 * D] = fm[g]; o[2 * D + 1] = fl[g]; }
    }
  }
"""

# CUDA cores (D = 64, 256): tiles of NT positions in shared memory, a thread a position's
# scores, then K groups of D lanes a coordinate's sums.
_STEP = _STEP_OPEN + """
  constexpr int TILE = NT, K = NT / D;
  static_assert(K == 1 || (K == 2 && 2 * D <= TILE), "value groups");
  __shared__ __align__(16) float sc[GP * TILE];
  __shared__ float tk[1 << KB], tv[1 << VB], svs[TILE];
  __shared__ unsigned int svc[TILE * WV];
  for (int t = tid; t < (1 << KB); t += NT) tk[t] = ktab[t];
  for (int t = tid; t < (1 << VB); t += NT) tv[t] = vtab[t];
  __syncthreads();

  // Values: K groups of D lanes (K = 2 below D = 256), group k takes positions k mod K.
  const int i = tid % D, k = tid / D;
  auto from = [&](int j) { return j + ((k - j) & (K - 1)); };
  float ar[GP], ap[GP];
  #pragma unroll
  for (int g = 0; g < GP; g++) { ar[g] = 0.0f; ap[g] = 0.0f; }
  for (int t0 = lo; t0 < hi; t0 += TILE) {
    const int t1 = min(hi, t0 + TILE), n = t1 - t0;
    // The tile's coded values (codes, scales) into shared memory in one coalesced
    // pass: thread i then reads them there, not position after position from memory.
    const int c0 = max(t0, S), c1 = min(t1, e0);
    for (int t = tid; t < (c1 - c0) * WV; t += NT) svc[(c0 - t0) * WV + t] = value_row(c0 + t / WV)[t % WV];
    for (int j = c0 + tid; j < c1; j += NT) svs[j - t0] = value_scale(j);
    for (int j = t0 + tid; j < t1; j += NT) {
      float* srow = sc + (j - t0) * GP;
      if (j < S || j >= e0) """ + _STEP_EXACT_SCORES + """      else {
        const unsigned int* row = key_row(j);
        float s[GP];
        #pragma unroll
        for (int g = 0; g < GP; g++) s[g] = 0.0f;
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
        const float f = key_scale(j) * (1.0f / D);
        #pragma unroll
        for (int g = 0; g < GP; g += 4) *reinterpret_cast<float4*>(srow + g) = make_float4(s[g] * f, s[g + 1] * f, s[g + 2] * f, s[g + 3] * f);
      }
    }
    __syncthreads();""" + _STEP_SOFTMAX + """    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; g++) { ar[g] *= fc[g]; ap[g] *= fc[g]; }
    for (int j = from(t0); j < min(t1, S); j += K) tq_fma4<GP>(ap, sc + (j - t0) * GP, exact_value(j, i));
    for (int j = from(c0); j < c1; j += K)
      tq_fma4<GP>(ar, sc + (j - t0) * GP, tv[tq_code<VB>(svc + (j - t0) * WV, i)] * svs[j - t0]);
    for (int j = from(max(t0, max(e0, S))); j < t1; j += K) tq_fma4<GP>(ap, sc + (j - t0) * GP, exact_value(j, i));
    __syncthreads();
  }
  if (K > 1) {  // group 1 hands its sums to group 0 through the score tile (2 * GP * D <= GP * TILE)
    if (k == 1) {
      #pragma unroll
      for (int g = 0; g < G; g++) { sc[g * D + i] = ar[g]; sc[(GP + g) * D + i] = ap[g]; }
    }
    __syncthreads();
    if (k == 0) {
      #pragma unroll
      for (int g = 0; g < G; g++) { ar[g] += sc[g * D + i]; ap[g] += sc[(GP + g) * D + i]; }
    }
  }
""" + _STEP_CLOSE.replace("CODED_SUM", "ar[g]")

# Tensor cores (D = 128): each warp its own 16 coded positions at a time, from the chunk's
# first to its last, FlashAttention-2's way (mma.sync m16n8k16: fp16 operands, float32 sums):
#   scores S (16 heads x 16 positions) = Qr (16 x D) . levels of the keys' codes (D x 16);
#   sums O (D coordinates x 16 heads) += levels of the values' codes (D x 16) . P^T,
# P = exp(S - the warp's running maximum) times the value scales. A lane's score
# accumulators (heads g, g + 8 at positions 2t, 2t + 1 of each 8) are already its P^T
# operand, so P never leaves registers and no barrier falls inside the loop; the warps'
# maxima, sums and O meet once, at the end, then the exact positions join on CUDA cores.
# An mma's k index may stand for any coordinate so long as both operands agree: a lane's
# key codes are one run of its row (codes D/4 t + 4s .. + 3 in k-step s), and its value
# coordinates (rows g, g + 8 of each m-tile) the run D/8 g .. D/8 g + D/8 - 1.
_STEP_MMA = _STEP_OPEN + """
  constexpr int KT = D / 16, HT = (G + 7) / 8, MT = D / 16, RUN = D / 4, VRUN = D / 8, PASS = 64;
  static_assert(G <= 16 && D % 16 == 0, "mma tiles");
  __shared__ unsigned short tkh[1 << KB];
  __shared__ unsigned tv2[1 << (2 * VB)];
  __shared__ float wm[NW][16], wl[NW][16];
  __shared__ __align__(16) float sc[GP * PASS];
  // Levels as the fp16 mma operands hold them; value levels two at a time: entry
  // a | b << VB is (level a, level b), one load for a coordinate at two positions.
  for (int t = tid; t < (1 << KB); t += NT) tkh[t] = __half_as_ushort(__float2half_rn(ktab[t]));
  for (int t = tid; t < (1 << (2 * VB)); t += NT) tv2[t] = tq_h2(vtab[t & ((1 << VB) - 1)], vtab[t >> VB]);
  __syncthreads();

  const int lg = lane >> 2, lt = lane & 3;  // the mma fragments' lane (group, thread in group)
  const int c0 = max(lo, S), c1 = min(hi, e0);  // the chunk's coded positions
  unsigned qa[KT][4];
  tq_query_fragments<D, G, GP>(qa, qr, lg, lt);
  float o[MT][HT][4];
  #pragma unroll
  for (int m = 0; m < MT; m++) {
    #pragma unroll
    for (int h = 0; h < HT; h++) o[m][h][0] = o[m][h][1] = o[m][h][2] = o[m][h][3] = 0.0f;
  }
  // Running maximum and this lane's part of the sum, heads lg + 8r.
  float rm[2] = {-INFINITY, -INFINITY}, rl[2] = {0.0f, 0.0f};
  for (int j16 = c0 + 16 * warp; j16 < c1; j16 += 16 * NW) {
    // Scores: n-tile n the positions j16 + 8n + lg (columns); past c1, row c1 - 1's.
    float s[2][4];
    #pragma unroll
    for (int n = 0; n < 2; n++) {
      unsigned w[(RUN * KB + 31) / 32];
      tq_span<KB, RUN, WK>(w, key_row(min(j16 + 8 * n + lg, c1 - 1)), RUN * lt);
      float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      #pragma unroll
      for (int k = 0; k < KT; k++) {
        const unsigned b0 = tkh[tq_code<KB>(w, 4 * k)] | (unsigned)tkh[tq_code<KB>(w, 4 * k + 1)] << 16;
        const unsigned b1 = tkh[tq_code<KB>(w, 4 * k + 2)] | (unsigned)tkh[tq_code<KB>(w, 4 * k + 3)] << 16;
        tq_mma(k & 1 ? s1 : s0, qa[k], b0, b1);  // two chains of dependent mma, not one
      }
      #pragma unroll
      for (int e = 0; e < 4; e++) s[n][e] = s0[e] + s1[e];
    }
    // This lane's positions j16 + 8n + 2lt + e: scores times the key scales (-inf past
    // c1), and their value scales (0 past c1).
    float vs[2][2];
    #pragma unroll
    for (int n = 0; n < 2; n++) {
      #pragma unroll
      for (int e = 0; e < 2; e++) {
        const int j = j16 + 8 * n + 2 * lt + e;
        const bool in = j < c1;
        const float f = in ? key_scale(j) * (1.0f / D) : 0.0f;
        vs[n][e] = in ? value_scale(j) : 0.0f;
        s[n][e] = in ? s[n][e] * f : -INFINITY;
        s[n][2 + e] = in ? s[n][2 + e] * f : -INFINITY;
      }
    }
    // Online softmax, head lg + 8r: the 16 positions' maximum over the group's 4 lanes
    // (j16 itself is coded, so it is finite), weights exp(s - maximum) in place.
    float f[2] = {1.0f, 1.0f};
    #pragma unroll
    for (int r = 0; r < HT; r++) {
      float mt = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffff, mt, 1));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffff, mt, 2));
      const float mn = fmaxf(rm[r], mt);
      f[r] = expf(rm[r] - mn);
      rm[r] = mn;
      float ps = 0.0f;
      #pragma unroll
      for (int n = 0; n < 2; n++) {
        #pragma unroll
        for (int e = 0; e < 2; e++) {
          s[n][2 * r + e] = expf(s[n][2 * r + e] - mn);
          ps += s[n][2 * r + e];
        }
      }
      rl[r] = rl[r] * f[r] + ps;
    }
    // O's columns are heads 8h + 2lt, + 1: their factors sit in lanes 8lt, 8lt + 4. Once
    // the maxima settle (most of a long chunk) no factor moves and the warp skips this.
    if (__any_sync(0xffffffff, f[0] != 1.0f || f[1] != 1.0f)) {
      #pragma unroll
      for (int h = 0; h < HT; h++) {
        const float fa = __shfl_sync(0xffffffff, f[h], 8 * lt), fb = __shfl_sync(0xffffffff, f[h], 8 * lt + 4);
        #pragma unroll
        for (int m = 0; m < MT; m++) {
          o[m][h][0] *= fa;
          o[m][h][1] *= fb;
          o[m][h][2] *= fa;
          o[m][h][3] *= fb;
        }
      }
    }
    // P^T as the B operand (k: positions 2lt, 2lt + 1 | 2lt + 8, 2lt + 9; n: head 8h + lg).
    unsigned pb[HT][2];
    #pragma unroll
    for (int h = 0; h < HT; h++) {
      pb[h][0] = tq_h2(s[0][2 * h] * vs[0][0], s[0][2 * h + 1] * vs[0][1]);
      pb[h][1] = tq_h2(s[1][2 * h] * vs[1][0], s[1][2 * h + 1] * vs[1][1]);
    }
    // Value levels as the A operand: m-tile m's rows lg, lg + 8 are coordinates VRUN lg + 2m,
    // + 1, at this lane's positions x = 0..3 (j16 + 2lt, + 1, + 8, + 9).
    unsigned v[4][(VRUN * VB + 31) / 32];
    #pragma unroll
    for (int x = 0; x < 4; x++)
      tq_span<VB, VRUN, WV>(v[x], value_row(min(j16 + 8 * (x >> 1) + 2 * lt + (x & 1), c1 - 1)), VRUN * lg);
    #pragma unroll
    for (int m = 0; m < MT; m++) {
      auto pair = [&](int x, int u) { return tv2[tq_code<VB>(v[x], u) | tq_code<VB>(v[x + 1], u) << VB]; };
      const unsigned a[4] = {pair(0, 2 * m), pair(0, 2 * m + 1), pair(2, 2 * m), pair(2, 2 * m + 1)};
      #pragma unroll
      for (int h = 0; h < HT; h++) tq_mma(o[m][h], a, pb[h][0], pb[h][1]);
    }
  }

  // The warps meet: each head's maximum over the warps, the sums onto it (fm, fl), and
  // the coded sums (rotated, head-major) added up in qr, free now.
  #pragma unroll
  for (int r = 0; r < HT; r++) {
    rl[r] += __shfl_xor_sync(0xffffffff, rl[r], 1);
    rl[r] += __shfl_xor_sync(0xffffffff, rl[r], 2);
    if (lt == 0 && lg + 8 * r < G) { wm[warp][lg + 8 * r] = rm[r]; wl[warp][lg + 8 * r] = rl[r]; }
  }
  __syncthreads();
  if (tid < G) {
    float M = -INFINITY, L = 0.0f;
    for (int w = 0; w < NW; w++) M = fmaxf(M, wm[w][tid]);
    for (int w = 0; w < NW; w++) L += wm[w][tid] > -INFINITY ? wl[w][tid] * expf(wm[w][tid] - M) : 0.0f;
    fm[tid] = M;
    fl[tid] = L;
  }
  for (int t = tid; t < G * D; t += NT) qr[t] = 0.0f;
  __syncthreads();
  #pragma unroll
  for (int h = 0; h < HT; h++) {
    #pragma unroll
    for (int e = 0; e < 2; e++) {
      const int g = 8 * h + 2 * lt + e;
      if (g >= G || !(wm[warp][g] > -INFINITY)) continue;
      const float f = expf(wm[warp][g] - fm[g]);
      #pragma unroll
      for (int m = 0; m < MT; m++) {
        atomicAdd(qr + g * D + VRUN * lg + 2 * m, o[m][h][e] * f);
        atomicAdd(qr + g * D + VRUN * lg + 2 * m + 1, o[m][h][2 + e] * f);
      }
    }
  }
  __syncthreads();

  // Exact positions (sinks, then the window's and the new token's), PASS at a time.
  const int ns = max(0, min(hi, S) - lo), x1 = max(lo, e0), ne = ns + max(0, hi - x1);
  auto exact = [&](int x) { return x < ns ? lo + x : x1 + x - ns; };
  float ap[GP];
  #pragma unroll
  for (int g = 0; g < GP; g++) ap[g] = 0.0f;
  for (int x0 = 0; x0 < ne; x0 += PASS) {
    const int n = min(PASS, ne - x0);
    if (tid < n) {
      const int j = exact(x0 + tid);
      float* srow = sc + tid * GP;""" + _STEP_EXACT_SCORES + """    }
    __syncthreads();""" + _STEP_SOFTMAX + """    __syncthreads();
    if (tid < D) {
      #pragma unroll
      for (int g = 0; g < G; g++) { ap[g] *= fc[g]; qr[g * D + tid] *= fc[g]; }
      for (int x = 0; x < n; x++) tq_fma4<GP>(ap, sc + x * GP, exact_value(exact(x0 + x), tid));
    }
    __syncthreads();
  }
""" + _STEP_CLOSE.replace("CODED_SUM", "qr[g * D + tid]")

_MERGE = """
  // A block per (row, head), NT threads: the chunks' maxima and weights first, then
  // K = NT / D groups of D lanes each sum every K-th chunk. (One lane per output
  // coordinate walking all C chunks was a chain of 2C dependent loads: at 32k
  // positions C is 256 and that chain, not the step kernel, set the time.)
  constexpr int K = NT / D, NW = NT / 32, E = 2 * D + 2;
  __shared__ float w[MAXC], red[NW], ys[K * D], as[K * D];
  const int bh = blockIdx.x, tid = threadIdx.x, lane = tid & 31, C = meta[5];
  const float* pb = part + (size_t)bh * C * E;
  float m = -INFINITY;
  for (int c = tid; c < C; c += NT) m = fmaxf(m, pb[(size_t)c * E + 2 * D]);
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  if (lane == 0) red[tid >> 5] = m;
  __syncthreads();
  float M = red[0];
  #pragma unroll
  for (int x = 1; x < NW; x++) M = fmaxf(M, red[x]);
  __syncthreads();
  float l = 0.0f;
  for (int c = tid; c < C; c += NT) {
    const float f = expf(pb[(size_t)c * E + 2 * D] - M);
    w[c] = f;
    l += pb[(size_t)c * E + 2 * D + 1] * f;
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffff, l, o);
  if (lane == 0) red[tid >> 5] = l;
  __syncthreads();
  float L = 0.0f;
  #pragma unroll
  for (int x = 0; x < NW; x++) L += red[x];
  const int i = tid % D, k = tid / D;
  float r = 0.0f, a = 0.0f;
  #pragma unroll 4
  for (int c = k; c < C; c += K) {
    const float* pc = pb + (size_t)c * E;
    r += pc[i] * w[c];
    a += pc[D + i] * w[c];
  }
  ys[tid] = r;
  as[tid] = a;
  __syncthreads();
  if (k == 0) {
    #pragma unroll
    for (int x = 1; x < K; x++) { r += ys[x * D + i]; a += as[x * D + i]; }
    ys[i] = r;
  }
  __syncthreads();
  tq_wht<D>(ys, 1);
  if (k == 0) tq_store(out + (size_t)bh * D + i, (a + ys[i] * books[i] * (1.0f / D)) / L);
"""

STEP_BLOCKS = 512  # blocks aimed at per step and layer (of 128 or 256 threads, 56-96 registers a thread)
MERGE_THREADS = 512


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
    """The step kernel's threads a block (NT): 8 warps from D = 128 (H200, 7B shape at
    32k: 53.6 us a launch against 62.3-63.5 with 4 warps), 4 at D = 64. The CUDA-core
    kernel's tiles are NT positions; the chunks are whole tiles either way."""
    return 256 if dim > 64 else 128


def tensor_cores(dim: int) -> bool:
    """Whether the step takes the tensor-core kernel (`tq_step_mma`, fp16 operands):
    at D = 128, where it was measured faster on the H200; at D = 64 a tensor-core
    kernel was slower (0.5B shape at 32k: 1.23 ms for 24 launches against 0.84)."""
    return dim == 128


def step_kernel_name(dim: int) -> str:
    return "tq_step_mma" if tensor_cores(dim) else "tq_step"


_STEP_INPUTS = ["q", "kn", "vn", "sk", "sv", "kc", "kq", "vc", "vq", "wx", "wc", "wq", "books", "meta"]
_STEP_OUTPUTS = ["part", "wx_out", "wc_out", "wq_out"]
# name -> (input names, output names, body) of the step mode kernels.
STEP_KERNELS = {
    "tq_encode": (["x", "sign", "tab", "edge"], ["codes", "scales"], _ENCODE),
    "tq_step": (_STEP_INPUTS, _STEP_OUTPUTS, _STEP),
    "tq_step_mma": (_STEP_INPUTS, _STEP_OUTPUTS, _STEP_MMA),
    "tq_merge": (["part", "books", "meta"], ["out"], _MERGE),
}  # fmt: skip


@lru_cache(maxsize=None)
def _step_kernel(name: str, body: Optional[str] = None):
    """One of STEP_KERNELS (`body` replaces its source: benchmarks time variants)."""
    inputs, outputs, source = STEP_KERNELS[name]
    # The step kernels read q and the new token through their strides; everything else
    # they take is contiguous by construction (TurboQuantKVCache._enter_step).
    return mx.fast.cuda_kernel(name=name if body is None else f"{name}_{abs(hash(body))}", input_names=inputs,
                               output_names=outputs, source=body or source, header=_STEP_HEADER,
                               ensure_row_contiguous=inputs != _STEP_INPUTS)  # fmt: skip


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
    positions), about STEP_BLOCKS blocks over `rows` (batch x kv heads)."""
    tile = _threads(dim)
    tiles = -(-positions // tile)
    per = max(1, -(-tiles * rows // STEP_BLOCKS))
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
                 dtype) -> tuple:  # fmt: skip
    """The two kernels' keyword arguments besides inputs (made once per shape). A
    decode step of a small model is bound by host work per launch, which grows with
    the launch's arguments: hence few inputs, outputs and template constants."""
    (kb, vb), threads = bits, _threads(dim)
    words = dim * (kb + vb) // 32
    step = dict(
        template=[("D", dim), ("G", n_heads // kv_heads), ("HKV", kv_heads), ("KB", kb), ("VB", vb)],
        grid=(B * kv_heads * chunks * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B * n_heads, chunks, 2 * dim + 2), (B, kv_heads, slots, 2, dim), (B, kv_heads, slots, words),
                       (B, kv_heads, slots, 2)],
        output_dtypes=[mx.float32, dtype, mx.uint32, mx.float16],
    )  # fmt: skip
    merge = dict(template=[("D", dim), ("NT", MERGE_THREADS), ("MAXC", STEP_BLOCKS)],
                 grid=(B * n_heads * MERGE_THREADS, 1, 1), threadgroup=(MERGE_THREADS, 1, 1),
                 output_shapes=[(B, n_heads, 1, dim)], output_dtypes=[dtype])  # fmt: skip
    return step, merge


def step(q, new, sinks, coded, window, books, meta, chunks: int, bits: tuple):
    """One decode step's attention (see above). q (B, Hq, 1, D); new = (k, v)
    (B, Hkv, 1, D); sinks = (k, v) (B, Hkv, SS, D); coded = (kc, kq, vc, vq) the
    big buffers; window = (wx (B, Hkv, N, 2, D) exact keys and values, wc (B, Hkv,
    N, WK + WV) key then value codes, wq (B, Hkv, N, 2) their scales); books from
    `step_books`; meta int32 [p, S, cap, cb, r0, chunks, e0, N, SS, span]. Returns
    (out (B, Hq, 1, D) in q's dtype, the window's next arrays)."""
    B, n_heads, _, dim = q.shape
    launch, merge = _step_launch(B, n_heads, dim, new[0].shape[1], bits, window[0].shape[2], chunks, q.dtype)
    outs = _step_kernel(step_kernel_name(dim))(inputs=[q, *new, *sinks, *coded, *window, books, meta], **launch)
    out = _step_kernel("tq_merge")(inputs=[outs[0], books, meta], **merge)[0]
    return out, tuple(outs[1:])
