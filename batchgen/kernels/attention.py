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
`KVCache` layers, and batches' `BatchKVCache` layers, marked by `mark_cache` (the engine's own caches), so
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

from .turboquant import available as _cuda  # CUDA present, the default device a GPU
from .turboquant import constant

# Head sizes the batch attention kernels take: D / 8 lanes read a position, a
# power of two that divides a warp.
KERNEL_HEAD_SIZES = (32, 64, 128, 256)


def kernel_head_size(*arrays) -> bool:
    """What the batch attention kernels (this module) take: one head size over
    all these arrays, one of `KERNEL_HEAD_SIZES`.

    >>> [kernel_head_size(mx.zeros((1, d))) for d in (32, 64, 96, 128, 256, 512)]
    [True, True, False, True, True, False]
    """
    d = arrays[0].shape[-1]
    return all(a.shape[-1] == d for a in arrays) and d in KERNEL_HEAD_SIZES


def kernel_takes(*arrays) -> bool:
    """A step kernel's needs: one dtype (it picks each position's pointer
    from several buffers) and `kernel_head_size`."""
    return len({a.dtype for a in arrays}) == 1 and kernel_head_size(*arrays)


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
            if 1 < L <= max_queries and type(cache) in (KVCache, BatchKVCache):
                return short_attention(queries, keys, values, scale, mask)
            if L == 1 and type(cache) is BatchKVCache and batch_decode_supported(queries, cache):
                bounds = batch_cache_bounds(cache)
                return batch_decode_attention(queries, cache.keys, cache.values, cache.left_padding, bounds, scale)
        if getattr(cache, "steps_new_token", False) and cache.new is not None:  # a StepCache fed its token, not holding it
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

_DECODE_WARPS = 16
_DECODE_UNROLL = 4

# Loads of a lane's PER = 8 coordinates as float: one 16-byte load for 16-bit
# types (two for float32) where the address allows it (every row starts at a
# multiple of D >= 32 elements), else eight plain loads.
HEADER = """
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
"""

# One block per (row, query head) `bh`; QP points at its query. A column
# (position) is read by LPC = D / 8 lanes, 8 coordinates each, so a warp reads
# CPW = 32 / LPC columns at once, UNROLL rounds of them together (their loads
# in flight together: one key after another would wait on memory latency).
# (A lane per D / 32 coordinates and a column a warp at a time spent most of a
# column's instructions on the 5-step shuffle sum and the column's bookkeeping.)
# The warps take the columns from the row's first real position
# (left_padding[b]) to the last; each lane group keeps an online softmax
# (running max m, sum l, weighted values acc), and the WARPS x CPW partial
# results are merged at the end through shared memory. KEY(j) / VAL(j) point
# at position j's vectors; the kernels below differ only in where positions
# live.
LANE_PART = """
  constexpr int PER = 8, LPC = D / PER, CPW = 32 / LPC, NP = WARPS * CPW;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane / LPC, sub = lane % LPC, pid = warp * CPW + grp;
  const float sc = scale[0];
"""

# The first warp turns the NP lane groups' (m, l) into each partial's weight
# `wt` and the softmax's denominator `tot`; the caller then sums its NP
# partial vectors (in shared memory) with those weights.
MERGE_WEIGHTS = """
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
"""

_ATTEND_BODY = LANE_PART + """
  float qr[PER], acc[PER];
  ld8(QP + sub * PER, qr);
  #pragma unroll
  for (int i = 0; i < PER; i++) {
    qr[i] *= sc;
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j0 = start + warp * UNROLL * CPW; j0 < stop; j0 += WARPS * UNROLL * CPW) {
    float s[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int j = j0 + u * CPW + grp;
      s[u] = 0.0f;
      if (j < stop) {
        float kx[PER];
        ld8(KEY(j) + sub * PER, kx);
        #pragma unroll
        for (int i = 0; i < PER; i++) s[u] += qr[i] * kx[i];
      }
    }
    float mn = m;
    #pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      #pragma unroll
      for (int o = LPC / 2; o > 0; o >>= 1) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
      if (j0 + u * CPW + grp < stop) mn = fmaxf(mn, s[u]);
    }
    if (mn == -INFINITY) continue;  // none of this group's columns this round (the warp's last)
    const float corr = expf(m - mn);
    l *= corr;
    #pragma unroll
    for (int i = 0; i < PER; i++) acc[i] *= corr;
    #pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      const int j = j0 + u * CPW + grp;
      if (j < stop) {
        const float p = expf(s[u] - mn);
        float vx[PER];
        ld8(VAL(j) + sub * PER, vx);
        l += p;
        #pragma unroll
        for (int i = 0; i < PER; i++) acc[i] += p * vx[i];
      }
    }
    m = mn;
  }
  __shared__ float sacc[NP * D];
  #pragma unroll
  for (int i = 0; i < PER; i++) sacc[pid * D + sub * PER + i] = acc[i];
""" + MERGE_WEIGHTS + """
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    #pragma unroll 4
    for (int x = 0; x < NP; x++) o += sacc[x * D + d] * wt[x];
    out[(size_t)bh * D + d] = tot > 0.0f ? o / tot : 0.0f;
  }
"""

# A BatchKVCache after its update: positions start .. write position - 1 of
# one buffer (meta: [write position, capacity]).
_DECODE_SOURCE = """
  const int bh = blockIdx.x;
  const int b = bh / HQ, hk = (bh % HQ) / (HQ / HKV);
  #define QP (q + (size_t)bh * D)
  const int start = left_padding[b], stop = meta[0], cap = meta[1];
  const size_t row = (size_t)b * HKV + hk;
  #define KEY(j) (k + (row * cap + (j)) * D)
  #define VAL(j) (v + (row * cap + (j)) * D)
""" + _ATTEND_BODY

# The compiled step's cache (`compiled_step.StepCache`): positions below
# `base` in the big buffers k, v; `base` .. `base + used - 1` in the recent
# window rk, rv; the step's own token (kn, vn) at `base + used`, written into
# the window's slot `used` on the way (rk_out, rv_out: by the first query head
# of each key head), so that the step writes no big buffer.
WINDOW_PART = """
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
"""
_STEP_PART = WINDOW_PART + """
  #define KEY(j) ((j) < base ? k + (row * cap + (j)) * D : (j) < base + used ? rk + (row * W + (j) - base) * D : KN)
  #define VAL(j) ((j) < base ? v + (row * cap + (j)) * D : (j) < base + used ? rv + (row * W + (j) - base) * D : VN)
""" + _ATTEND_BODY

STEP_HEAD = """
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  #define QP (q + (size_t)bh * D)
  #define KN (kn + ((size_t)b * HKV + hk) * D)
  #define VN (vn + ((size_t)b * HKV + hk) * D)
"""
_STEP_SOURCE = STEP_HEAD + _STEP_PART

# `step_forward`'s step: q and the new k read from the fused projection after
# RoPE (`q`: (B, HT, D), HT = HQ + 2 HKV heads: q | k | v, all rotated), the
# new v from the projection before it (`heads`), so that nothing is sliced
# (and copied) out of either first.
FUSED_STEP_HEAD = """
  const int bh = blockIdx.x;
  const int b = bh / HQ, h = bh % HQ, hk = h / (HQ / HKV);
  #define QP (q + ((size_t)b * HT + h) * D)
  #define KN (q + ((size_t)b * HT + HQ + hk) * D)
  #define VN (heads + ((size_t)b * HT + HQ + HKV + hk) * D)
"""
_FUSED_STEP_SOURCE = FUSED_STEP_HEAD + _STEP_PART


def batch_decode_supported(queries, cache) -> bool:
    """CUDA, keys and values of one head size that `kernel_head_size` takes."""
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
    out = launch("batch_decode_attention", _DECODE_SOURCE, queries, k.shape[1],
                  {"k": k, "v": v, "left_padding": left_padding.astype(mx.int32), "meta": bounds},
                  scale, {})  # fmt: skip
    return out[0]


def batch_step_attention(queries: mx.array, cache, scale: float) -> mx.array:
    """The compiled step's attention: each row over its positions in the big
    buffers, the recent window and its own new token (`StepCache`); the new
    token's keys and values go into the window (cache.rkeys / rvalues are
    replaced). queries (B, Hq, 1, D) -> (B, Hq, 1, D) in the queries' dtype."""
    k_new, v_new = cache.new
    rk, rv = cache.rkeys, cache.rvalues
    inputs = {"k": cache.keys, "v": cache.values, "rk": rk, "rv": rv, "kn": k_new, "vn": v_new,
              "left_padding": cache.left_padding.astype(mx.int32), "meta": cache.meta}  # fmt: skip
    out, cache.rkeys, cache.rvalues = launch("batch_step_attention", _STEP_SOURCE, queries, rk.shape[1], inputs,
                                              scale, {"rk_out": rk, "rv_out": rv})  # fmt: skip
    return out


def fused_step_attention(roped: mx.array, heads: mx.array, cache, scale: float) -> mx.array:
    """`batch_step_attention` for `step_forward`: `heads` (B, Hq + 2 Hkv, 1, D)
    is the fused q|k|v projection of the step's token, `roped` the same after
    RoPE; q and the new k are read from `roped`, the new v from `heads`.
    Returns (B, Hq * D) in their dtype; the new k and v go into the window
    (cache.rkeys / rvalues are replaced) as there."""
    rk, rv = cache.rkeys, cache.rvalues
    kv_heads = rk.shape[1]
    inputs = {"heads": heads, "k": cache.keys, "v": cache.values, "rk": rk, "rv": rv,
              "left_padding": cache.left_padding.astype(mx.int32), "meta": cache.meta}  # fmt: skip
    out, cache.rkeys, cache.rvalues = launch("fused_step_attention", _FUSED_STEP_SOURCE, roped, kv_heads, inputs,
                                              scale, {"rk_out": rk, "rv_out": rv},
                                              q_heads=roped.shape[1] - 2 * kv_heads, flat=True)  # fmt: skip
    return out


_kernels: dict = {}


def launch(name: str, source: str, queries: mx.array, kv_heads: int, inputs: dict, scale: float,
           also: dict, q_heads: int | None = None, flat: bool = False, template: tuple = (),
           header: str = HEADER) -> list:  # fmt: skip
    """Run kernel `name` over q + `inputs` + scale: out (B, q_heads, 1, D) in
    the queries' dtype (the kernel rounds its float32 sums on the way out, which
    saves each layer of a step a cast of its own), then each output named in
    `also`, shaped like its array there. `q_heads`: the query heads, where
    `queries` holds more heads than that (HT: all of them). `flat`: out as
    (B, q_heads * D), the same memory (the output projection's input).
    `template`: constants besides the shapes; `header`: device functions
    (`HEADER`'s loads among them)."""
    key = (name, source, header)  # a benchmark may run another version's source under the same name
    if key not in _kernels:
        _kernels[key] = mx.fast.cuda_kernel(
            name=name, input_names=["q", *inputs, "scale"], output_names=["out", *also], source=source,
            header=header,
        )  # fmt: skip
    B, all_heads, _, d = queries.shape
    n_heads = q_heads or all_heads
    scale_arr = constant(("scale", scale), lambda: mx.array([scale], mx.float32))
    threads = 32 * _DECODE_WARPS
    return _kernels[key](
        inputs=[queries, *inputs.values(), scale_arr],
        template=[("D", d), ("HQ", n_heads), ("HKV", kv_heads), ("HT", all_heads), ("WARPS", _DECODE_WARPS),
                  ("UNROLL", _DECODE_UNROLL), *template],  # fmt: skip
        grid=(B * n_heads * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, n_heads * d) if flat else (B, n_heads, 1, d)] + [a.shape for a in also.values()],
        output_dtypes=[queries.dtype] + [a.dtype for a in also.values()],
    )
