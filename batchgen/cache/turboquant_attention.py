"""TurboQuant attention straight from the codes (cache/turboquant.py's forms).

In the rotated domain: (R q).(R k) == q.k for orthogonal R, and sum_j p_j R v_j ==
R (sum_j p_j v_j), so the L_q queries and outputs are rotated instead of all L keys and
values; a coded key is scale_j / sqrt(d) * c_j (c_j its codebook values), so the scales
multiply the L_q x L scores and probabilities, never an L x d array.

    rotated_attention   the reading rule as plain ops, one block of queries
    fused_attention     the same as one masked mx.fast attention call (cuDNN on CUDA)
    CodedHistory        scores and weighted values of the coded positions (the tq_scores
                        / tq_values kernel ops where they run, ops elsewhere)

Both forms equal turboquant/reference.py (tests/test_turboquant.py).
"""

from __future__ import annotations

import math
from typing import Tuple

import mlx.core as mx

from ..kernels.turboquant import SCORES, VALUES
from ..turboquant.codec import dequantize_rotated, levels

class CodedHistory:
    """One layer's coded tokens (a TurboQuantKVCache's positions sink_tokens .. offset
    - 1, or a batch step's columns) as attention reads them, in the rotated domain:
    scores of queries against the keys, and
    probability-weighted sums of the values. A coded vector is scale / sqrt(d) times
    its codebook values, so the scales multiply the L_q x L scores and probabilities,
    never an L x d array."""

    def __init__(self, cache, dtype):
        self.cache, self.dtype, self.n = cache, dtype, cache._n_coded
        self.n_kv_heads = cache.key_codes.shape[1]
        self._decoded = {}  # ops path: codebook values, once per call (not per query block)

    def decoded(self) -> Tuple[mx.array, mx.array]:
        """Keys and values as vectors in the rotated domain, model dtype."""
        c, n = self.cache, self.n
        k = dequantize_rotated(c.key_codes[:, :, :n], c.key_norms[:, :, :n], c.key_bits, c.key_dim)
        v = dequantize_rotated(c.value_codes[:, :, :n], c.value_norms[:, :, :n], c.value_bits, c.value_dim)
        return k.astype(self.dtype), v.astype(self.dtype)

    def _values_of(self, which: str) -> mx.array:
        """Codebook values (model dtype, not yet scaled) of the keys ("k") or values ("v")."""
        if which not in self._decoded:
            c = self.cache
            keys = which == "k"
            words = c.key_codes if keys else c.value_codes
            bits, dim = (c.key_bits, c.key_dim) if keys else (c.value_bits, c.value_dim)
            self._decoded[which] = levels(words[:, :, : self.n], bits, dim).astype(self.dtype)
        return self._decoded[which]

    def scores(self, q: mx.array) -> mx.array:
        """q (B, Hkv, G, L_q, d), scaled and rotated -> float32 (B, Hkv, G, L_q, n)."""
        c, n = self.cache, self.n
        B, H, G, L, d = q.shape
        flat_q = q.reshape(B * H, G * L, d).astype(mx.float32)
        codes = c.key_codes.reshape(B * H, *c.key_codes.shape[2:])
        scales = c.key_norms.reshape(B * H, -1)
        if SCORES.takes(flat_q, codes, scales, c.key_bits, n):
            return SCORES.kernel_form(flat_q, codes, scales, c.key_bits, n).reshape(B, H, G, L, n)
        # The ops path multiplies in the model's dtype (Metal, CPU).
        k = self._values_of("k")
        s = (q @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32)
        return s * (c.key_norms[:, :, :n].astype(mx.float32) * (1.0 / math.sqrt(d)))[:, :, None, None, :]

    def values(self, p: mx.array) -> mx.array:
        """p float32 (B, Hkv, G, L_q, n) -> sum_j p_j v_j (B, Hkv, G, L_q, d_v), model dtype."""
        c, n, d = self.cache, self.n, self.cache.value_dim
        B, H, G, L, _ = p.shape
        p = p * (c.value_norms[:, :, :n].astype(mx.float32) * (1.0 / math.sqrt(d)))[:, :, None, None, :]
        flat_p = p.reshape(B * H, G * L, n)
        codes = c.value_codes.reshape(B * H, *c.value_codes.shape[2:])
        if VALUES.takes(flat_p, codes, c.value_bits, d):
            return VALUES.kernel_form(flat_p, codes, c.value_bits, d).reshape(B, H, G, L, d).astype(self.dtype)
        v = self._values_of("v")
        return p.astype(self.dtype) @ v[:, :, None]


SCORE_BYTES = 128 << 20


def query_block(n_q_heads: int, keys: int) -> int:
    """Queries attended together in a prefill chunk: their float32 scores over
    `keys` positions stay within SCORE_BYTES, at least 16, at most 512 (a block's
    scores live in several temporaries at once: bench/RESULTS.md#turboquant-prefill)."""
    return max(16, min(512, SCORE_BYTES // (4 * n_q_heads * max(keys, 1))))


# Prefill passes of this many queries or more take the fused form by default (CUDA);
# shorter ones (prompt-lookup verify) would build a cuDNN plan per shape.
FUSED_PREFILL_QUERIES = 64
_FUSED_MASK: list = [None, None]  # (key, mask) of the last pass: every layer shares it


def forget_prefill_mask() -> None:
    """Let the last prefill's mask (L_q x context) go: decoding has begun."""
    if _FUSED_MASK[0] is not None:
        _FUSED_MASK[:] = [None, None]


def fused_shape(L_q: int, keys: int) -> Tuple[int, int]:
    """The (queries, keys) a fused pass is padded to: queries to the next power of
    two, keys to a multiple of max(128, that). cuDNN builds a plan per shape, 50-120 ms
    on an H100 (bench/RESULTS.md#turboquant-prefill-plans), more than the pass itself:
    unpadded, every prompt of a one-at-a-time run built its own. The padding is
    attention only (none of the projections): under twice the queries, and under one
    more multiple of the padded queries in keys (up to ~4x the attention of a prompt
    with no cached prefix, under 2x over a long one). A plan cache kept across
    processes, or passes long enough that the attention dominates, would undo it.

    >>> [fused_shape(L, k) for L, k in ((1, 5), (100, 130), (300, 700), (512, 1025))]
    [(1, 128), (128, 256), (512, 1024), (512, 1536)]
    """
    queries = 1 << max(0, L_q - 1).bit_length()
    tile = max(128, queries)
    return queries, -(-keys // tile) * tile


def fused_prefill_mask(
    L_q: int, end: int, n_sink: int, n_tail: int, window: int, width: int, dtype, rows: int = 0
) -> mx.array:
    """The reading rule as an additive mask (1, 1, max(L_q, rows), width) over the
    columns [sinks and codes of positions 0 .. end - 1, exact tail end - n_tail ..
    end - 1, padding]: query i reads j <= i from its exact copy when i - window < j
    and j is past the sinks, from its codes (or sink) otherwise. Rows past L_q
    (padding queries, whose outputs are dropped) read every column.

    E.g. queries at 3 and 4 (L_q 2, end 5), no sinks, a tail of 3 (positions 2..4),
    window 2, width 8 -> readable (1) columns, codes 0..4 | tail 2..4:
        query 3: 1 1 0 0 0 | 1 1 0
        query 4: 1 1 1 0 0 | 0 1 1
    """
    key = (L_q, end, n_sink, n_tail, window, width, dtype, rows)
    if _FUSED_MASK[0] == key:
        return _FUSED_MASK[1]
    q_pos = mx.arange(end - L_q, end)[:, None]
    k_pos = mx.arange(end)[None]
    t_pos = mx.arange(end - n_tail, end)[None]

    def exact(j):
        return (q_pos - j < window) & (q_pos >= j) & (j >= n_sink)

    stored = (q_pos >= k_pos) & ~(exact(k_pos) & (k_pos >= end - n_tail))
    padding = mx.zeros((L_q, width - end - n_tail), mx.bool_)
    readable = mx.concatenate([stored, exact(t_pos), padding], axis=1)
    if rows > L_q:
        readable = mx.concatenate([readable, mx.ones((rows - L_q, width), mx.bool_)], axis=0)
    bias = mx.where(readable, 0.0, -mx.inf).astype(dtype)[None, None]
    # Kept for the next layer of the same pass (one entry: the last pass's).
    _FUSED_MASK[:] = [key, bias]
    return bias


def fused_attention(q, parts, end, window, scale):
    """`rotated_attention` as one mx.fast.scaled_dot_product_attention call: the
    codes decoded to the model dtype (rotated domain, scales folded in), sinks and the
    exact tail beside them, the reading rule as a mask. On CUDA that is cuDNN's fused
    attention: no L_q x L float32 scores in memory, one kernel instead of dozens of ops
    per block of queries (bench/RESULTS.md#turboquant-prefill). q rotated, not
    scaled; padded to `fused_shape` (zero queries, zero keys never read)."""
    sinks, coded, tail = parts
    keys, values = [], []
    for part in (sinks, coded.decoded() if coded is not None else None, tail):
        if part is not None:
            keys.append(part[0])
            values.append(part[1])
    n_sink = 0 if sinks is None else sinks[0].shape[2]
    n_tail = 0 if tail is None else tail[0].shape[2]
    L_q = q.shape[2]
    rows, width = fused_shape(L_q, end + n_tail)
    if width > end + n_tail:
        pad = (*keys[0].shape[:2], width - end - n_tail)
        keys.append(mx.zeros((*pad, keys[0].shape[3]), keys[0].dtype))
        values.append(mx.zeros((*pad, values[0].shape[3]), values[0].dtype))
    if rows > L_q:
        q = mx.pad(q, [(0, 0), (0, 0), (0, rows - L_q), (0, 0)])
    bias = fused_prefill_mask(L_q, end, n_sink, n_tail, window, width, q.dtype, rows)
    out = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), scale=scale, mask=bias
    )
    return out if rows == L_q else out[:, :, :L_q]


def rotated_attention(q, parts, end, window, mask):
    """Attention of scaled, rotated queries q (B, Hq, L_q, d) at positions
    end - L_q .. end - 1 over the cached positions (sinks, then codes, with the exact
    tail overriding where a query's window reaches)."""
    sinks, coded, tail = parts
    B, n_q_heads, L_q, _ = q.shape
    n_sink = 0 if sinks is None else sinks[0].shape[2]
    n_kv_heads = sinks[0].shape[1] if sinks is not None else coded.n_kv_heads
    q = q.reshape(B, n_kv_heads, n_q_heads // n_kv_heads, L_q, -1)

    def keys_t(x):  # (B, Hkv, L, d) -> (B, Hkv, 1, d, L): shared by a group's heads
        return x[:, :, None].swapaxes(-1, -2)

    def grouped(x):  # (B, Hkv, L, d) -> (B, Hkv, 1, L, d)
        return x[:, :, None]

    scores = []
    if sinks is not None:
        scores.append((q @ keys_t(sinks[0])).astype(mx.float32))
    if coded is not None:
        scores.append(coded.scores(q))
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    total = scores.shape[-1]
    q_pos = mx.arange(end - L_q, end)[:, None]
    causal = q_pos >= mx.arange(total)[None]

    exact = None
    if tail is not None:
        n = tail[0].shape[2]
        t_pos = mx.arange(total - n, total)[None]
        # Sink positions are exact already and served by the sink term below.
        exact = (q_pos - t_pos < window) & (q_pos >= t_pos) & (t_pos >= n_sink)
        t_scores = (q @ keys_t(tail[0])).astype(mx.float32)
        last = mx.where(exact, t_scores, scores[..., total - n :])
        scores = mx.concatenate([scores[..., : total - n], last], axis=-1)

    if isinstance(mask, mx.array):
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)  # the group axis
        if mask.dtype == mx.bool_:
            causal = causal & mask
        else:
            scores = scores + mask
    # None (a single query) and "causal" are both the causal mask at these positions.
    scores = mx.where(causal, scores, -mx.inf)
    p = mx.softmax(scores, axis=-1, precise=True)

    out = None
    if exact is not None:
        p_last = p[..., total - n :]
        out = mx.where(exact, p_last, 0).astype(q.dtype) @ grouped(tail[1])
        p = mx.concatenate([p[..., : total - n], mx.where(exact, 0, p_last)], axis=-1)
    if sinks is not None:
        o = p[..., :n_sink].astype(q.dtype) @ grouped(sinks[1])
        out = o if out is None else out + o
    if coded is not None:
        o = coded.values(p[..., n_sink:])
        out = o if out is None else out + o
    return out.reshape(B, n_q_heads, L_q, -1)


