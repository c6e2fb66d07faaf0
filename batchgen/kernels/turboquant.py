"""TurboQuant's CUDA kernel ops: attention pieces straight from packed codes, the
encoder, and one job's whole decode step (sources in cuda/, reading rule in
turboquant/reference.py).

    tq_scores   s[m, j] = scale_j / sqrt(d) * sum_i q[m, i] * table[code_j(i)]
    tq_values   o[m, i] = sum_j p[m, j] * table[code_j(i)]
    tq_encode   codec.quantize on the GPU, one warp a vector
    tq_step     a one-token step's attention over sinks + codes + exact window, with
                the window's update, in one launch

Why kernels at all: on the ops path a GPU decode step unpacks every cached token's codes
through a dozen small ops per layer, and that chain, not the bytes, bounds the step
(bench/RESULTS.md#turboquant-step-kernel). Rows of scores/values are the M = group x
queries rows of one kv head (a decode step: the heads of a kv head; a prompt-lookup
verify pass: times its queries).
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..turboquant.codec import Rotation, codebook_arrays, levels, packed_words, quantize, rotation
from ..turboquant.reference import attention as reference_attention
from .registry import Op, constant, register

MAX_ROWS = 64  # M above this (long prefill chunks) stays on the ops path
VALUE_CHUNK = 64  # tokens per partial sum in `tq_values`
_SCORE_THREADS = 128


def supported(rows: int, dim: int, bits: int) -> bool:
    """Shapes tq_scores / tq_values take: the queries (M x D floats) fit in 32 kB of
    shared memory, and a block of D threads can load the 2**bits-entry table."""
    if rows > MAX_ROWS or dim % 32 or not 32 <= dim <= 256 or 1 << bits > dim:
        return False
    return _bucket(rows) * dim <= 8192


def _bucket(rows: int) -> int:
    """Rows padded to a few sizes, so that the kernels compile a handful of times."""
    for m in (1, 2, 4, 8, 16, 32, 64):
        if rows <= m:
            return m
    raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")


def _pad_rows(x: mx.array, m: int) -> mx.array:
    rows = x.shape[1]
    return x if rows == m else mx.pad(x, [(0, 0), (0, m - rows), (0, 0)])


# --------------------------------------------------------------------------------------
# tq_scores, tq_values: the ops path's two products, from the packed codes


def _scores_kernel(q: mx.array, codes: mx.array, scales: mx.array, bits: int, n: int) -> mx.array:
    bh, rows, dim = q.shape
    m, words = _bucket(rows), codes.shape[-1]
    meta = mx.array([n, codes.shape[1]], dtype=mx.int32)
    out = SCORES.kernel()(
        inputs=[_pad_rows(q, m), codes, scales, codebook_arrays(bits)[0], meta],
        template=[("BITS", bits), ("D", dim), ("M", m), ("W", words)],
        grid=(-(-n // _SCORE_THREADS) * _SCORE_THREADS, bh, 1),
        threadgroup=(_SCORE_THREADS, 1, 1),
        output_shapes=[(bh, m, n)],
        output_dtypes=[mx.float32],
    )[0]
    return out[:, :rows] if m != rows else out


def _scores_reference(q: mx.array, codes: mx.array, scales: mx.array, bits: int, n: int) -> mx.array:
    dim = q.shape[-1]
    keys = levels(codes[:, :n], bits, dim)  # (BH, n, D), unscaled
    return (q @ keys.swapaxes(-1, -2)) * (scales[:, :n].astype(mx.float32) / math.sqrt(dim))[:, None, :]


def _values_kernel(p: mx.array, codes: mx.array, bits: int, dim: int) -> mx.array:
    bh, rows, n = p.shape
    m, words = _bucket(rows), codes.shape[-1]
    chunks = -(-n // VALUE_CHUNK)
    meta = mx.array([n, codes.shape[1]], dtype=mx.int32)
    partial = VALUES.kernel()(
        inputs=[_pad_rows(p, m), codes, codebook_arrays(bits)[0], meta],
        template=[("BITS", bits), ("D", dim), ("M", m), ("W", words), ("CHUNK", VALUE_CHUNK)],
        grid=(chunks * dim, bh, 1),
        threadgroup=(dim, 1, 1),
        output_shapes=[(bh, chunks, m, dim)],
        output_dtypes=[mx.float32],
    )[0]
    out = partial.sum(axis=1)
    return out[:, :rows] if m != rows else out


def _values_reference(p: mx.array, codes: mx.array, bits: int, dim: int) -> mx.array:
    return p @ levels(codes[:, : p.shape[-1]], bits, dim)


def _coded_rows(rows: int, dim: int, bits: int, n: int, seed: int):
    """(codes, scales) of n random vectors in BH = 2 rows, capacity past n."""
    x = mx.random.normal((2, n + 7, dim), key=mx.random.key(seed))
    return quantize(x, bits, rotation(dim, seed))


def _scores_examples():
    out = []
    for dim, bits, rows, n in ((64, 5, 7, 300), (128, 3, 12, 2500), (128, 2, 1, 5)):
        codes, scales = _coded_rows(rows, dim, bits, n, dim + bits)
        q = mx.random.normal((2, rows, dim), key=mx.random.key(rows))
        out.append(((q, codes, scales, bits, n), {}))
    return out


def _values_examples():
    out = []
    for dim, bits, rows, n in ((64, 3, 7, 300), (128, 4, 12, 2500), (128, 2, 1, 5)):
        codes, _ = _coded_rows(rows, dim, bits, n, dim + bits)
        p = mx.softmax(mx.random.normal((2, rows, n), key=mx.random.key(n)), axis=-1)
        out.append(((p, codes, bits, dim), {}))
    return out


SCORES = register(Op(
    "tq_scores", "tq_scores.cu", ("q", "codes", "scales", "table", "meta"), ("out",),
    launch=_scores_kernel, reference=_scores_reference,
    runs=lambda q, codes, scales, bits, n: supported(q.shape[1], q.shape[2], bits),
    examples=_scores_examples,
))  # fmt: skip
VALUES = register(Op(
    "tq_values", "tq_values.cu", ("p", "codes", "table", "meta"), ("out",),
    launch=_values_kernel, reference=_values_reference,
    runs=lambda p, codes, bits, dim: supported(p.shape[1], dim, bits),
    examples=_values_examples,
))  # fmt: skip


def scores(q: mx.array, codes: mx.array, scales: mx.array, bits: int, n: int) -> mx.array:
    """q (BH, M, D) float32, rotated, against the first n coded rows of codes (BH,
    capacity, W) uint32 with scales (BH, capacity) float16: (BH, M, n) float32."""
    return SCORES(q, codes, scales, bits, n)


def values(p: mx.array, codes: mx.array, bits: int, dim: int) -> mx.array:
    """Weights p (BH, M, n) float32 (value scales folded in) over the first n coded
    rows: (BH, M, dim) float32."""
    return VALUES(p, codes, bits, dim)


# --------------------------------------------------------------------------------------
# tq_encode


def encode_supported(dim: int) -> bool:
    """Head dims the encoder (also the step's) takes: powers of two 32..256, the
    rotation a Hadamard transform across a warp's lanes. Any codebook (1-5 bits)."""
    return dim in (32, 64, 128, 256)


def _encode_kernel(x: mx.array, bits: int, rot: Rotation) -> tuple[mx.array, mx.array]:
    dim = x.shape[-1]
    words = -(-dim * bits // 32)
    table, edges = codebook_arrays(bits)
    return ENCODE.kernel()(
        inputs=[x, rot.signs, table, edges],
        template=[("D", dim), ("BITS", bits), ("W", words)],
        grid=(x.size // dim * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(*x.shape[:-1], words), x.shape[:-1]],
        output_dtypes=[mx.uint32, mx.float16],
    )


def _encode_examples():
    return [((mx.random.normal((2, 3, 50, d), key=mx.random.key(d)), b, rotation(d, 3)), {})
            for d, b in ((64, 5), (128, 3), (128, 2), (32, 5), (32, 3))]  # fmt: skip


ENCODE = register(Op(
    "tq_encode", "tq_encode.cu", ("x", "sign", "tab", "edge"), ("codes", "scales"),
    launch=_encode_kernel, reference=quantize,
    runs=lambda x, bits, rot: rot.hadamard and encode_supported(rot.dim),
    examples=_encode_examples,
))  # fmt: skip


def encode(x: mx.array, bits: int, rot: Rotation) -> tuple[mx.array, mx.array]:
    """`codec.quantize` (x (..., D) -> codes (..., W) uint32, scales (...) float16); on
    CUDA the kernel the step encodes with, so that a token's codes are the same
    whichever path stored it."""
    return ENCODE(x, bits, rot)


# --------------------------------------------------------------------------------------
# tq_step: one job's decode step (cuda/tq_step.cu)

STEP_BLOCKS = 512  # blocks aimed at per step and layer (of 128 or 256 threads, 56-96 registers a thread)
# The most tokens one launch takes (grid y), and never more than the cache's window W:
# then no query of the launch reads a code the launch writes.
STEP_TOKENS = 16


def step_supported(dim: int, group: int, key_bits: int, value_bits: int) -> bool:
    """Shapes `step` takes: `encode_supported` dims, the group's queries in shared
    memory (G x D floats, twice, the heads padded to a multiple of 4: still at most
    1024 floats for D >= 64) and a tile of value codes."""
    return encode_supported(dim) and 1 <= group and group * dim <= 1024 and key_bits <= 5 and value_bits <= 4


def step_threads(dim: int) -> int:
    """The step kernel's threads a block (NT), also the positions it scores a tile
    (TILE): 8 warps from D = 128, 4 at 64 (bench/RESULTS.md#turboquant-step-kernel), 2
    at 32 (the values' two groups of D lanes; the new token's two encoding warps)."""
    return 256 if dim > 64 else 128 if dim > 32 else 64


def step_chunks(positions: int, rows: int, dim: int) -> tuple:
    """(chunks, span): positions split into chunks of whole tiles (`step_threads(dim)`
    positions), about STEP_BLOCKS blocks over `rows` (batch x kv heads), and at most
    a tile's worth of chunks a row (the merge: a lane a chunk per warp pass, NT / 32
    passes; a weight a head and chunk in the score tile).

    >>> step_chunks(300, 2, 64), step_chunks(40000, 1, 64)
    ((3, 128), (105, 384))
    """
    tile = step_threads(dim)
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
def step_launch(B: int, n_heads: int, dim: int, kv_heads: int, bits: tuple, slots: int, chunks: int, dtype,
                tokens: int = 1) -> dict:
    """The step kernel's keyword arguments besides inputs (made once per shape). A
    decode step of a small model is bound by host work per launch, which grows with
    the launch's arguments: hence few inputs, outputs and template constants."""
    (kb, vb), threads = bits, step_threads(dim)
    words = dim * (kb + vb) // 32
    # Outputs: out (by token, then head), part (the kernel's tq_part_floats(D) = 2D + 4
    # floats a token, head and chunk), then the window's next arrays. Grid y: the tokens.
    return dict(
        template=[("D", dim), ("G", n_heads // kv_heads), ("HKV", kv_heads), ("KB", kb), ("VB", vb)],
        grid=(B * kv_heads * chunks * threads, tokens, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, tokens, n_heads, dim), (tokens * B * n_heads, chunks, 2 * dim + 4),
                       (B, kv_heads, slots, 2, dim),
                       (B, kv_heads, slots, words), (B, kv_heads, slots, 2)],
        output_dtypes=[dtype, mx.float32, dtype, mx.uint32, mx.float16],
    )  # fmt: skip


def step_counters(rows: int) -> mx.array:
    """The step kernel's finished-block counters, one a (token, row, kv head) (`rows`
    of them): zero at a launch's start, as the last block of each sets it back.

    Whoever launches owns a set and uses it for launches that run one after
    another: a cache's step window (each launch reads the window the last one
    wrote). MLX orders the nodes of a CUDA graph only by the buffers they write,
    so two launches that merely read one set may run at once and miscount (two
    caches' steps in one evaluation did: values of 2.6e38, bench/RESULTS.md
    #turboquant-step-kernel). A real buffer of at least 64 bytes: mx.zeros may be
    a broadcast scalar (the kernel would overrun it), and MLX keeps arrays of at
    most 8 bytes in managed memory, where GPU atomics are slow."""
    return mx.array(np.zeros(max(16, rows), np.uint32))


_last_meta: list = [None, None]  # (fields, array) of the last step


def step_meta(fields: tuple) -> mx.array:
    """`step`'s meta array for `fields`, made on the device where it can be.

    Every layer of a step shares one array. From one step to the next the fields
    usually move by 0 or 1 each (the position, the window's edge): that array is the
    last one plus a small constant, one device op, instead of a new host array whose
    first use by a kernel costs a host-to-device transfer. Any other change makes a
    host array.
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


def _step_kernel(q, new, sinks, coded, window, books, meta, chunks: int, bits: tuple, counters=None):
    B, n_heads, L, dim = q.shape
    kv_heads = new[0].shape[1]
    launch = step_launch(B, n_heads, dim, kv_heads, bits, window[0].shape[2], chunks, q.dtype, L)
    count = step_counters(B * kv_heads * L) if counters is None else counters
    outs = STEP.kernel()(inputs=[q, *new, *sinks, *coded, *window, books, meta, count], **launch)
    # (B, L, Hq, D) as (B, Hq, L, D): the model's next op moves it back, a free reshape.
    return outs[0].transpose(0, 2, 1, 3), tuple(outs[2:])


def _step_reference(q, new, sinks, coded, window, books, meta, chunks: int, bits: tuple, counters=None):
    """What tq_step computes, by the reading rule (turboquant/reference.py): token by
    token, the token encoded into its window slot, then its query's attention over
    positions 0 .. p (a pass of L tokens reads as L steps)."""
    fields = [int(x) for x in np.array(meta)]
    p0, e0, W = fields[0], fields[6], fields[10]
    outs = []
    for i in range(q.shape[2]):
        fields[0], fields[6] = p0 + i, max(e0, p0 + i - W + 1)
        out, window = _step_reference_one(q[:, :, i : i + 1], tuple(x[:, :, i : i + 1] for x in new), sinks, coded,
                                          window, books, fields, bits)  # fmt: skip
        outs.append(out)
    return mx.concatenate(outs, axis=2), window


def _step_reference_one(q, new, sinks, coded, window, books, fields: list, bits: tuple):
    p, S, _, cb, r0, _, e0, _, _, _, _ = fields
    (kb, vb), (k_new, v_new) = bits, new
    dim = k_new.shape[-1]
    rot = Rotation.from_signs(books[:dim])
    scale = books[dim].item()
    wx, wc, wq = window
    kw = packed_words(dim, kb)
    slot = p - r0

    def put(buf, x):
        return mx.concatenate([buf[:, :, :slot], x.astype(buf.dtype), buf[:, :, slot + 1 :]], axis=2)

    ck, sk = quantize(k_new, kb, rot)
    cv, sv = quantize(v_new, vb, rot)
    wx, wc, wq = (put(wx, mx.stack([k_new, v_new], axis=3)), put(wc, mx.concatenate([ck, cv], axis=-1)),
                  put(wq, mx.stack([sk, sv], axis=-1)))  # fmt: skip

    def stored(which: int, big_codes, big_scales, lo: int, hi: int, bits_: int):
        """Positions 0 .. p: exact vectors where the kernel has them (sinks, the
        window's slots from r0 on), decoded codes (big buffers below cb, window
        slots above) from S on; zeros where a form is never read."""
        first = max(S, r0)  # the window's slots may also hold sink positions: those are read from the sinks
        exact = mx.concatenate([sinks[which][:, :, :S].astype(mx.float32), mx.zeros((*wx.shape[:2], first - S, dim)),
                                wx[:, :, first - r0 : p + 1 - r0, which].astype(mx.float32)], axis=2)  # fmt: skip
        codes = mx.concatenate([big_codes[:, :, : cb - S], wc[:, :, cb - r0 : p + 1 - r0, lo:hi]], axis=2)
        scale_ = mx.concatenate([big_scales[:, :, : cb - S], wq[:, :, cb - r0 : p + 1 - r0, which]], axis=2)
        decoded = rot.inverse(codes_to_rotated(codes, scale_, bits_, dim))
        return exact, mx.concatenate([mx.zeros((*decoded.shape[:2], S, dim)), decoded], axis=2)

    kc, kq, vc, vq = coded
    keys, dec_keys = stored(0, kc, kq, 0, kw, kb)
    values, dec_values = stored(1, vc, vq, kw, wc.shape[-1], vb)
    window_len = p - e0 + 1  # the kernel reads e0 .. p exactly: e0 = max(S, p - window + 1, r0)
    out = reference_attention(q, mx.array([p]), keys, values, dec_keys, dec_values,
                              sink_tokens=S, window=window_len, scale=scale)  # fmt: skip
    return out.astype(q.dtype), (wx, wc, wq)


def codes_to_rotated(codes: mx.array, scales: mx.array, bits: int, dim: int) -> mx.array:
    """Codes -> float32 vectors in the rotated domain (R x)."""
    return levels(codes, bits, dim) * (scales.astype(mx.float32)[..., None] * (1.0 / math.sqrt(dim)))


def step_arguments(n_heads: int, kv_heads: int, dim: int, positions: int, *, sink_tokens: int = 4,
                   window: int = 8, bits: tuple = (5, 3), r0_back: int = 11, dtype=mx.float32, seed: int = 0,
                   tokens: int = 1):
    """Arguments of one tq_step call over `positions` random past positions and
    `tokens` new ones (a window of 44 slots starting `r0_back` positions before the
    first new token; codes below the window's first slot in the big buffers), for
    tests and benchmarks."""
    kb, vb = bits
    slots, p, S = 44, positions, sink_tokens
    r0 = p - r0_back
    cb = r0 + 3  # the window's first three slots already flushed
    keys = mx.random.normal((1, kv_heads, p + tokens, dim), key=mx.random.key(seed))
    vals = mx.random.normal((1, kv_heads, p + tokens, dim), key=mx.random.key(seed + 1))
    rot = rotation(dim, seed)
    ck, sk = quantize(keys, kb, rot)
    cv, sv = quantize(vals, vb, rot)
    # Dense, as the cache hands them over (the kernel indexes them as dense rows).
    big = tuple(mx.contiguous(x[:, :, S:cb]) for x in (ck, sk, cv, sv))
    pad = slots - (p - r0)

    def win(x):  # positions r0 .. p - 1 in slots 0 .., the rest (the new token's slot on) zeros
        return mx.pad(x[:, :, r0:p], [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))

    window_ = (win(mx.stack([keys, vals], axis=3)).astype(dtype), win(mx.concatenate([ck, cv], axis=-1)),
               win(mx.stack([sk, sv], axis=-1)))  # fmt: skip
    q = mx.random.normal((1, n_heads, tokens, dim), key=mx.random.key(seed + 2)).astype(dtype)
    new = (keys[:, :, p:].astype(dtype), vals[:, :, p:].astype(dtype))
    sinks = (mx.contiguous(keys[:, :, :S].astype(dtype)), mx.contiguous(vals[:, :, :S].astype(dtype)))
    chunks, span = step_chunks(p + tokens, kv_heads * tokens, dim)
    books = step_books(rot.signs, *codebook_arrays(kb), *codebook_arrays(vb), dim**-0.5)
    e0 = max(S, p - window + 1, r0)
    meta = mx.array([p, S, big[0].shape[2], cb, r0, chunks, e0, slots, S, span, window], mx.int32)
    return q, new, sinks, big, window_, books, meta, chunks, bits


def _step_examples():
    # Passes of 6 tokens too (a prompt-lookup verify pass), one crossing a chunk's edge.
    shapes = ((14, 2, 64, 700, 1), (28, 4, 128, 3000, 1), (32, 2, 64, 900, 1), (8, 2, 256, 500, 1), (8, 4, 32, 300, 1),
              (14, 2, 64, 700, 6), (28, 4, 128, 3000, 6), (8, 4, 32, 380, 6))
    return [((*step_arguments(h, kv, d, n, seed=n, tokens=t),), {}) for h, kv, d, n, t in shapes]


STEP = register(Op(
    "tq_step", "tq_step.cu",
    ("q", "kn", "vn", "sk", "sv", "kc", "kq", "vc", "vq", "wx", "wc", "wq", "books", "meta", "count"),
    ("out", "part", "wx_out", "wc_out", "wq_out"),
    launch=_step_kernel, reference=_step_reference,
    runs=lambda q, new, *rest, counters=None: q.shape[2] <= STEP_TOKENS and step_supported(
        q.shape[3], q.shape[1] // new[0].shape[1], *rest[-1]),
    examples=_step_examples,
    tolerance=2e-3,  # D = 128 takes the coded products on tensor cores, fp16 operands
    contiguous=False,  # q and the new token are read through their strides, no copy
))  # fmt: skip


def step(q, new, sinks, coded, window, books, meta, chunks: int, bits: tuple, counters=None):
    """One decode step's attention, or a short pass's of L <= min(W, STEP_TOKENS) tokens
    at positions p0 .. p0 + L - 1. q (B, Hq, L, D); new = (k, v) (B, Hkv, L, D); sinks
    = (k, v) (B, Hkv, SS, D); coded = (kc, kq, vc, vq) the big buffers; window = (wx (B,
    Hkv, N, 2, D) exact keys and values, wc (B, Hkv, N, WK + WV) key then value codes, wq
    (B, Hkv, N, 2) their scales); books from `step_books`; meta int32 [p0, S, cap, cb, r0,
    chunks, e0, N, SS, span, W]; counters from `step_counters` (fresh ones if None).
    Returns (out (B, Hq, L, D) in q's dtype, the window's next arrays)."""
    return STEP(q, new, sinks, coded, window, books, meta, chunks, bits, counters=counters)
