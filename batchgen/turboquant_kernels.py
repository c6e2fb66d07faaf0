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

import mlx.core as mx

MAX_ROWS = 64  # M above this (long prefill chunks) stays on the ops path
VALUE_CHUNK = 64  # tokens per partial sum in `values`
_SCORE_THREADS = 128

_UNPACK = """
template <int BITS>
__device__ __forceinline__ unsigned int tq_code(const unsigned int* row, int i) {
  const int pos = i * BITS;
  const int w = pos >> 5, s = pos & 31;
  unsigned int c = row[w] >> s;
  if (s + BITS > 32) c |= row[w + 1] << (32 - s);
  return c & ((1u << BITS) - 1u);
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
