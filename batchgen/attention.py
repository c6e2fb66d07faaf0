"""Attention for short multi-token passes (PLD verify, a prompt's uncached tail).

On MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with more than
one query builds a kernel for every new (queries, keys) shape. A verify pass
of 6 tokens at a new cache length each time therefore cost ~50-85 ms on an
H200, against ~3 ms for a one-token step and ~2.5 ms for the same 6-token pass
at a length it had seen (measured 2026-11-29). Decoding only ever sees new
lengths. For a few queries, plain matmul + softmax is cheap and has no
per-shape build, so `install_short_attention` routes passes of 2..`max_queries`
queries through it, and leaves one-token steps and long prefill chunks to the
fused kernel.

The hook rebinds `scaled_dot_product_attention` in the modules the model is
built from (as mlx-lm's models import it by name). It takes effect only for
`KVCache` layers, and batches' `BatchKVCache` layers (`batch_pld`'s verify
passes), marked by `mark_cache` (the engine's own caches), so
another model of the same architecture in the process (the plain mlx-lm side
of a benchmark) keeps the stock path, and other caches (TurboQuant's own
attention) keep theirs.

Batched decoding has the same problem in another form: rows of different
lengths share a left-padded `BatchKVCache`, and MLX's CUDA backend has no fused
one-query attention that takes a mask, so each layer's step fell back to
matmul + mask + softmax + matmul: 7.6 ms a step at 32 rows on the 0.5B shape
against 4.8 ms for equal-length rows without a mask (H200, 2026-11-30,
bench/batch_step.py). `batch_decode_attention` is one kernel that reads each
row from its own first position instead.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .compiled_step import StepCache, kernel_head_size
from .turboquant_kernels import available as _cuda  # CUDA present, the default device a GPU
from .turboquant_kernels import constant

DEFAULT_MAX_QUERIES = 256
_ATTR = "scaled_dot_product_attention"
_MARK = "batchgen_short_attention"


def mark_cache(cache: list) -> list:
    """Let the hook serve these cache layers (clones keep the mark)."""
    for c in cache:
        if type(c) in (KVCache, BatchKVCache):
            setattr(c, _MARK, True)
    return cache


def short_attention(queries, keys, values, scale: float, mask) -> mx.array:
    """Attention of L queries (the last L positions) over S keys, as plain ops.

    queries (B, Hq, L, D); keys/values (B, Hkv, S, D); grouped-query heads share
    their key head. `mask`: "causal", None, or a boolean/additive array.
    """
    B, n_heads, L, D = queries.shape
    n_kv, S = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(B, n_kv, n_heads // n_kv, L, D)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (B, Hkv, G, L, S)
    if isinstance(mask, mx.array):
        if mask.ndim == 4:
            mask = mask[:, :, None] if mask.shape[1] > 1 else mask[:, None]
        # The lowest finite score, not -inf: a query with every key masked (a left-padded
        # row's padding in a batch pass) then averages instead of turning NaN, and NaN
        # written into its cache entries would reach other queries through 0 * NaN.
        low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        scores = mx.where(mask, scores, low) if mask.dtype == mx.bool_ else scores + mask
    elif mask is not None or L > 1:  # "causal": query i sits at position S - L + i
        causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        scores = mx.where(causal, scores, -mx.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(values.dtype)
    return (probs @ values[:, :, None]).reshape(B, n_heads, L, -1)


def _wrap(inner, max_queries: int):
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        L = queries.shape[2]
        if sinks is None and getattr(cache, _MARK, False):
            if 1 < L <= max_queries and type(cache) in (KVCache, BatchKVCache):  # (batched: `batch_pld`'s passes)
                return short_attention(queries, keys, values, scale, mask)
            if L == 1 and type(cache) is BatchKVCache and batch_decode_supported(queries, cache):
                bounds = batch_cache_bounds(cache)
                return batch_decode_attention(queries, cache.keys, cache.values, cache.left_padding, bounds, scale)
        if type(cache) is StepCache and cache.new is not None:  # fed its token, not holding it
            return batch_step_attention(queries, cache, scale)
        return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    sdpa.batchgen_short_attention = inner
    return sdpa


def _hooked(fn) -> bool:
    """Whether `fn` is this hook or wraps it (hooks chain through an attribute
    naming the function they wrap)."""
    while fn is not None:
        if hasattr(fn, "batchgen_short_attention"):
            return True
        fn = getattr(fn, "batchgen_turboquant", None)
    return False


def _model_modules(model) -> set:
    return {sys.modules[type(m).__module__] for m in model.modules() if type(m).__module__ in sys.modules}


def install_short_attention(model, max_queries: int = DEFAULT_MAX_QUERIES) -> list[str]:
    """Route short multi-query attention of `model`'s layers through
    `short_attention`; returns the names of the modules hooked."""
    hooked = []
    for module in _model_modules(model):
        inner = getattr(module, _ATTR, None)
        if inner is None or _hooked(inner):
            continue
        setattr(module, _ATTR, _wrap(inner, max_queries))
        hooked.append(module.__name__)
    return sorted(hooked)


def uninstall_short_attention(model) -> None:
    for module in _model_modules(model):
        fn = getattr(module, _ATTR, None)
        if fn is not None and hasattr(fn, "batchgen_short_attention"):
            setattr(module, _ATTR, fn.batchgen_short_attention)


# ---------------------------------------------------------------------------
# One-query attention over a left-padded batch cache (CUDA)
#
# A block per (row, kv head, chunk of positions) serves the group's query
# heads (up to 16; more take several blocks), so each key and value is read
# once for all of them. A block per query head read them G times, its warps
# one position after another with a load each in flight; 46 us a layer for 8
# rows of <= 512 tokens on the 7B shape, a fifth of the step (Nsight Compute,
# H200). Per tile of TILE positions:
#   * the tile's keys and values go to shared memory in 16-byte asynchronous
#     copies, all in flight at once (rows padded so that no two threads of a
#     load phase meet in one bank);
#   * P = NT / TILE threads score a position against the scaled queries
#     (shared memory, coordinate-major, heads padded to GP: a coordinate's
#     values are GP / 4 float4 loads), each 1/P of its 16-byte pieces;
#   * an online softmax per head, a warp per head;
#   * thread (i, grp) adds coordinate i of every K-th value, weighted, into
#     a sum per head (K = NT / D groups of D threads).
# A row's positions are split into C chunks so that short batches still fill
# the GPU; with C > 1 each block leaves its (sums, max, total) per head in
# `scratch`, and the last block of its (row, kv head, heads) to finish (a
# counter each in `scratch`, reset by that block) combines them, so the step
# stays one launch. `scratch` is one zeroed buffer kept between launches (an
# input, not an output: no allocation, no fill, fewer arguments a launch, whose
# host cost bounds a small model's step).

GROUP_HEADER = """
__device__ __forceinline__ void bg_chunk(const float* p, float* x) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
}
__device__ __forceinline__ void bg_chunk(const __nv_bfloat16* p, float* x) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  #pragma unroll
  for (int e = 0; e < 4; e++) { const float2 f = __bfloat1622float2(h[e]); x[2 * e] = f.x; x[2 * e + 1] = f.y; }
}
__device__ __forceinline__ void bg_chunk(const __half* p, float* x) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
  #pragma unroll
  for (int e = 0; e < 4; e++) { const float2 f = __half22float2(h[e]); x[2 * e] = f.x; x[2 * e + 1] = f.y; }
}
// 16 bytes global -> shared without a register stop (sm_80+: cp.async), then the wait for all.
__device__ __forceinline__ void bg_copy16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" ::"r"(to), "l"(src));
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
__device__ __forceinline__ void bg_copy_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\\n" ::);
#endif
}
// acc[g] += w[g] * x for the GP (a multiple of 4) values at w (16-byte aligned shared memory).
template <int GP>
__device__ __forceinline__ void bg_fma4(float* acc, const float* w, float x) {
  #pragma unroll
  for (int g = 0; g < GP; g += 4) {
    const float4 y = *reinterpret_cast<const float4*>(w + g);
    acc[g] += y.x * x;
    acc[g + 1] += y.y * x;
    acc[g + 2] += y.z * x;
    acc[g + 3] += y.w * x;
  }
}
"""

# Block (unit = (row b, kv head hk, heads hg), chunk c); C = the grid's chunks
# per unit (B from left_padding's shape). Query heads h0 .. h0 + gn - 1. The
# sources below define QP(g) (query head h0 + g of row b) and KEY / VAL /
# start / stop.
_GROUP_COMMON = """
  constexpr int G = HQ / HKV, GB = G < 16 ? G : 16, HG = (G + GB - 1) / GB;
  const int C = gridDim.x / (left_padding_shape[0] * HKV * HG);
  const int unit = blockIdx.x / C, c = blockIdx.x % C, nb = unit / HG, hg = unit % HG;
  const int b = nb / HKV, hk = nb % HKV, h0 = hk * G + hg * GB, gn = min(GB, G - hg * GB);
  const size_t row = (size_t)nb;
  #define OWNS_WINDOW (c == 0 && hg == 0)
"""

_GROUP_BODY = """
  constexpr int NT = D > 128 ? D : 128, K = NT / D, GP = (GB + 3) / 4 * 4, E = D + 2;
  constexpr int TB = sizeof(k[0]), EPC = 16 / TB, CR = D / EPC, P = NT / TILE, RSB = D * TB + 16 * P;
  static_assert((K - 1) * GB * D * 4 <= 2 * TILE * RSB, "the groups' sums fit the tile's memory");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __shared__ __align__(16) unsigned char kvs[2 * TILE * RSB];
  __shared__ __align__(16) float qs[D * GP];
  __shared__ __align__(16) float sc[TILE * GP];
  __shared__ float fm[GP], fl[GP], fc[GP];
  __shared__ bool last;
  const float scl = scale[0];
  for (int t = tid; t < D * GP; t += NT) {
    const int g = t % GP, d = t / GP;
    qs[t] = g < gn ? static_cast<float>(QP(g)[d]) * scl : 0.0f;
  }
  if (tid < GP) { fm[tid] = -INFINITY; fl[tid] = 0.0f; }
  const int span = (stop - start + C - 1) / C, lo = start + c * span, hi = min(stop, lo + span);
  const int i = tid % D, grp = tid / D, pos = tid / P, piece = tid % P;
  const auto* ks = reinterpret_cast<decltype(&k[0])>(kvs);
  const auto* vs = reinterpret_cast<decltype(&k[0])>(kvs + TILE * RSB);
  float acc[GP];
  #pragma unroll
  for (int g = 0; g < GP; g++) acc[g] = 0.0f;
  for (int t0 = lo; t0 < hi; t0 += TILE) {
    const int n = min(hi - t0, TILE);
    for (int t = tid; t < 2 * TILE * CR; t += NT) {
      const int half = t / (TILE * CR), r = (t / CR) % TILE, ch = t % CR;
      const auto* src = half ? VAL(t0 + r) : KEY(t0 + r);
      if (r < n) bg_copy16(kvs + (half * TILE + r) * RSB + ch * 16, src + ch * EPC);
    }
    bg_copy_wait();
    __syncthreads();
    float s[GP];
    #pragma unroll
    for (int g = 0; g < GP; g++) s[g] = 0.0f;
    if (pos < n) {
      for (int ch = piece; ch < CR; ch += P) {
        float x[8];
        bg_chunk(ks + pos * (RSB / TB) + ch * EPC, x);
        #pragma unroll
        for (int e = 0; e < EPC; e++) bg_fma4<GP>(s, qs + (ch * EPC + e) * GP, x[e]);
      }
    }
    #pragma unroll
    for (int o = 1; o < P; o <<= 1) {
      #pragma unroll
      for (int g = 0; g < GP; g++) s[g] += __shfl_xor_sync(0xffffffff, s[g], o);
    }
    if (piece == 0 && pos < n) {
      #pragma unroll
      for (int g = 0; g < GP; g += 4)
        *reinterpret_cast<float4*>(sc + pos * GP + g) = make_float4(s[g], s[g + 1], s[g + 2], s[g + 3]);
    }
    __syncthreads();
    for (int g = warp; g < gn; g += NT / 32) {  // online softmax, a warp per head
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
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < GP; g++) acc[g] *= g < gn ? fc[g] : 0.0f;
    for (int j = grp; j < n; j += K) bg_fma4<GP>(acc, sc + j * GP, static_cast<float>(vs[j * (RSB / TB) + i]));
    __syncthreads();
  }
  if (K > 1) {  // groups 1.. hand their sums to group 0 through the tile's memory
    float* red = reinterpret_cast<float*>(kvs);
    if (grp > 0) {
      #pragma unroll
      for (int g = 0; g < GB; g++) red[((grp - 1) * GB + g) * D + i] = acc[g];
    }
    __syncthreads();
    if (grp == 0) {
      for (int x = 0; x < K - 1; x++) {
        #pragma unroll
        for (int g = 0; g < GB; g++) acc[g] += red[(x * GB + g) * D + i];
      }
    }
  }
  auto* ob = out + ((size_t)b * HQ + h0) * D;
  if (C == 1) {  // the whole row: no partials
    if (grp == 0) {
      #pragma unroll
      for (int g = 0; g < GB; g++) if (g < gn) ob[g * D + i] = acc[g] / fl[g];
    }
    return;
  }
  // scratch: a counter per unit (gridDim.x / C of them), then each block's partials.
  int* counter = reinterpret_cast<int*>(const_cast<float*>(scratch)) + unit;
  float* pb = const_cast<float*>(scratch) + gridDim.x / C + (size_t)unit * C * GB * E;
  float* pp = pb + (size_t)c * GB * E;
  if (grp == 0) {
    #pragma unroll
    for (int g = 0; g < GB; g++) pp[g * E + i] = acc[g];
  }
  if (tid < GB) { pp[tid * E + D] = fm[tid]; pp[tid * E + D + 1] = fl[tid]; }
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(counter, 1) == C - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int t = tid; t < gn * D; t += NT) {
    const int g = t / D, d = t % D;
    float M = -INFINITY;
    for (int x = 0; x < C; x++) M = fmaxf(M, __ldcg(pb + (x * GB + g) * E + D));
    float L = 0.0f, y = 0.0f;
    for (int x = 0; x < C; x++) {
      const float* px = pb + (x * GB + g) * E;
      const float mx_ = __ldcg(px + D), f = mx_ == -INFINITY ? 0.0f : expf(mx_ - M);
      L += __ldcg(px + D + 1) * f;
      y += __ldcg(px + d) * f;
    }
    ob[g * D + d] = y / L;
  }
  if (tid == 0) *counter = 0;
"""

# A BatchKVCache after its update: positions start .. write position - 1 of
# one buffer (meta: [write position, capacity]).
_DECODE_SOURCE = _GROUP_COMMON + """
  #define QP(g) (q + ((size_t)b * HQ + h0 + (g)) * D)
  const int start = left_padding[b], stop = meta[0], cap = meta[1];
  #define KEY(j) (k + (row * cap + (j)) * D)
  #define VAL(j) (v + (row * cap + (j)) * D)
""" + _GROUP_BODY

# The compiled step's cache (`compiled_step.StepCache`): positions below
# `base` in the big buffers k, v; `base` .. `base + used - 1` in the recent
# window rk, rv; the step's own token (kn, vn) at `base + used`, written into
# the window's slot `used` on the way (rk_out, rv_out: by one block of each
# row and key head, OWNS_WINDOW), so that the step writes no big buffer.
WINDOW_PART = """
  const int base = meta[0], used = meta[1], cap = meta[2], W = meta[3];
  const int start = left_padding[b], stop = base + used + 1;
  if (OWNS_WINDOW) {
    for (int i = threadIdx.x; i < W * D; i += blockDim.x) {
      const int slot = i / D;
      const size_t at = row * W * D + i;
      rk_out[at] = slot == used ? KN[i % D] : rk[at];
      rv_out[at] = slot == used ? VN[i % D] : rv[at];
    }
  }
"""
_STEP_PART = WINDOW_PART + """
  #define KEY(j) ((j) < base ? k + (row * cap + (j)) * D : (j) < base + used ? rk + (row * W + (j) - base) * D : KN)
  #define VAL(j) ((j) < base ? v + (row * cap + (j)) * D : (j) < base + used ? rv + (row * W + (j) - base) * D : VN)
""" + _GROUP_BODY

# A block per (row, query head), as TurboQuant's batch step kernel takes it.
STEP_HEAD = """
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  const size_t row = (size_t)b * HKV + hk;
  #define OWNS_WINDOW (h % (HQ / HKV) == 0)
  #define QP (q + (size_t)bh * D)
  #define KN (kn + row * D)
  #define VN (vn + row * D)
"""
_STEP_SOURCE = _GROUP_COMMON + """
  #define QP(g) (q + ((size_t)b * HQ + h0 + (g)) * D)
  #define KN (kn + row * D)
  #define VN (vn + row * D)
""" + _STEP_PART

# `step_forward`'s step: q and the new k read from the fused projection after
# RoPE (`q`: (B, HT, D), HT = HQ + 2 HKV heads: q | k | v, all rotated), the
# new v from the projection before it (`heads`), so that nothing is sliced
# (and copied) out of either first.
FUSED_STEP_HEAD = """
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  const size_t row = (size_t)b * HKV + hk;
  #define OWNS_WINDOW (h % (HQ / HKV) == 0)
  #define QP (q + ((size_t)b * HT + h) * D)
  #define KN (q + ((size_t)b * HT + HQ + hk) * D)
  #define VN (heads + ((size_t)b * HT + HQ + HKV + hk) * D)
"""
_FUSED_STEP_SOURCE = _GROUP_COMMON + """
  #define QP(g) (q + ((size_t)b * HT + h0 + (g)) * D)
  #define KN (q + ((size_t)b * HT + HQ + hk) * D)
  #define VN (heads + ((size_t)b * HT + HQ + HKV + hk) * D)
""" + _STEP_PART


def batch_decode_supported(queries, cache) -> bool:
    """CUDA, keys and values of one head size (a multiple of 32, <= 256)."""
    k, v = cache.keys, cache.values
    return k is not None and _cuda() and kernel_head_size(queries, k, v)


def batch_cache_bounds(cache: BatchKVCache) -> mx.array:
    """[write position, capacity] of a BatchKVCache's buffers, as int32."""
    idx, capacity = cache._idx, cache.keys.shape[2]
    return constant(("bounds", idx, capacity), lambda: mx.array([idx, capacity], mx.int32))


def batch_decode_attention(queries: mx.array, k: mx.array, v: mx.array, left_padding: mx.array, bounds: mx.array,
                           scale: float) -> mx.array:  # fmt: skip
    """softmax(q k^T * scale) v for one query per row, each row over its own
    positions left_padding[b] .. end - 1 of the buffers k, v (B, Hkv, capacity,
    D); `bounds`: int32 [end, capacity]. queries (B, Hq, 1, D) -> (B, Hq, 1, D)
    in the queries' dtype."""
    inputs = {"k": k, "v": v, "left_padding": left_padding.astype(mx.int32), "meta": bounds}
    return launch_grouped("batch_decode_attention", _DECODE_SOURCE, queries, k.shape[1], inputs, scale, {},
                          k.shape[2])[0]  # fmt: skip


def batch_step_attention(queries: mx.array, cache: StepCache, scale: float) -> mx.array:
    """The compiled step's attention: each row over its positions in the big
    buffers, the recent window and its own new token (`StepCache`); the new
    token's keys and values go into the window (cache.rkeys / rvalues are
    replaced). queries (B, Hq, 1, D) -> (B, Hq, 1, D) in the queries' dtype."""
    k_new, v_new = cache.new
    rk, rv = cache.rkeys, cache.rvalues
    inputs = {"k": cache.keys, "v": cache.values, "rk": rk, "rv": rv, "kn": k_new, "vn": v_new,
              "left_padding": cache.left_padding.astype(mx.int32), "meta": cache.meta}  # fmt: skip
    out, cache.rkeys, cache.rvalues = launch_grouped("batch_step_attention", _STEP_SOURCE, queries, rk.shape[1],
                                                     inputs, scale, {"rk_out": rk, "rv_out": rv},
                                                     _step_columns(cache))  # fmt: skip
    return out


def fused_step_attention(roped: mx.array, heads: mx.array, cache: StepCache, scale: float) -> mx.array:
    """`batch_step_attention` for `step_forward`: `heads` (B, Hq + 2 Hkv, 1, D)
    is the fused q|k|v projection of the step's token, `roped` the same after
    RoPE; q and the new k are read from `roped`, the new v from `heads`.
    Returns (B, Hq * D) in their dtype; the new k and v go into the window
    (cache.rkeys / rvalues are replaced) as there."""
    rk, rv = cache.rkeys, cache.rvalues
    kv_heads = rk.shape[1]
    inputs = {"heads": heads, "k": cache.keys, "v": cache.values, "rk": rk, "rv": rv,
              "left_padding": cache.left_padding.astype(mx.int32), "meta": cache.meta}  # fmt: skip
    out, cache.rkeys, cache.rvalues = launch_grouped("fused_step_attention", _FUSED_STEP_SOURCE, roped, kv_heads,
                                                     inputs, scale, {"rk_out": rk, "rv_out": rv},
                                                     _step_columns(cache), q_heads=roped.shape[1] - 2 * kv_heads,
                                                     flat=True)  # fmt: skip
    return out


def _step_columns(cache: StepCache) -> int:
    """Columns a row of the step may hold: the big buffers, the window, the new token."""
    return cache.keys.shape[2] + cache.rkeys.shape[2] + 1


GROUP_BLOCKS = 512  # blocks aimed at per launch: ~4 per SM of an H200
GROUP_HEADS = 16  # query heads a block serves at most (the kernel's GB)
_GROUP_SHARED = 46 * 1024  # static shared memory a grouped block may take (48 kB at most)


def group_threads(dim: int) -> int:
    """Threads of a grouped block: 128, or the head size above that."""
    return max(128, dim)


def group_tile(dim: int, itemsize: int, group: int) -> int:
    """Positions a grouped block holds in shared memory at once: the most (of
    64, 32, 16, 8) whose keys and values, queries and scores fit.

    >>> group_tile(128, 2, 7), group_tile(128, 2, 16), group_tile(256, 4, 8)
    (64, 32, 8)
    """
    threads, gp = group_threads(dim), -(-min(group, GROUP_HEADS) // 4) * 4
    for tile in (64, 32, 16, 8):
        if 2 * tile * (dim * itemsize + 16 * (threads // tile)) + 4 * gp * (dim + tile) <= _GROUP_SHARED:
            return tile
    raise ValueError(f"no tile fits a head size of {dim} at {itemsize} bytes")


def group_chunks(units: int, columns: int, dim: int) -> int:
    """Chunks per (row, kv head) of a grouped launch: about GROUP_BLOCKS
    blocks in all, none shorter than a block's threads, so one short row is one block.

    >>> group_chunks(32, 545, 128)  # 8 rows x 4 kv heads, ~512 columns: 5 chunks
    5
    >>> group_chunks(4, 32801, 128)  # one row of 32k: 128 chunks of 257 positions
    128
    """
    return max(1, min(-(-GROUP_BLOCKS // units), -(-columns // group_threads(dim))))


_kernels: dict = {}
_DECODE_WARPS = 16  # `launch`'s blocks: warps, and positions a warp has in flight
_DECODE_UNROLL = 4


def _kernel(name: str, input_names: list, output_names: list, source: str, header: str):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                                             source=source, header=header)  # fmt: skip
    return _kernels[name]


def _out_shapes(queries: mx.array, n_heads: int, flat: bool, also: dict) -> tuple[list, list]:
    B, d = queries.shape[0], queries.shape[-1]
    shapes = [(B, n_heads * d) if flat else (B, n_heads, 1, d)] + [a.shape for a in also.values()]
    return shapes, [queries.dtype] + [a.dtype for a in also.values()]


def launch(name: str, source: str, queries: mx.array, kv_heads: int, inputs: dict, scale: float,
           also: dict, q_heads: int | None = None, flat: bool = False, template: tuple = (),
           header: str = "") -> list:  # fmt: skip
    """Run kernel `name` (a block per row and query head) over q + `inputs` +
    scale: out (B, q_heads, 1, D) in the queries' dtype (the kernel rounds its
    float32 sums on the way out, which saves each layer of a step a cast of its
    own), then each output named in `also`, shaped like its array there.
    `q_heads`: the query heads, where `queries` holds more heads than that (HT:
    all of them). `flat`: out as (B, q_heads * D), the same memory (the output
    projection's input). `template`: constants besides the shapes; `header`:
    device functions."""
    B, all_heads, _, d = queries.shape
    n_heads = q_heads or all_heads
    scale_arr = constant(("scale", scale), lambda: mx.array([scale], mx.float32))
    threads = 32 * _DECODE_WARPS
    shapes, dtypes = _out_shapes(queries, n_heads, flat, also)
    return _kernel(name, ["q", *inputs, "scale"], ["out", *also], source, header)(
        inputs=[queries, *inputs.values(), scale_arr],
        template=[("D", d), ("HQ", n_heads), ("HKV", kv_heads), ("HT", all_heads), ("WARPS", _DECODE_WARPS),
                  ("UNROLL", _DECODE_UNROLL), *template],  # fmt: skip
        grid=(B * n_heads * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )


def launch_grouped(name: str, source: str, queries: mx.array, kv_heads: int, inputs: dict, scale: float,
                   also: dict, columns: int, q_heads: int | None = None, flat: bool = False) -> list:  # fmt: skip
    """`launch` for the grouped kernels (a block per row, kv head, up to
    GROUP_HEADS of its query heads and chunk of a row's at most `columns`
    positions; see GROUP_HEADER): the same outputs."""
    B, all_heads, _, d = queries.shape
    n_heads = q_heads or all_heads
    group = n_heads // kv_heads
    units = B * kv_heads * -(-group // GROUP_HEADS)
    chunks = group_chunks(units, columns, d)
    scale_arr = constant(("scale", scale), lambda: mx.array([scale], mx.float32))
    shapes, dtypes = _out_shapes(queries, n_heads, flat, also)
    return _kernel(name, ["q", *inputs, "scale", "scratch"], ["out", *also], source, GROUP_HEADER)(
        inputs=[queries, *inputs.values(), scale_arr, _scratch(units, min(group, GROUP_HEADS), d)],
        template=[("D", d), ("HQ", n_heads), ("HKV", kv_heads), ("HT", all_heads),
                  ("TILE", group_tile(d, queries.dtype.size, group))],  # fmt: skip
        grid=(units * chunks * group_threads(d), 1, 1),
        threadgroup=(group_threads(d), 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )


def _scratch(units: int, heads: int, dim: int) -> mx.array:
    """The grouped kernels' counters (zero between launches: the last block of
    a unit resets its own) and room for every block's partial sums at the most
    chunks `group_chunks` gives `units`; one buffer per shape, kept."""
    most = units * -(-GROUP_BLOCKS // units) * heads * (dim + 2)
    return constant(("group_scratch", units, most), lambda: mx.zeros((units + most,), mx.float32))
