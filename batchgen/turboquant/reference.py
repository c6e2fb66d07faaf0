"""TurboQuant attention, the reference: what a query reads, written as plain attention.

A TurboQuant cache of one sequence holds, for its positions 0 .. n - 1,
    sinks    the first S positions, exact (S = sink_tokens)
    codes    every position j >= S, as (codes, scale) of R x_j   (codec.quantize)
    recent   exact copies of the last few positions (what the window below needs)
A query at position i reads position j <= i
    exactly     where j < S (a sink) or i - window < j (its own window: itself and the
                window - 1 positions before it),
    decoded     elsewhere:  x_j ~ R^T (scale_j / sqrt(d) * levels(codes_j))
and attends as any attention does:  out_i = sum_j softmax_j(scale * q_i . k_j) v_j.
Every token is encoded once, from its own vector alone, so what a query reads never
depends on how the sequence was chunked (prefill chunks, prompt-cache reuse, verify
passes, batch rows): all of those must give what `attention` gives here.

This module is the reference, not a fast path: it takes every position both exact and
decoded (`decoded_like`) and builds the L_q x n choice between them explicitly. The faster forms
(the cache's rotated-domain ops, its fused-attention form, the batch rows, the CUDA
kernels) are tested against it (tests/test_turboquant_reference.py and the kernel
registry's parity test).
"""

from __future__ import annotations

import mlx.core as mx

from .codec import Rotation, dequantize


def read_exactly(q_positions: mx.array, n: int, sink_tokens: int, window: int) -> mx.array:
    """(L_q, n) bool: which positions each query reads exactly (the rest it reads
    from their codes, or not at all where j > i).

    >>> read_exactly(mx.array([5, 6]), 7, sink_tokens=2, window=2).astype(mx.int32).tolist()
    [[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1]]
    """
    i = q_positions[:, None]
    j = mx.arange(n)[None]
    return (j <= i) & ((j < sink_tokens) | (i - window < j))


def decoded_like(exact: mx.array, codes: mx.array, scales: mx.array, bits: int, rot: Rotation,
                 sink_tokens: int) -> mx.array:  # fmt: skip
    """What a cache's codes decode to, shaped like `exact` (B, H, n, d): positions
    sink_tokens .. n - 1 from codes / scales (B, H, n - sink_tokens, ...), the sinks
    zeros (never read decoded)."""
    n = exact.shape[2]
    coded = dequantize(codes[:, :, : n - sink_tokens], scales[:, :, : n - sink_tokens], bits, rot)
    sinks = mx.zeros((*exact.shape[:2], min(sink_tokens, n), exact.shape[-1]), mx.float32)
    return mx.concatenate([sinks, coded], axis=2)


def attention(
    queries: mx.array,
    q_positions: mx.array,
    keys: mx.array,
    values: mx.array,
    decoded_keys: mx.array,
    decoded_values: mx.array,
    *,
    sink_tokens: int,
    window: int,
    scale: float,
) -> mx.array:
    """softmax(scale q k^T) v by the reading rule, in float32.

    queries (B, Hq, L_q, d) at positions `q_positions` (L_q,); keys / values (B, Hkv,
    n, d) the exact vectors and decoded_keys / decoded_values (same shapes) what the
    codes decode to (`decoded_like`): each is read only where `read_exactly` says it
    is (elsewhere it may hold anything). Grouped-query heads share their kv head;
    positions past a query's own are masked. Returns (B, Hq, L_q, d_v) float32.
    """
    B, n_heads, L, d = queries.shape
    n_kv, n = keys.shape[1], keys.shape[2]
    exact = read_exactly(q_positions, n, sink_tokens, window)  # (L_q, n)
    # Per query, its own view of the keys and values: (B, Hkv, L_q, n, d).
    pick = exact[None, None, :, :, None]
    k = mx.where(pick, keys.astype(mx.float32)[:, :, None], decoded_keys.astype(mx.float32)[:, :, None])
    v = mx.where(pick, values.astype(mx.float32)[:, :, None], decoded_values.astype(mx.float32)[:, :, None])
    q = queries.astype(mx.float32).reshape(B, n_kv, n_heads // n_kv, L, 1, d)
    scores = (q * k[:, :, None]).sum(-1) * scale  # (B, Hkv, G, L_q, n)
    causal = mx.arange(n)[None] <= q_positions[:, None]
    p = mx.softmax(mx.where(causal, scores, -mx.inf), axis=-1, precise=True)
    out = (p[..., None] * v[:, :, None]).sum(-2)  # (B, Hkv, G, L_q, d_v)
    return out.reshape(B, n_heads, L, values.shape[-1])
