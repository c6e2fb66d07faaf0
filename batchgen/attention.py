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
plain `KVCache` layers marked by `mark_cache` (the engine's own caches), so
another model of the same architecture in the process (the plain mlx-lm side
of a benchmark) keeps the stock path, and other caches (TurboQuant's own
attention, batch caches) keep theirs.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache

DEFAULT_MAX_QUERIES = 256
_ATTR = "scaled_dot_product_attention"
_MARK = "batchgen_short_attention"


def mark_cache(cache: list) -> list:
    """Let the hook serve these cache layers (clones keep the mark)."""
    for c in cache:
        if type(c) is KVCache:
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
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    elif mask is not None or L > 1:  # "causal": query i sits at position S - L + i
        causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        scores = mx.where(causal, scores, -mx.inf)
    probs = mx.softmax(scores.astype(mx.float32), axis=-1, precise=True).astype(values.dtype)
    return (probs @ values[:, :, None]).reshape(B, n_heads, L, -1)


def _wrap(inner, max_queries: int):
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        L = queries.shape[2]
        if 1 < L <= max_queries and sinks is None and type(cache) is KVCache and getattr(cache, _MARK, False):
            return short_attention(queries, keys, values, scale, mask)
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
